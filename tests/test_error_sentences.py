"""Every error message raygpt raises reads as a whole sentence: none ends on a word that needs
another after it ("found byte 0xac that is not", "expected a"), the class of cut-off message a
user once met. Read from the source (ast) at each exception raygpt constructs with a text."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raygpt"
# words a sentence cannot end on
DANGLING = {"a", "an", "the", "not", "that", "which", "whose", "of", "to", "is", "are", "was",
            "be", "and", "or", "but", "with", "for", "by", "from", "in", "into", "on", "at",
            "as", "than", "if", "when", "where", "no", "its", "their", "found", "expected"}


def message_text(node: ast.expr) -> str | None:
    """The text of a message expression with each {} field as "{}"; None when not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = message_text(node.left), message_text(node.right)
        return None if left is None or right is None else left + right
    return None


def cut_off(text: str) -> bool:
    """Whether `text` stops where its sentence cannot: on a dangling word or a comma/colon."""
    tail = text.rstrip()
    if not tail:
        return False
    return tail.endswith((",", ":", ";")) or tail.split()[-1].lower() in DANGLING


def exception_messages(source: str):
    """(line, text) of every exception constructed with a literal message in `source`: a call
    of a name ending in Error, Refused or Failed, or NoModel."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name.endswith(("Error", "Refused", "Failed")) or name == "NoModel":
                text = message_text(node.args[0])
                if text is not None:
                    yield node.lineno, text


def test_the_scan_finds_a_cut_off_message_and_passes_a_whole_one():
    bad = 'raise CorpusError(f"{uri}: line {n}: expected UTF-8, found byte 0x{b:02x} that is not")'
    good = 'raise CorpusError(f"{uri}: expected UTF-8, found byte 0x{b:02x} ({e.reason})")'
    assert [cut_off(t) for _, t in exception_messages(bad)] == [True]
    assert [cut_off(t) for _, t in exception_messages(good)] == [False]
    assert cut_off("-o: expected a") and cut_off("cannot read it:") and not cut_off("found none")


def test_no_error_message_is_cut_off():
    messages = [(path, line, text) for path in sorted(PACKAGE.rglob("*.py"))
                for line, text in exception_messages(path.read_text())]
    assert len(messages) > 300  # the scan saw the package's messages, not a handful
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: ...{text[-60:]!r}"
             for path, line, text in messages if cut_off(text)]
    assert not found, "\n".join(found)
