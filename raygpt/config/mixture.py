"""-i's syntax: one plain glob (llm.c's -i), or weighted sources NAME=WEIGHT:GLOB, one per -i,
which the training loader mixes by weight (raygpt.data.mixture). What is refused is one line
naming -i/--input-bin, what was expected and what was found.

The field holds the sources as lines of one string (`-i a=1:x -i b=2:y` is "a=1:x\\nb=2:y"), so
that a run of one plain glob keeps its config, its data fingerprint and its state files as they
were. A value is a weighted source when it starts with NAME=WEIGHT: (a NAME has no '/', so a
path such as data/v=2:x/*.bin stays a plain glob). One weighted source alone is that glob alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from raygpt.config.errors import ConfigError

FLAG = "-i/--input-bin"
EXPECTED = ("GLOB, or NAME=WEIGHT:GLOB once per -i (NAME of letters, digits, '_', '.', '-'; "
            "WEIGHT a number >= 0)")
_WEIGHTED = re.compile(r"([A-Za-z0-9_.-]+)=([^:/]*):(.*)", re.S)


@dataclasses.dataclass(frozen=True)
class Source:
    """One weighted source of -i: its name, its weight as written and as a number, its glob."""

    name: str
    weight_text: str
    weight: float
    pattern: str


def parse(spec: str) -> list[Source] | None:
    """The weighted sources of an -i value, in their order, or None for one plain glob.
    ConfigError (one line) for a weight that is not a finite number >= 0, weights that are all
    0, a NAME given twice, an empty GLOB, or a plain glob beside weighted sources."""
    lines = str(spec).split("\n")
    if len(lines) == 1 and not _WEIGHTED.fullmatch(lines[0]):
        return None
    out: list[Source] = []
    for line in lines:
        m = _WEIGHTED.fullmatch(line)
        if not m:
            raise ConfigError(f"{FLAG}: expected {EXPECTED} when -i is given more than once, "
                              f"found {line!r}")
        name, text, pattern = m.groups()
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"{FLAG} {name}: weight: expected a finite number >= 0, found "
                              f"{text!r}")
        if any(s.name == name for s in out):
            raise ConfigError(f"{FLAG}: expected each NAME once, found {name!r} twice")
        if not pattern.strip():
            raise ConfigError(f"{FLAG} {name}: expected a glob of llm.c token shards after "
                              f"{name}={text}:, found {pattern!r}")
        out.append(Source(name, text, weight, pattern))
    if not sum(s.weight for s in out) > 0:
        raise ConfigError(f"{FLAG}: weights: expected at least one > 0 (their sum is what each "
                          f"is a share of), found {', '.join(f'{s.name}={s.weight_text}' for s in out)}")
    return out


def flags_and_patterns(spec: str) -> list[tuple[str, str]]:
    """(the flag naming it in a message, glob) of each source: [(-i/--input-bin, spec)] for a
    plain glob, [(-i/--input-bin NAME, GLOB), ...] for weighted sources."""
    sources = parse(spec)
    if sources is None:
        return [(FLAG, spec)]
    return [(f"{FLAG} {s.name}", s.pattern) for s in sources]


def patterns(spec: str) -> list[str]:
    return [pattern for _, pattern in flags_and_patterns(spec)]


def with_patterns(spec: str, change) -> str:
    """The spec with each glob replaced by `change(flag, glob)` (made absolute, given its
    endpoint); names and weights as they were written."""
    sources = parse(spec)
    if sources is None:
        return change(FLAG, spec)
    return "\n".join(f"{s.name}={s.weight_text}:{change(f'{FLAG} {s.name}', s.pattern)}"
                     for s in sources)


class AddSource(argparse.Action):
    """-i again adds a source (a line of the field), unless both are plain globs: then the last
    wins, as it always has (a plain glob beside a weighted source is refused by `parse`). The
    first -i of a command line replaces the default or a --config file's value."""

    def __call__(self, parser, namespace, value, option_string=None):
        old = getattr(namespace, self.dest)
        plain = old is None or not any(_WEIGHTED.fullmatch(v) for v in (*old.split("\n"), value))
        setattr(namespace, self.dest, value if plain else f"{old}\n{value}")
