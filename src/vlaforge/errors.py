"""User-facing errors: one line saying what is wrong and what to do; the CLI exits with code 2."""


class VlaforgeError(Exception):
    """A problem the user can act on (bad config, missing file, impossible layout)."""


class ConfigError(VlaforgeError):
    """A config key or value is wrong; the message names the field path and the allowed values."""
