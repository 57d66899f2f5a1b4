"""--eval-set NAME=GLOB's syntax: the names, the globs, what is refused (one line naming the
flag). The sets' evaluation, a task of the loop, is raygpt.eval.sets."""

from __future__ import annotations

import re

from raygpt.config.errors import ConfigError

FLAG = "--eval-set"
# -j's loss is `val/loss` in TensorBoard and the trackers: a set may not take its name
MAIN_NAME = "loss"
NAME = re.compile(r"[A-Za-z0-9_.-]+")
EXPECTED = "NAME=GLOB (NAME of letters, digits, '_', '.', '-'; GLOB of llm.c token shards)"


def parse(specs) -> list[tuple[str, str]]:
    """[(name, glob)] of --eval-set's values, in their order; ConfigError (one line naming
    --eval-set, what was expected and what was found) for a spec that is not NAME=GLOB, a name
    given twice or the main set's reserved name."""
    out, seen = [], set()
    for spec in specs or ():
        if not isinstance(spec, str):
            raise ConfigError(f"{FLAG}: expected {EXPECTED}, found {spec!r}")
        name, eq, pattern = spec.partition("=")
        if not eq or not NAME.fullmatch(name) or not pattern.strip():
            raise ConfigError(f"{FLAG}: expected {EXPECTED}, found {spec!r}")
        if name == MAIN_NAME:
            raise ConfigError(f"{FLAG}: expected a NAME other than {MAIN_NAME!r} (-j's loss is "
                              f"val/{MAIN_NAME}), found {spec!r}")
        if name in seen:
            raise ConfigError(f"{FLAG}: expected each NAME once, found {name!r} twice")
        seen.add(name)
        out.append((name, pattern))
    return out


def with_patterns(specs, change) -> list[str]:
    """The specs with each glob replaced by `change(name, glob)` (made absolute, given its
    endpoint), names as they were."""
    return [f"{name}={change(name, pattern)}" for name, pattern in parse(specs)]


def patterns(specs) -> list[str]:
    return [pattern for _, pattern in parse(specs)]
