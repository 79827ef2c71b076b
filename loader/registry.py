"""A registry of named plug-ins: what a module registers on import and the core looks up by name.

The bottom of the tree (it imports nothing of the project), shared by the registries of
checkpoint records (:mod:`loader.checkpoint.records`) and of what lane kinds add
(:mod:`loader.kinds.base`).
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``name -> item``, each name registered once. ``what`` names an item in messages
    (``checkpoint record``); ``hint`` says how to register a missing one."""

    def __init__(self, what: str, hint: str) -> None:
        self.what, self.hint = what, hint
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._items[name] = item
        return item

    def lookup(self, name: str, error: type[Exception] = ValueError) -> T:
        """The item ``name``; a missing one raises ``error`` listing the registered names."""
        try:
            return self._items[name]
        except KeyError:
            raise error(f"no {self.what} {name!r} is registered (registered: {', '.join(self._items) or 'none'}); "
                        f"{self.hint}") from None

    def get(self, name: str):
        return self._items.get(name)

    def unregister(self, name: str) -> T:
        return self._items.pop(name)

    def values(self) -> tuple[T, ...]:
        return tuple(self._items.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
