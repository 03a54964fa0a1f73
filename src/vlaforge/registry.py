"""Name -> object registries with a "did you mean" on typos."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

from vlaforge.errors import VlaforgeError

T = TypeVar("T")


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_names(text: str | list[str], allowed: list[str] | tuple[str, ...], what: str) -> list[str]:
    """'a,b' or a list -> its names, each one of `allowed`.

    Raises:
        VlaforgeError: "unknown WHAT 'x'; choose from ..." for the first name not allowed, or for none at all.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise VlaforgeError(f"unknown {what} {bad[0] if bad else '(none)'!r}; choose from {', '.join(allowed)}")
    return names


class Registry(Generic[T]):
    """A named collection looked up by key; unknown keys fail with the choices and a suggestion."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return add

    def add(self, name: str, obj: T) -> None:
        self.register(name)(obj)

    def get(self, name: str) -> T:
        if name not in self._items:
            raise VlaforgeError(self.unknown_message(name))
        return self._items[name]

    def unknown_message(self, name: str) -> str:
        return (f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; "
                f"choose one of: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
