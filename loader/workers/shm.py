"""Shared-memory slots: how a worker hands packed sequences to the trainer without pickling them.

Each worker owns one segment of ``num_slots`` fixed-size slots. A worker writes one
message (up to ``items_per_message`` sequences: every per-token array of every item) into
a free slot and sends the trainer only a small descriptor; the trainer reads the arrays as
views of the slot, copies them once into the micro-batch, and gives the slot back::

    worker:  find a free slot flag, set it ── write arrays ── send ("items", slot, descriptor)
    trainer: recv descriptor ── views of the slot ── collate (the one copy) ── clear the flag

The segment starts with one flag byte per slot (0: free; ``SENT``: the worker wrote it and
the trainer has not given it back yet), then one byte the trainer sets for the worker
(:attr:`Segment.rows_wanted`: ship bulk rows rather than collated micro-batches,
:mod:`loader.workers.batches`). Giving a slot back is a store into shared memory, not a
message: the trainer's hot path makes no system call for it, and wakes nobody. The
flag is cleared after the copy; a worker that finds no free slot waits on its command pipe
for a millisecond and looks again (it only waits when it is ``prefetch`` messages ahead).

Segments never outlive the run, whoever dies. The trainer creates the file under
``/dev/shm`` (name ``zephon-<trainer pid>-<token>-w<k>``), the worker maps it and the
trainer unlinks the name as soon as the worker has said it is mapped: from then on the
memory lives exactly as long as some process maps it, so a ``kill -9`` of the worker, of the
trainer or of both frees it. The only window is between creating the file and the worker's
"ready"; a trainer killed inside it leaves a file whose pid no longer exists, which
:func:`remove_stale_segments` deletes when the next loader starts.

Every page of a segment is allocated when it is created (:func:`reserve`), not at its first
write: a full ``/dev/shm`` is then a :class:`~loader.errors.SharedMemoryError` in the trainer
before the segment's worker starts, never a SIGBUS in a worker whose tmpfs someone else filled.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from loader.errors import SharedMemoryError
from loader.stages.features import FEATURES, slot_bytes_per_token

SHM_DIR = "/dev/shm"
SENT = 1  # a slot's flag while it holds a message (0: free), see the module docstring
PREFIX = "zephon-"


def _shm_dir() -> str:
    return SHM_DIR if os.path.isdir(SHM_DIR) else os.environ.get("TMPDIR", "/tmp")


def check_free_space(directory: str, size: int, worker_id: int) -> None:
    """Refuse a segment the shared-memory file system cannot hold now: a segment of a full
    tmpfs maps without complaint and kills the worker with SIGBUS when it is first written.
    (:func:`reserve` then allocates the pages, so that space taken later cannot do it either.)"""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if free < size:
        raise SharedMemoryError(
            f"shared memory {directory} has {free / 2**20:.1f} MiB free, loader worker {worker_id}'s segment needs "
            f"{size / 2**20:.1f} MiB: enlarge it (docker run --shm-size=2g, a bigger tmpfs), or lower num_workers "
            "or prefetch")


def reserve(fd: int, size: int, directory: str, worker_id: int) -> None:
    """Allocate every page of a segment now (``posix_fallocate``): a page of a tmpfs is otherwise
    allocated at its first write, and a tmpfs filled by anyone in between kills the writer with
    SIGBUS. Reserved, a full ``/dev/shm`` is this error, raised in the trainer before the
    segment's worker starts. A file system without ``fallocate`` (``EOPNOTSUPP``/``EINVAL``) keeps
    the free-space check."""
    allocate = getattr(os, "posix_fallocate", None)  # not on macOS
    if allocate is None:
        return
    try:
        allocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        raise SharedMemoryError(
            f"shared memory {directory}: loader worker {worker_id}'s segment of {size / 2**20:.1f} MiB could not be "
            f"reserved ({os.strerror(exc.errno) if exc.errno else exc}): {directory} is full or too small; enlarge it "
            "(docker run --shm-size=2g, a bigger tmpfs), free what else fills it, or lower num_workers or prefetch"
        ) from exc


def slot_bytes(seq_len: int, items_per_message: int, features: Optional[Sequence[str]] = None) -> int:
    """Room for a message's arrays in the worst case (a segment at every token); ``features``:
    the per-token features the loader's sequences may carry (default: all registered)."""
    # input_ids, labels int32; the per-token features; segment starts int32
    per_row = seq_len * (4 + 4 + slot_bytes_per_token(features) + 4)
    return _align(items_per_message * per_row + 64 * (3 + len(FEATURES)))  # each array 64-byte aligned


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass
class Segment:
    """One worker's slots, mapped into this process: ``num_slots`` flag bytes, then the slots."""

    path: str
    num_slots: int
    slot_size: int
    _map: Optional[mmap.mmap] = None

    @staticmethod
    def size_of(num_slots: int, slot_size: int) -> int:
        return _align(num_slots + 1) + num_slots * slot_size

    @property
    def flags(self) -> np.ndarray:
        """One uint8 per slot, shared with the other process: 1 while the slot holds a message."""
        return np.frombuffer(self._map, dtype=np.uint8, count=self.num_slots)

    @property
    def rows_wanted(self) -> bool:
        """Set by the trainer while it asks for micro-batches back to back (loader-bound): the
        worker then ships bulk rows for it to collate (:data:`loader.workers.batches.ROWS_POLICIES`)."""
        return bool(self._map[self.num_slots])

    @rows_wanted.setter
    def rows_wanted(self, wanted: bool) -> None:
        if self._map is not None:
            self._map[self.num_slots] = 1 if wanted else 0

    @property
    def mapped(self) -> bool:
        """Whether this process still maps the segment (:meth:`close` not called)."""
        return self._map is not None

    def free_slot(self) -> Optional[int]:
        """A slot the trainer has given back, or None."""
        free = np.flatnonzero(self.flags == 0)
        return int(free[0]) if len(free) else None

    @classmethod
    def create(cls, num_slots: int, slot_size: int, worker_id: int) -> "Segment":
        directory = _shm_dir()
        size = cls.size_of(num_slots, slot_size)
        check_free_space(directory, size, worker_id)
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}-w{worker_id}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            reserve(fd, size, directory, worker_id)
            segment = cls(path, num_slots, slot_size, mmap.mmap(fd, size))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return segment

    @classmethod
    def attach(cls, path: str, num_slots: int, slot_size: int, fd: Optional[int] = None) -> "Segment":
        """Map a segment by name, or by an inherited descriptor ``fd`` (its name may be gone: the
        pool unlinks it once the worker holds it); the descriptor is closed once mapped."""
        if fd is None:
            fd = os.open(path, os.O_RDWR)
        try:
            return cls(path, num_slots, slot_size, mmap.mmap(fd, cls.size_of(num_slots, slot_size)))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name; the memory stays while mapped (idempotent)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views still exported: the mapping goes when they do
                pass
            self._map = None

    def view(self, slot: int) -> memoryview:
        start = _align(self.num_slots + 1) + slot * self.slot_size
        return memoryview(self._map)[start : start + self.slot_size]


