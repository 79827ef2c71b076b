"""A bounded, thread-safe memo for the process-wide caches of the loader.

Every cache that lives as long as the process (transform chains per source, a tokenizer's
byte table, online chat encoders, local files already verified) is a :class:`BoundedCache`:
it holds at most ``max_entries`` values and forgets the least recently used one first, so a
long-lived process that builds many loaders (an evaluation loop, a notebook) does not grow
without bound. Nothing in it is state: a forgotten value is built again, the same.

Imports nothing of the project.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Generic, Hashable, Optional, TypeVar

V = TypeVar("V")

__all__ = ["BoundedCache"]


class BoundedCache(Generic[V]):
    """At most ``max_entries`` values by key, least recently used forgotten first."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"a BoundedCache holds at least one entry (got {max_entries=})")
        self.max_entries = max_entries
        self._values: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values

    def get(self, key: Hashable) -> Optional[V]:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> V:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.max_entries:
                self._values.popitem(last=False)
        return value

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key``, made (outside the lock: ``make`` may be slow) if absent."""
        value = self.get(key)
        return self.put(key, make()) if value is None else value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
