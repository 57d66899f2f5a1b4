"""ConfigError: a flag or config field whose value cannot be used (its own module so that the
config's parts, config/eval_sets.py among them, raise it without importing the whole config),
and argparse's usage messages in its form."""


class ConfigError(ValueError):
    """A flag or config field has a value that cannot be used; the message names it."""


def usage_error(message: str) -> str:
    """argparse's message in raygpt's form: the flag first, then what was expected and found."""
    import re
    m = re.match(r"argument (\S+): (.*)$", message)
    if not m:
        return message
    flag, what = m.groups()
    kinds = {"int": "an integer", "float": "a number"}
    if (c := re.match(r"invalid choice: (.*) \(choose from (.*)\)$", what)):
        return f"{flag}: expected one of {c.group(2)}, found {c.group(1)}"
    if (c := re.match(r"invalid (\w+) value: (.*)$", what)):
        return f"{flag}: expected {kinds.get(c.group(1), c.group(1))}, found {c.group(2)}"
    if what.startswith("expected one argument"):
        return f"{flag}: expected a value after the flag, found none"
    return f"{flag}: {what}"
