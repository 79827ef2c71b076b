"""Read-ahead: background threads that read and decode a stream's next row groups.

pyarrow and numpy release the GIL for this work, so on two or more cores it overlaps the
packing and collation on the calling thread. The threads are shared by all streams of the
process; each stream's reads run one after another, in its order (a stream's Parquet file
is not read by two threads at once). With one thread the reads were the bound of
pre-tokenized replay on two cores (bench/RESULTS.md, issue 6 profile). The pools are rebuilt
after a fork, whose child would inherit the pool objects but not their threads.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import os
import threading
import weakref
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
    the same rows: bench/RESULTS.md, issue 4). At least one.

    ``takes_next_block_early``: the stream feeds a token mix, whose bulk reader takes the
    next block as soon as the cursor enters a block (:meth:`LaneTokenStream.documents_ahead`),
    one block earlier than other readers: one more (without it the trainer waited for those
    reads: 0.8x the wall-clock tokens/s).
    """
    return max(1, math.ceil(READ_AHEAD_BLOCKS * share)) + (1 if takes_next_block_early else 0)


_pool_lock = threading.Lock()
_pools: tuple[int, dict[int, ThreadPoolExecutor]] = (os.getpid(), {})
_preparer: tuple[int, Optional["_Preparer"]] = (os.getpid(), None)


def read_ahead_pool(threads: int) -> ThreadPoolExecutor:
    global _pools
    with _pool_lock:
        if _pools[0] != os.getpid():
            _pools = (os.getpid(), {})
        pool = _pools[1].get(threads)
        if pool is None:
            pool = _pools[1][threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zephon-read-ahead")
        return pool


def prepare_later(prepare: Callable[[Any], None], item: Any, order: tuple) -> None:
    """Run ``prepare(item)`` on the process's one prepare thread, lowest ``order`` first (a
    block's ``(epoch, block index)``: the one its lane needs soonest), unless ``item`` is gone
    by then (held weakly: a block dropped by a restore is not worked on).

    Not on the read-ahead threads: a prepare there (a chat row group's render, ~0.1-0.5 s) ran
    before the next read queued on that thread, so a block wanted now (another lane's first)
    waited for the render of one wanted epochs later: the first batch took 2.5x longer. Not
    first-come first-served either: each lane queues its next two blocks at once, and the
    thread spent half its time on blocks wanted an epoch later while the stream encoded the
    ones it needed itself. A failed prepare is dropped: whoever uses the item does the work
    again and gets the error.
    """
    global _preparer
    with _pool_lock:
        if _preparer[0] != os.getpid() or _preparer[1] is None:
            _preparer = (os.getpid(), _Preparer())
        preparer = _preparer[1]
    preparer.submit(order, prepare, weakref.ref(item))


class _Preparer:
    """One daemon thread working through a heap of prepares (see :func:`prepare_later`)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._serial = itertools.count()  # ties: first asked, first done
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="zephon-prepare", daemon=True).start()

    def submit(self, order: tuple, prepare: Callable[[Any], None], ref: "weakref.ref") -> None:
        with self._ready:
            heapq.heappush(self._heap, (order, next(self._serial), prepare, ref))
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._heap:
                    self._ready.wait()
                _, _, prepare, ref = heapq.heappop(self._heap)
            item = ref()
            if item is None:
                continue
            try:
                prepare(item)
            except Exception:  # noqa: BLE001 - raised again, with its context, where the item is used
                log.debug("preparing a %s early failed; the error is raised where it is used", type(item).__name__,
                          exc_info=True)
            del item


class ReadAheadQueue:
    """One stream's reads queued ahead, in stream order, run one at a time on the shared pool.

    ``read(key, *args)`` does the read; its result (or its error) is handed to whoever asks
    for the key with :meth:`take`. While any read is pending only the read-ahead thread
    touches the stream's open file.

    ``prepare(key, result)``, if given, is called on the same thread right after a read's
    result is handed over: it may queue work on the result that does not touch the file (a
    chat block's render) elsewhere (:func:`prepare_later`).
    """

    def __init__(self, read: Callable[..., Any], threads: int,
                 prepare: Optional[Callable[[Hashable, Any], None]] = None) -> None:
        self._read = read
        self._prepare = prepare
        self._threads = threads
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
            read_ahead_pool(self._threads).submit(self._drain)

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
