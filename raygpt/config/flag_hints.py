"""The way out of an unknown flag: the flags its user most likely meant, in one line.

A name another tool gives a knob (nanoGPT's `--max_iters`, Hugging Face's `--lr`...) points at
raygpt's flag for it: each knob declares those names beside itself (`knob(hints=...)` in
raygpt.config). Anything else gets the nearest flags the parser knows, by difflib's ratio.
"""

from __future__ import annotations

import argparse
import difflib


def nearest_flags(unknown: str, known: dict[str, str], hints: dict[str, str],
                  n: int = 3) -> list[str]:
    """The flags (as `known` shows them: flag -> "-l/--learning-rate") a user who typed
    `unknown` most likely meant, best first; [] when none is close. `hints`: another tool's
    name -> raygpt's flag. Case, underscores and a "=VALUE" do not count against a match."""
    typed = unknown.split("=", 1)[0]
    norm = typed.lower().replace("_", "-")
    if not norm.startswith("--") and norm.lstrip("-"):  # -lr, lr: other tools' habits too
        norm = "--" + norm.lstrip("-")
    exact = hints.get(norm) or known.get(norm)
    if exact:
        return [exact]
    # a short flag is two or three letters: a ratio against it means nothing, longs only
    longs = [f for f in (*known, *hints) if f.startswith("--")]
    shown = []
    for match in difflib.get_close_matches(norm, longs, n=n, cutoff=0.7):
        flag = hints.get(match) or known[match]
        if flag not in shown:
            shown.append(flag)
    return shown


def unknown_arguments(extras: list[str], known: dict[str, str], hints: dict[str, str],
                      prog: str) -> str:
    """One line for the arguments a parser did not know (`extras`, as argparse leaves them):
    each unknown flag with the flags nearest to it, or what to read when none is near."""
    flags = [a for a in extras if a.startswith("-") and not _is_number(a)]
    if not flags:
        return (f"expected flags after {prog}, found the argument(s) {' '.join(map(repr, extras))} "
                f"that no flag takes ({prog} --help lists them)")
    parts = []
    for flag in flags:
        typed = flag.split("=", 1)[0]
        near = nearest_flags(flag, known, hints)
        parts.append(f"{typed}: expected a flag of {prog}, found an unknown one"
                     + (f" (did you mean {' or '.join(near)}?)" if near else ""))
    return "; ".join(parts) + ("" if all(nearest_flags(f, known, hints) for f in flags)
                               else f" ({prog} --help lists every flag)")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def shown_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every flag `parser` knows -> how an error shows it (all its names: "-l/--learning-rate")."""
    out = {}
    for action in parser._actions:  # argparse lists its actions nowhere public
        for name in action.option_strings:
            out[name] = "/".join(action.option_strings)
    return out


class HintingParser(argparse.ArgumentParser):
    """argparse whose unknown flags are answered with the nearest known ones (and `hints`:
    another tool's name -> this parser's flag) instead of "unrecognized arguments"."""

    hints: dict[str, str] = {}
    also_known: dict[str, str] = {}
    """Flags another parser of the same command line reads (a sweep's own, beside train's)."""

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            known = {**self.also_known, **shown_flags(self)}
            self._answered = True  # the line says where to look: no usage pointer after it
            self.error(unknown_arguments(extras, known, self.hints, self.prog))
        return ns

    def error(self, message):
        """One line and exit 2 (argparse's usage block above it buried the line that matters)."""
        from raygpt.runlog.terminal import printable  # what the user typed, escaped
        usage = "" if getattr(self, "_answered", False) else f" ({self.prog} --help shows the usage)"
        self.exit(2, f"{self.prog}: error: {printable(message)}{usage}\n")
