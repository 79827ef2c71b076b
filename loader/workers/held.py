"""Micro-batches handed to the trainer as views of a worker's slot, and the bound on them.

A micro-batch a worker built whole (:mod:`loader.workers.batches`) is handed out without a
copy: its arrays are NumPy views of its message's shared-memory slot (with ``output="torch"``,
``torch.from_numpy`` of those), all hanging from one *owner* array per micro-batch. The slot
goes back to its worker only once every micro-batch of its message is settled: copied out,
dropped (the warm start's lead made it), or handed out and freed, which a weak reference to
the owner sees when the last array, tensor or tensor view sharing its memory is gone::

    worker:   slot k <- micro-batches m..m+3 collated into it ── ("items", run, k, descriptor)
    trainer:  next() -> views of k (owner m) ... next() -> views of k (owner m+3)
              the trainer frees m..m+3 (or their tensors) ──> flag k cleared: k is the worker's

So a worker never overwrites memory the trainer can still read, whatever the trainer keeps.

**The bound.** The trainer holds at most ``HELD_BATCHES`` micro-batches as views at once (over
all workers); one handed out while it holds that many is copied out of its slot instead (its
share of the slot settled at once): a trainer that keeps every batch (a list of them, a
framework's prefetch queue) pays a copy per batch beyond the bound, and no worker waits for
slots it keeps. Each worker has ``HELD_BATCHES`` slots beyond its prefetch
(:func:`loader.workers.pool.slots_per_worker`), so the slots held never stall a worker either.

**Runs.** A restore starts a new run, whose ``start`` reclaims a worker's slots: the pool sends
with it the slots the trainer still holds views of (:meth:`HeldViews.keep`); the worker reclaims
only the others, and a kept slot goes back when its last view is freed.

Settling runs in whichever thread frees a batch's last array (a framework's pin-memory thread,
the garbage collector), so leases change under one lock.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

HELD_BATCHES = 4  # micro-batches the trainer may hold as views of worker slots at once

_LOCK = threading.RLock()  # re-entrant: freeing an owner inside it runs its callback here


class MessageLease:
    """The trainer's hold on one batch message's slot: ``release(lease)`` once its ``remaining``
    micro-batches are settled; ``views``: those handed out as views and not yet freed;
    ``kept``: a later run's start left the slot to the trainer (its release clears the flag
    whatever the run)."""

    __slots__ = ("worker_id", "slot", "remaining", "views", "kept", "_release")

    def __init__(self, worker_id: int, slot: int, batches: int, release: Callable[["MessageLease"], None]) -> None:
        self.worker_id, self.slot = worker_id, slot
        self.remaining = batches
        self.views = 0
        self.kept = False
        self._release = release

    def settle(self) -> None:
        """One micro-batch of the message is done with."""
        with _LOCK:
            self.remaining -= 1
            if self.remaining == 0:
                self._release(self)


class HeldViews:
    """The micro-batches the trainer holds as views of worker slots (one per pool)."""

    def __init__(self, limit: int = HELD_BATCHES) -> None:
        self.limit = limit
        # id of the owner's weak reference -> (that reference, the lease of its message)
        self._live: dict[int, tuple[weakref.ref, MessageLease]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def full(self) -> bool:
        """Whether the next micro-batch must be copied out (the trainer holds ``limit`` already)."""
        return len(self._live) >= self.limit

    def take(self, owner, lease: MessageLease) -> None:
        """``owner``'s micro-batch is handed out as views: its share of ``lease`` is settled when
        ``owner`` is freed."""
        ref = weakref.ref(owner, self._freed)
        with _LOCK:
            lease.views += 1
            self._live[id(ref)] = (ref, lease)

    def _freed(self, ref: weakref.ref) -> None:
        with _LOCK:
            entry = self._live.pop(id(ref), None)
            if entry is not None:
                lease = entry[1]
                lease.views -= 1
                lease.settle()

    def keep(self) -> dict[int, list[int]]:
        """For a new run's start: the slots the trainer still holds views of, per worker; their
        leases now wait for those views only (the old run's other micro-batches are gone)."""
        kept: dict[int, set[int]] = {}
        with _LOCK:
            for _, lease in self._live.values():
                lease.kept = True
                lease.remaining = lease.views
                kept.setdefault(lease.worker_id, set()).add(lease.slot)
        return {worker_id: sorted(slots) for worker_id, slots in kept.items()}
