"""What a loader owns for its lane streams: their background threads and their I/O counters.

A :class:`StreamOwner` holds

* the read-ahead thread pools (one per thread count: :class:`~loader.io.read_ahead.ReadAheadQueue`),
* the prepare thread (:meth:`StreamOwner.prepare_later`: work on blocks read ahead, such as an
  online chat row group's render),
* named one-thread helpers (online chat tokenizes parts of its renders on one),
* the I/O counters of :mod:`loader.metrics` (``io``): row groups and bytes read, lane-file
  cache hits and misses of its streams only.

``ZephonLoader`` makes one and passes it to every lane it builds; :meth:`StreamOwner.close`
(called by ``ZephonLoader.close()``, by leaving its ``with`` block, on Ctrl-C inside it, on
garbage collection and at exit) joins every thread it started. A closed owner may be used
again: its threads start anew on first use (a loader iterated after ``close()``). Streams built
without a loader (``zephon audit``, a worker process, tests) use :data:`PROCESS_OWNER`,
whose threads live as long as the process; a worker process serves one loader, whose pool
adds the counters each message ships to its owner's (:mod:`loader.workers.messages`).

After a fork the child inherits the owner objects but not their threads: each owner notices
the new process id and starts its threads again (the inherited pools are dropped, not shut
down: their threads do not exist in the child).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from loader.metrics import IO, IoCounters

log = logging.getLogger(__name__)

__all__ = ["StreamOwner", "PROCESS_OWNER"]

_serial = itertools.count()


class StreamOwner:
    """The background threads and I/O counters of one loader's streams (module docstring)."""

    def __init__(self, name: str = "zephon", io: Optional[IoCounters] = None) -> None:
        self.name = f"{name}-{next(_serial)}"  # in every thread's name: a leak names its owner
        self.io = IoCounters() if io is None else io
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._helpers: dict[str, ThreadPoolExecutor] = {}
        self._preparer: Optional[_Preparer] = None

    def _this_process(self) -> None:
        """Under the lock: forget the pools and threads of the parent after a fork."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._pools, self._helpers, self._preparer = {}, {}, None

    def read_ahead_pool(self, threads: int) -> ThreadPoolExecutor:
        """The pool of ``threads`` read-ahead threads (shared by the owner's streams of that setting)."""
        with self._lock:
            self._this_process()
            pool = self._pools.get(threads)
            if pool is None:
                pool = self._pools[threads] = ThreadPoolExecutor(
                    max_workers=threads, thread_name_prefix=f"{self.name}-read-ahead")
            return pool

    def helper(self, name: str) -> ThreadPoolExecutor:
        """The owner's one-thread executor called ``name`` (work that must run in order)."""
        with self._lock:
            self._this_process()
            executor = self._helpers.get(name)
            if executor is None:
                executor = self._helpers[name] = ThreadPoolExecutor(max_workers=1,
                                                                    thread_name_prefix=f"{self.name}-{name}")
            return executor

    def prepare_later(self, prepare: Callable[[Any], None], item: Any, order: tuple) -> None:
        """Run ``prepare(item)`` on the owner's one prepare thread, lowest ``order`` first (a
        block's ``(epoch, block index)``: the one its lane needs soonest), unless ``item`` is gone
        by then (held weakly: a block dropped by a restore is not worked on).

        Not on the read-ahead threads: a prepare there (a chat row group's render, ~0.1-0.5 s) ran
        before the next read queued on that thread, so a block wanted now (another lane's first)
        waited for the render of one wanted epochs later: the first batch took 2.5x longer. Not
        first-come first-served either: each lane queues its next two blocks at once, and the
        thread spent half its time on blocks wanted an epoch later while the stream encoded the
        ones it needed itself. A failed prepare is dropped (logged at debug level): whoever uses
        the item does the work again and gets the error.
        """
        with self._lock:
            self._this_process()
            if self._preparer is None:
                self._preparer = _Preparer(f"{self.name}-prepare")
            preparer = self._preparer
        preparer.submit(order, prepare, weakref.ref(item))

    def threads(self) -> list[threading.Thread]:
        """The live threads this owner started (by name; for tests and diagnostics)."""
        prefix = f"{self.name}-"
        return [t for t in threading.enumerate() if t.name.startswith(prefix)]

    def close(self) -> None:
        """Join every thread of the owner: queued work not started is dropped, work running ends first."""
        # In the order work flows: a read-ahead thread may queue a prepare, a prepare uses a helper.
        # So the read-ahead pools end first (no prepare is queued after), then the prepare thread.
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's threads are not ours to join
                self._this_process()
                return
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            preparer, helpers = self._preparer, list(self._helpers.values())
            self._helpers, self._preparer = {}, None
        if preparer is not None:
            preparer.stop()
        for helper in helpers:
            helper.shutdown(wait=True, cancel_futures=True)


class _Preparer:
    """One daemon thread working through a heap of prepares (see :meth:`StreamOwner.prepare_later`)."""

    def __init__(self, name: str) -> None:
        self._heap: list = []
        self._serial = itertools.count()  # ties: first asked, first done
        self._ready = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, order: tuple, prepare: Callable[[Any], None], ref: "weakref.ref") -> None:
        with self._ready:
            heapq.heappush(self._heap, (order, next(self._serial), prepare, ref))
            self._ready.notify()

    def stop(self) -> None:
        """Drop the prepares not started and join the thread (after the one running, if any)."""
        with self._ready:
            self._stopping = True
            self._heap.clear()
            self._ready.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._heap and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
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


# The owner of streams built outside a loader (module docstring): never closed, as the process's
# shared pools were.
PROCESS_OWNER = StreamOwner("zephon-process", io=IO)
