"""User-facing errors: one line saying what is wrong and what to do; the CLI exits with code 2."""


class VlaforgeError(Exception):
    """A problem the user can act on (bad config, missing file, impossible layout)."""


class ConfigError(VlaforgeError):
    """A config key or value is wrong; the message names the field path and the allowed values."""


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name when it has none:
    what a one-line error quotes of a library's multi-line one."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