# -- messages ------------------------------------------------------------------------------
# A message's arrays lie in its slot one after another, each 64-byte aligned; the descriptor
# names each array's dtype, shape and offset, so the trainer never guesses a layout.

class SlotWriter:
    """Lays a message's arrays out in ``slot``: :meth:`allocate` returns the view an array is
    built in (``np.concatenate(..., out=view)``), so a worker writes each value into the slot once,
    not into a temporary and then into the slot. ``layout`` is the descriptor's
    ``{name: (dtype, shape, offset)}``."""

    def __init__(self, slot: memoryview) -> None:
        self.slot = slot
        self.offset = 0
        self.layout: dict[str, tuple[str, tuple, int]] = {}

    def allocate(self, name: str, dtype, shape: tuple) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        end = self.offset + count * dtype.itemsize
        if end > len(self.slot):
            raise ValueError(f"message does not fit its shared-memory slot ({end} > {len(self.slot)} bytes)")
        view = np.frombuffer(self.slot, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self.layout[name] = (dtype.str, tuple(shape), self.offset)
        self.offset = _align(end)
        return view

    def write(self, name: str, array: np.ndarray) -> None:
        self.allocate(name, array.dtype, array.shape)[...] = array


def read_arrays(slot: memoryview, layout: dict[str, tuple[str, tuple, int]]) -> dict[str, np.ndarray]:
    """Views (no copy) of the arrays a :class:`SlotWriter` put into ``slot``."""
    out = {}
    for name, (dtype, shape, offset) in layout.items():
        count = math.prod(shape)  # not np.prod: a ufunc reduce costs ~10x more per array
        out[name] = np.frombuffer(slot, dtype=dtype, count=count, offset=offset).reshape(shape)
    return out


def remove_stale_segments() -> int:
    """Delete segments left by trainers that no longer exist; returns how many."""
    removed = 0
    directory = _shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_exists(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
