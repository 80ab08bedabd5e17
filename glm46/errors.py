"""The one error type of a configuration that cannot run, shared by the library and the application."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the keys and values."""
