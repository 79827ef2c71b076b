"""A local cache of remote lane files, safe with many worker processes at once.

Layout under ``StorageOptions.cache_dir``::

    zephon-cache-v1/
        objects/ab/<sha256>-<bytes>.parquet   complete, verified copies, named by content
        tmp/<key>.<pid>.<random>.part         downloads in progress (same filesystem)
        locks/<sha256[:3]>.lock               fill locks: 4096 stripes, never deleted
        evict.lock                            held while measuring, evicting and inserting

Guarantees:

* A reader only opens files in ``objects/``, and a file appears there only by
  ``os.replace`` (atomic within one filesystem) of a complete download whose size and
  SHA-256 matched the manifest. A half-written file is never visible.
* Every open re-checks the copy (size; SHA-256 when ``verify_checksums``) through the very
  file descriptor it returns, so the bytes checked are the bytes read. A corrupt copy is
  deleted and fetched again. Cost: one sequential read at ~1 GB/s per opened file.
* Processes missing the same entry: the first takes the entry's ``flock`` and downloads;
  the others block on it and then find the verified copy (one download, not N).
* Completed entries stay within ``cache_max_bytes``: before each insert the least recently
  used entries (mtime, touched on every hit; atime is unreliable under ``relatime``) are
  evicted. Downloads in flight (at most one per process) are not counted. Evicting a file
  that a reader still has open is safe on POSIX: the reader keeps its bytes.
* Entries are named by the manifest's SHA-256, so datasets that share files share entries
  and a re-sharded dataset can never be served a stale copy.

``cache_dir`` must be on a local filesystem: ``flock`` over NFS is not dependable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import time
from typing import BinaryIO, Callable, Iterator, Optional

from loader.errors import StorageError
from loader.io.storage_options import CHECKSUM_ATTEMPTS, SHA256_HEX, sha256_of_file
from loader.metrics import active_counters

log = logging.getLogger(__name__)

LAYOUT = "zephon-cache-v1"
_STALE_TMP_S = 15 * 60  # a download's tmp file untouched this long belongs to a dead process


@contextlib.contextmanager
def _flock(path: str) -> Iterator[None]:
    """An exclusive lock between processes (and between threads: one open() each)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class _HashingWriter:
    """Counts and hashes what a fetch writes, so a download is verified without a re-read."""

    def __init__(self, out: BinaryIO) -> None:
        self._out, self._sha, self.count = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self._sha.update(data)
        self.count += len(data)
        return self._out.write(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class LaneFileCache:
    """Whole, verified copies of remote lane files (see the module docstring)."""

    def __init__(self, cache_dir: str, max_bytes: int, verify_checksums: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError(f"cache_max_bytes must be positive (got {max_bytes=})")
        self.root = os.path.join(os.path.abspath(cache_dir), LAYOUT)
        self.max_bytes = max_bytes
        self.verify_checksums = verify_checksums
        try:
            for sub in ("objects", "tmp", "locks"):
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create the lane-file cache in {cache_dir} ({exc}); set "
                "StorageOptions.cache_dir to a writable local directory, or None to disable it"
            ) from exc

    # -- naming ------------------------------------------------------------------------
    @staticmethod
    def key(entry) -> str:
        if not SHA256_HEX.fullmatch(entry.sha256 or ""):
            raise StorageError(
                f"manifest entry {entry.path} has sha256 {entry.sha256!r}, not 64 lowercase hex "
                "digits: the manifest is corrupt; re-run the Beam job"
            )
        return f"{entry.sha256}-{entry.bytes}"

    def entry_path(self, entry) -> str:
        key = self.key(entry)
        return os.path.join(self.root, "objects", key[:2], f"{key}.parquet")

    def fits(self, entry) -> bool:
        return entry.bytes <= self.max_bytes

    # -- reading -----------------------------------------------------------------------
    def open(self, url: str, entry, fetch: Callable[[BinaryIO], None]) -> BinaryIO:
        """A verified local copy of ``url``; ``fetch(out)`` writes the object's bytes on a miss."""
        path = self.entry_path(entry)
        handle, _ = self._open_verified(path, entry)
        if handle is not None:
            active_counters().add(cache_hits=1)  # the opening stream's loader (loader.metrics)
            return handle
        key = self.key(entry)
        with _flock(os.path.join(self.root, "locks", f"{key[:3]}.lock")):
            # Another process may have filled (or repaired) it while we waited.
            handle, problem = self._open_verified(path, entry)
            if handle is not None:
                active_counters().add(cache_hits=1)  # filled by another process meanwhile
                return handle
            if problem is not None:
                log.warning("cache copy %s of %s is corrupt (%s): deleting it and fetching again",
                            path, url, problem)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            active_counters().add(cache_misses=1)
            return self._fill(url, entry, key, path, fetch)

    def _check(self, handle: BinaryIO, entry) -> Optional[str]:
        size = os.fstat(handle.fileno()).st_size
        if size != entry.bytes:
            return f"{size} bytes, manifest says {entry.bytes}"
        if self.verify_checksums:
            digest = sha256_of_file(handle)
            if digest != entry.sha256:
                return f"sha256 {digest[:16]}..., manifest says {entry.sha256[:16]}..."
        handle.seek(0)
        return None

    def _open_verified(self, path: str, entry) -> tuple[Optional[BinaryIO], Optional[str]]:
        """(open handle, None) if the copy is good, (None, problem) if bad, (None, None) if absent."""
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            return None, None
        problem = self._check(handle, entry)
        if problem is not None:
            handle.close()
            return None, problem
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU: a hit makes the entry the most recently used
        return handle, None

    # -- filling -----------------------------------------------------------------------
    def _fill(self, url: str, entry, key: str, path: str, fetch: Callable[[BinaryIO], None]) -> BinaryIO:
        problem = ""
        for attempt in range(1, CHECKSUM_ATTEMPTS + 1):
            tmp = os.path.join(self.root, "tmp", f"{key}.{os.getpid()}.{secrets.token_hex(4)}.part")
            try:
                with open(tmp, "wb") as out:
                    writer = _HashingWriter(out)
                    fetch(writer)  # type: ignore[arg-type]  # only .write() is used
                if writer.count != entry.bytes:
                    problem = f"downloaded {writer.count} bytes, manifest says {entry.bytes}"
                elif self.verify_checksums and writer.hexdigest() != entry.sha256:
                    problem = f"sha256 {writer.hexdigest()[:16]}..., manifest says {entry.sha256[:16]}..."
                else:
                    # No fsync: a copy damaged by a crash fails the check on its next open.
                    handle = open(tmp, "rb")  # opened before the rename: it follows the inode
                    try:
                        self._insert(tmp, path, entry.bytes)
                    except BaseException:
                        handle.close()
                        raise
                    log.info("cached %s as %s (%d bytes)", url, path, entry.bytes)
                    return handle
                log.warning("%s: %s (download %d/%d)", url, problem, attempt, CHECKSUM_ATTEMPTS)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        raise StorageError(
            f"{url}: content does not match the manifest ({problem}) after {CHECKSUM_ATTEMPTS} "
            "downloads: the object was overwritten or is corrupt; re-run the Beam job or restore it"
        )

    def _insert(self, tmp: str, path: str, size: int) -> None:
        # Eviction and insertion under one lock, so concurrent inserts cannot both "fit".
        with _flock(os.path.join(self.root, "evict.lock")):
            self._evict_locked(self.max_bytes - size)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)

    # -- size bound --------------------------------------------------------------------
    def _entries(self) -> list[tuple[float, int, str]]:
        found = []
        objects = os.path.join(self.root, "objects")
        for sub in os.listdir(objects):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for name in os.listdir(os.path.join(objects, sub)):
                    full = os.path.join(objects, sub, name)
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(full)
                        found.append((st.st_mtime, st.st_size, full))
        return found

    def usage_bytes(self) -> int:
        """Bytes held by completed entries."""
        return sum(size for _, size, _ in self._entries())

    def evict(self, limit_bytes: Optional[int] = None) -> int:
        """Evict least recently used entries until at most ``limit_bytes`` remain; bytes freed."""
        with _flock(os.path.join(self.root, "evict.lock")):
            return self._evict_locked(self.max_bytes if limit_bytes is None else limit_bytes)

    def _evict_locked(self, limit_bytes: int) -> int:
        entries = sorted(self._entries())
        total, freed = sum(size for _, size, _ in entries), 0
        for _, size, full in entries:
            if total <= limit_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(full)
                log.info("evicted %s (%d bytes) from the lane-file cache", full, size)
            total -= size
            freed += size
        self._remove_stale_tmp()
        return freed

    def _remove_stale_tmp(self) -> None:
        tmp_dir, now = os.path.join(self.root, "tmp"), time.time()
        for name in os.listdir(tmp_dir):
            full = os.path.join(tmp_dir, name)
            with contextlib.suppress(FileNotFoundError):
                if now - os.stat(full).st_mtime > _STALE_TMP_S:
                    os.remove(full)
                    log.info("removed %s, left by an interrupted download", full)
