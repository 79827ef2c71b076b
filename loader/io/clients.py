"""One client per process and configuration, for every remote backend.

Clients of object stores hold connection pools: one per configuration is shared by every
thread of a process (google-cloud-storage and boto3 clients are thread-safe), and a forked
child must never reuse its parent's sockets, nor a lock another thread held at the fork. So
each child starts with none and makes its own on first use.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


class PerProcessClients(Generic[K, C]):
    """``get(key)``: the process's client for ``key``, made by ``make(key)`` on first use."""

    def __init__(self, make: Callable[[K], C]) -> None:
        self._make = make
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._clients: dict[K, C] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def get(self, key: K) -> C:
        with self._lock:
            if self._pid != os.getpid():  # forked without the at-fork hook (belt and braces)
                self._forget()
            if key not in self._clients:
                self._clients[key] = self._make(key)
            return self._clients[key]

    def __len__(self) -> int:
        return len(self._clients)
