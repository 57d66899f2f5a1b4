"""raygpt.runlog.terminal: what raygpt prints of a string read from a file."""

from raygpt.runlog.terminal import printable, printable_lines


def test_printable_shows_every_control_and_format_character_as_an_escape():
    text = "a\x1b]0;t\x07b\rc\nd\x9b\u202ee\u2066\x00\t"
    assert printable(text) == "a\\x1b]0;t\\x07b\\x0dc\\x0ad\\x9b\\u202ee\\u2066\\x00\\x09"
    assert printable("s3://KEY:SECRET@bucket/run") == "s3://***@bucket/run"
    assert printable(42) == "42" and printable("héllo ✓") == "héllo ✓"


def test_printable_lines_keeps_only_the_newlines_between_lines():
    assert printable_lines("one\x1b[2J\ntwo\r") == "one\\x1b[2J\ntwo\\x0d"
