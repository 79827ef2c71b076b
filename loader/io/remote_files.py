"""Reading one pinned remote object: ranged reads, whole verified reads, the cache.

Every remote backend (``gs://``, ``s3://``) hands this module a :class:`PinnedObject`: one
version of one object, as a metadata request saw it (its size, and what pins it: a GCS
generation, an S3 version id or ETag), whose ``fetch(start, end, policy)`` returns exactly
those bytes of *that* version or raises (never bytes of a newer one). On top of it:

* :class:`RangedReader`, a seekable file object for pyarrow through a bounded read-ahead
  window, so reading a row group moves about that row group's bytes.
* :func:`open_remote_lane_file`, the loader's way into a lane file: size checked against
  the manifest before any data moves; small objects downloaded whole and SHA-256-checked,
  larger ones read ranged (Parquet page checksums verify them as they decode); with
  ``cache_dir``, whole verified copies from :mod:`loader.io.cache`.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
from typing import BinaryIO, Callable, Optional, Protocol

from loader.io import cache
from loader.io.retries import RetryPolicy
from loader.errors import StorageError
from loader.io.storage_options import CHECKSUM_ATTEMPTS, StorageOptions

log = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 64 * 1024**2  # a huge pyarrow read is split so one retry re-fetches <= this
CACHE_FILL_CHUNK_BYTES = 16 * 1024**2


class PinnedObject(Protocol):
    """One version of one remote object (see the module docstring)."""

    url: str
    size: int

    def fetch(self, start: int, end: int, policy: RetryPolicy) -> bytes:
        """Bytes ``[start, end)`` of the pinned version, retried until complete."""


def copy_to(obj: PinnedObject, out: BinaryIO, policy: RetryPolicy, chunk_bytes: int) -> None:
    """Stream the whole object into ``out`` in ranged chunks (memory: one chunk)."""
    for start in range(0, obj.size, chunk_bytes):
        out.write(obj.fetch(start, min(obj.size, start + chunk_bytes), policy))


class RangedReader(io.RawIOBase):
    """A read-only, seekable view of a remote object through a bounded read-ahead window.

    A read inside the window is served from memory; otherwise one ranged GET fetches
    ``max(n, readahead)`` bytes from the read position (reads larger than the window are
    passed through, split into requests of at most 64 MiB). Memory: one window plus the
    read being served. Thread-safe (pyarrow may read from its I/O threads).
    """

    def __init__(self, obj: PinnedObject, policy: RetryPolicy, readahead_bytes: int) -> None:
        super().__init__()
        self.obj, self._policy, self._readahead = obj, policy, readahead_bytes
        self._pos, self._win_start, self._win = 0, 0, b""
        self._lock = threading.Lock()
        self.requests = 0  # ranged GETs issued (for tests and benchmarks)

    @property
    def name(self) -> str:
        return self.obj.url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.obj.url}")

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.obj.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence!r}")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset} in {self.obj.url}")
        self._pos = base + offset
        return self._pos

    def _get(self, start: int, end: int) -> bytes:
        parts = []
        for lo in range(start, end, _MAX_REQUEST_BYTES):
            parts.append(self.obj.fetch(lo, min(end, lo + _MAX_REQUEST_BYTES), self._policy))
            self.requests += 1
        return b"".join(parts)

    def read(self, size: Optional[int] = -1) -> bytes:
        with self._lock:
            self._check_open()
            start = self._pos
            end = self.obj.size if size is None or size < 0 else min(self.obj.size, start + size)
            if end <= start:
                return b""
            win_end = self._win_start + len(self._win)
            head = b""
            if self._win_start <= start < win_end:  # serve what the window has
                head = self._win[start - self._win_start:min(end, win_end) - self._win_start]
            rest_start = start + len(head)
            if rest_start < end:
                if end - rest_start >= self._readahead:
                    tail = self._get(rest_start, end)  # big read: pass through, keep the window
                else:
                    self._win_start = rest_start
                    self._win = self._get(rest_start, min(self.obj.size, rest_start + self._readahead))
                    tail = self._win[:end - rest_start]
                head = head + tail if head else tail
            self._pos = end
            return head

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        self._win = b""
        super().close()


# -- lane files -------------------------------------------------------------------------
def size_mismatch(url: str, actual: int, entry) -> StorageError:
    return StorageError(
        f"{url} has {actual} bytes but the manifest says {entry.bytes}: the object was truncated "
        "or replaced after the manifest was written; re-run the Beam job or restore the object"
    )


def sha256_mismatch(url: str, actual: str, entry) -> StorageError:
    return StorageError(
        f"{url}: content does not match the manifest (sha256 {actual[:16]}..., manifest "
        f"says {entry.sha256[:16]}...; size matches) after {CHECKSUM_ATTEMPTS} downloads: the "
        "object was overwritten or is corrupt; re-run the Beam job or restore the object"
    )


def open_remote_lane_file(url: str, entry, options: StorageOptions,
                          pin: Callable[[], PinnedObject]) -> BinaryIO:
    """Open a lane file listed in a manifest (``entry``: :class:`loader.io.manifest.FileEntry`).

    ``pin()`` is the backend's metadata request for ``url``; it is called at most once per
    download, so every byte of one open comes from one version of the object.
    """
    policy = RetryPolicy.from_options(options)

    def checked_pin() -> PinnedObject:
        obj = pin()
        if obj.size != entry.bytes:
            raise size_mismatch(url, obj.size, entry)
        return obj

    if options.cache_dir is not None:
        lane_cache = cache.LaneFileCache(options.cache_dir, options.cache_max_bytes, options.verify_checksums)
        if lane_cache.fits(entry):
            def fetch(out: BinaryIO) -> None:
                copy_to(checked_pin(), out, policy, max(options.readahead_bytes, CACHE_FILL_CHUNK_BYTES))

            return lane_cache.open(url, entry, fetch)
        log.warning("%s (%d bytes) is larger than cache_max_bytes=%d: reading it uncached",
                    url, entry.bytes, options.cache_max_bytes)
    obj = checked_pin()
    if obj.size > options.whole_file_max_bytes:
        return RangedReader(obj, policy, options.readahead_bytes)
    for attempt in range(1, CHECKSUM_ATTEMPTS + 1):
        data = obj.fetch(0, obj.size, policy)
        digest = hashlib.sha256(data).hexdigest()
        if not options.verify_checksums or digest == entry.sha256:
            return io.BytesIO(data)
        log.warning("%s: sha256 %s differs from the manifest's %s (download %d/%d)",
                    url, digest[:16], entry.sha256[:16], attempt, CHECKSUM_ATTEMPTS)
    raise sha256_mismatch(url, digest, entry)
