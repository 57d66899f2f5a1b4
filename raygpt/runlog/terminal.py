"""What raygpt prints of a string it read from a file: `printable`.

Everything in a run or sweep directory is untrusted (a shared directory, a hand-edited file):
a string from there may carry terminal escape sequences (retitle the window, clear the screen,
move the cursor over earlier lines), a carriage return that overwrites its own line, bidi
overrides that reorder what is shown, or a newline that forges a line of its own, and a URI may
carry credentials. Every value from a file goes through `printable` before it reaches stdout or
stderr; `printable_lines` guards a whole report whose own lines raygpt made.
"""

from __future__ import annotations

from raygpt.storage import redact


def printable(text) -> str:
    """`str(text)` safe to print on one line of a terminal: credentials in URIs redacted
    (storage.redact), and every control or format character (escape sequences, CR, LF, bidi
    overrides) shown as a visible escape (\\x1b, \\u202e) instead of acting."""
    return "".join(c if c.isprintable() else (f"\\x{ord(c):02x}" if ord(c) < 0x100
                                              else f"\\u{ord(c):04x}")
                   for c in redact(str(text)))


def printable_lines(text: str) -> str:
    """A report of several lines, each made `printable` (its newlines kept)."""
    return "\n".join(printable(line) for line in str(text).split("\n"))
