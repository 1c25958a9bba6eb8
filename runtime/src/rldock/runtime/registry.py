"""A name -> implementation registry, so variants plug in by config and callers never branch on
a name. An unknown name is a user error that lists the valid ones and the config field to fix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, *, field: str):
        self.kind = kind  # e.g. "reward"
        self.field = field  # the config field that names an entry, e.g. "reward.name"
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"{self.field} {name!r} is not a registered {self.kind}; valid: {sorted(self._entries)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def values(self) -> list[T]:
        return [self._entries[name] for name in self]
