"""ConfigError: a flag or config field whose value cannot be used (its own module so that the
config's parts, config/eval_sets.py among them, raise it without importing the whole config)."""


class ConfigError(ValueError):
    """A flag or config field has a value that cannot be used; the message names it."""
