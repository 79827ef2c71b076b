"""Read-ahead: background threads that read and decode a stream's next row groups.

pyarrow and numpy release the GIL for this work, so on two or more cores it overlaps the
packing and collation on the calling thread. The threads are shared by the streams of one
loader (its :class:`~loader.io.owner.StreamOwner`, which joins them on ``close()``); each
stream's reads run one after another, in its order (a stream's Parquet file is not read by two
threads at once). With one thread the reads were the bound of pre-tokenized replay on two
cores (bench/HISTORY.md, "Where pre-tokenized replay spends its time").
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from fractions import Fraction
from typing import Any, Callable, Hashable, Optional

log = logging.getLogger(__name__)

READ_AHEAD_BLOCKS = 2  # for a lane's only source: one is not enough when every lane changes block at once


def read_ahead_depth(share: Fraction, *, takes_next_block_early: bool = False) -> int:
    """Blocks read ahead by the stream of a source that gets ``share`` of its lane's output.

    A source consumed at half the rate needs half the blocks to cover the same time, so a
    lane holds about ``READ_AHEAD_BLOCKS`` blocks ahead however many sources it mixes (with
    two blocks per source, the trainer's thread of a two-source mix did 8-13% more CPU for
    the same rows: bench/HISTORY.md, "Mixing overhead"). At least one.

    ``takes_next_block_early``: the stream feeds a token mix, whose bulk reader takes the
    next block as soon as the cursor enters a block (:meth:`LaneTokenStream.documents_ahead`),
    one block earlier than other readers: one more (without it the trainer waited for those
    reads: 0.8x the wall-clock tokens/s).
    """
    return max(1, math.ceil(READ_AHEAD_BLOCKS * share)) + (1 if takes_next_block_early else 0)


class ReadAheadQueue:
    """One stream's reads queued ahead, in stream order, run one at a time on ``pool()`` (its
    owner's read-ahead pool: :meth:`loader.io.owner.StreamOwner.read_ahead_pool`).

    ``read(key, *args)`` does the read; its result (or its error) is handed to whoever asks
    for the key with :meth:`take`. While any read is pending only the read-ahead thread
    touches the stream's open file.

    ``prepare(key, result)``, if given, is called on the same thread right after a read's
    result is handed over: it may queue work on the result that does not touch the file (a
    chat block's render) elsewhere (:meth:`loader.io.owner.StreamOwner.prepare_later`).
    """

    def __init__(self, read: Callable[..., Any], pool: Callable[[], ThreadPoolExecutor],
                 prepare: Optional[Callable[[Hashable, Any], None]] = None) -> None:
        self._read = read
        self._prepare = prepare
        self._pool = pool
        # Reads handed out or pending, in stream order: (key, future).
        self._ahead: collections.deque[tuple[Hashable, Future]] = collections.deque()
        # Reads not started yet, with their arguments; guarded by _lock, as is _draining
        # (at most one drain task per stream runs at a time).
        self._unread: collections.deque[tuple[Hashable, Future, tuple]] = collections.deque()
        self._lock = threading.Lock()
        self._draining = False

    def __len__(self) -> int:
        """Reads queued and not taken yet."""
        return len(self._ahead)

    def __iter__(self):
        """The queued ``(key, future)`` pairs, in stream order."""
        return iter(list(self._ahead))

    def __contains__(self, key: Hashable) -> bool:
        return any(pending == key for pending, _ in self._ahead)

    def submit(self, key: Hashable, *args) -> None:
        """Queue the read of ``key`` (``read(key, *args)`` on a read-ahead thread)."""
        future: Future = Future()
        self._ahead.append((key, future))
        with self._lock:
            self._unread.append((key, future, args))
            start = not self._draining
            self._draining = True
        if start:
            self._pool().submit(self._drain)

    def _drain(self) -> None:
        """On a read-ahead thread: the queued reads, in order, until none is left."""
        while True:
            with self._lock:
                if not self._unread:
                    self._draining = False
                    return
                key, future, args = self._unread.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # dropped by take() before it started
            try:
                result = self._read(key, *args)
            except BaseException as exc:  # handed to whoever waits for the block
                future.set_exception(exc)
                continue
            future.set_result(result)
            if self._prepare is not None:
                try:
                    self._prepare(key, result)
                except Exception:  # noqa: BLE001 - optional work; the reads queued after it must still run
                    log.debug("queuing the early decoding of block %r failed; it is decoded where it is used", key,
                              exc_info=True)

    def wait(self) -> None:
        """Block until every queued read has finished (the results stay queued)."""
        wait([future for _, future in self._ahead])

    def take(self, wanted: Optional[Hashable] = None) -> Any:
        """The result for ``wanted`` if it is the next read queued, else None (all reads dropped).

        Reads that turn out not to be wanted (after a restore moved the cursor) are waited
        for and dropped, errors and all: only reads the stream really uses may fail it.
        """
        if self._ahead and self._ahead[0][0] == wanted:
            return self._ahead.popleft()[1].result()  # a read error surfaces here, as from a direct read
        while self._ahead:
            _, future = self._ahead.popleft()
            if not future.cancel():  # already running or done: wait, and drop its error
                future.exception()
        return None
