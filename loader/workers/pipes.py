"""Waiting for a pipe to become readable, with one ``select.poll`` object per pipe.

``multiprocessing.connection.Connection.poll`` builds, registers and closes a new selector
on every call. The trainer polls a worker's message pipe once per message and a worker polls
its command pipe once per message it writes, so that cost ~20-40 us of CPU per micro-batch on
each side (pre-tokenized replay, 2 workers: bench/HISTORY.md, "issue 16, the worker
transport"); a poll object made once answers the same question with one system call.
"""

from __future__ import annotations

import math
import select
from multiprocessing.connection import Connection


class PipeWaiter:
    """``ready(timeout_s)``: whether ``connection`` has data, or its other end closed, within
    ``timeout_s`` seconds (0: do not block; ``None``: block until then)."""

    __slots__ = ("_poll",)

    def __init__(self, connection: Connection) -> None:
        self._poll = select.poll()
        # End-of-file and errors count as readable: the following recv() raises EOFError/OSError.
        self._poll.register(connection.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)

    def ready(self, timeout_s: float | None) -> bool:
        timeout_ms = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
        return bool(self._poll.poll(timeout_ms))
