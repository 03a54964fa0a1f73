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


def load_refusal(exc: BaseException, limit: int = 160) -> str:
    """Why `torch.load(weights_only=True)` did not load a file, in a few words, without torch's advice to turn the
    check off (advice a user must not follow for a file they did not write)."""
    import re

    text = str(exc)
    if "Weights only load failed" in text or "WeightsUnpickler" in text:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text) or re.search(r"WeightsUnpickler error: ([^\n.]+)",
                                                                                  text)
        what = f" ({found.group(1)})" if found else ""
        return f"it holds Python objects beyond tensors and plain data{what}, which vlaforge never unpickles"
    return first_line(exc, limit)
