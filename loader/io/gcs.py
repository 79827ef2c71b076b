"""``gs://`` access on google-cloud-storage: what the loader and the manifest reader need.

Guarantees:

* :func:`open_lane_file` checks the object's size against the manifest before any data
  moves. Objects up to ``whole_file_max_bytes`` are downloaded whole and their SHA-256 is
  compared with the manifest; larger ones are served by :class:`RangedReader`, a seekable
  file object issuing ranged GETs through a bounded read-ahead window, so pyarrow reading
  one row group moves about that row group's bytes, never the whole object. Ranged bytes
  are verified by the Parquet page checksums as pyarrow decodes them. With
  ``cache_dir`` set, whole verified copies are served from :mod:`loader.io.cache` instead.
* Every request is retried on transient failures (HTTP 408/429/5xx, connection resets,
  timeouts, truncated bodies) with exponential backoff and full jitter, within the budget
  of :class:`loader.io.storage.StorageOptions` (``retry_*``). Permanent failures raise
  :class:`loader.io.storage.StorageError` naming ``gs://bucket/name`` and what to do.
* Ranged reads pin the object generation seen at open: an object replaced mid-read fails
  (404 on GCS) instead of mixing bytes of two versions.
* One client per process and endpoint, re-created after ``fork`` (a connection pool must
  never be shared between a worker and its parent).

Credentials: Application Default Credentials. When ``STORAGE_EMULATOR_HOST`` is set or
``StorageOptions.endpoint`` is given, anonymous credentials against that endpoint.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, TypeVar

import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs_storage
from google.cloud.storage import exceptions as gcs_exceptions

from loader.errors import StorageError, StorageNotFoundError
from loader.io import cache
from loader.io.storage_options import CHECKSUM_ATTEMPTS, StorageOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEME = "gs://"
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_MAX_REQUEST_BYTES = 64 * 1024**2  # a huge pyarrow read is split so one retry re-fetches <= this


# -- paths ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GcsPath:
    bucket: str
    name: str  # may be "" (the bucket itself) or a prefix

    @classmethod
    def parse(cls, path: str) -> "GcsPath":
        if not path.startswith(SCHEME):
            raise ValueError(f"not a gs:// path (got {path!r})")
        bucket, _, name = path[len(SCHEME):].partition("/")
        if not bucket:
            raise ValueError(f"gs:// path without a bucket name (got {path!r})")
        return cls(bucket, name)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.name}"


# -- one client per process -------------------------------------------------------------
_clients: dict[Optional[str], gcs_storage.Client] = {}
_clients_pid = os.getpid()
_clients_lock = threading.Lock()


def _forget_clients_in_child() -> None:
    # The child must not reuse the parent's sockets, nor a lock another thread held at fork.
    global _clients, _clients_pid, _clients_lock
    _clients, _clients_pid, _clients_lock = {}, os.getpid(), threading.Lock()


os.register_at_fork(after_in_child=_forget_clients_in_child)


def resolve_endpoint(endpoint: Optional[str] = None) -> Optional[str]:
    """The endpoint to use: ``endpoint``, else ``STORAGE_EMULATOR_HOST``, else None (Google)."""
    chosen = endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    if chosen and "://" not in chosen:
        chosen = "http://" + chosen
    return chosen.rstrip("/") if chosen else None


def client(endpoint: Optional[str] = None) -> gcs_storage.Client:
    """The process's client for ``endpoint`` (see :func:`resolve_endpoint`)."""
    key = resolve_endpoint(endpoint)
    with _clients_lock:
        if _clients_pid != os.getpid():  # forked without the at-fork hook (belt and braces)
            _forget_clients_in_child()
        if key not in _clients:
            _clients[key] = _make_client(key)
        return _clients[key]


def _make_client(endpoint: Optional[str]) -> gcs_storage.Client:
    if endpoint:
        # An emulator or test endpoint: no token to fetch, no project needed to read.
        return gcs_storage.Client(
            project=None, credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
        )
    import google.auth

    try:
        credentials, project = google.auth.default()
    except auth_exceptions.DefaultCredentialsError as exc:
        raise StorageError(
            "no Google credentials found for gs:// access: run `gcloud auth application-default "
            "login`, set GOOGLE_APPLICATION_CREDENTIALS to a service-account key, or, for the "
            f"local emulator, set STORAGE_EMULATOR_HOST ({exc})"
        ) from exc
    return gcs_storage.Client(project=project, credentials=credentials)


# -- retries ----------------------------------------------------------------------------
class TruncatedRead(IOError):
    """A response body shorter than the bytes asked for (transient: retried)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep ~ U(0, min(max, initial * 2**retry)).

    Full jitter (rather than a fixed or +-x% delay) spreads the retries of many workers hit
    by the same 429/503 over the whole interval, so they do not come back in lockstep.
    """

    max_attempts: int
    initial_backoff_s: float
    max_backoff_s: float
    deadline_s: float
    timeout_s: float

    @classmethod
    def from_options(cls, options: StorageOptions) -> "RetryPolicy":
        return cls(
            max_attempts=options.retry_max_attempts,
            initial_backoff_s=options.retry_initial_backoff_s,
            max_backoff_s=options.retry_max_backoff_s,
            deadline_s=options.retry_deadline_s,
            timeout_s=options.request_timeout_s,
        )

    @property
    def timeout(self) -> tuple[float, float]:
        return (min(10.0, self.timeout_s), self.timeout_s)  # (connect, read)

    def backoff_s(self, retry_index: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.initial_backoff_s * 2**retry_index))


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return exc.code in _TRANSIENT_STATUS
    if isinstance(exc, gcs_exceptions.InvalidResponse):
        return getattr(exc.response, "status_code", None) in _TRANSIENT_STATUS
    return isinstance(
        exc,
        (
            TruncatedRead,
            gcs_exceptions.DataCorruption,  # library crc32c/md5 mismatch: bytes damaged in transit
            requests.exceptions.ConnectionError,  # resets, refused, broken mid-body
            requests.exceptions.Timeout,
            requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.ProtocolError,  # "connection broken" while streaming a body
            urllib3.exceptions.IncompleteRead,
            urllib3.exceptions.TimeoutError,
            urllib3.exceptions.NewConnectionError,
            auth_exceptions.TransportError,
            http.client.IncompleteRead,
            ConnectionError,
            TimeoutError,
        ),
    )


def _permanent_error(obj: str, action: str, exc: BaseException) -> StorageError:
    code = getattr(exc, "code", None)
    if isinstance(exc, api_exceptions.NotFound) or code == 404:
        return StorageNotFoundError(
            f"{obj} does not exist (while trying to {action}): it was deleted, never written, or "
            "replaced while being read. If a manifest lists it, the dataset is incomplete: re-run "
            "the Beam job or restore the object."
        )
    if code in (401, 403):
        return StorageError(
            f"{obj}: access denied (HTTP {code}) while trying to {action}. The credentials in use "
            "need storage.objects.get/list on the bucket (roles/storage.objectViewer); check "
            "`gcloud auth application-default print-access-token` or GOOGLE_APPLICATION_CREDENTIALS."
        )
    if code == 412:
        return StorageError(
            f"{obj} changed while being read (HTTP 412 precondition failed): something rewrote it; "
            "datasets are immutable once their manifest exists, so re-run the Beam job to a new path."
        )
    return StorageError(f"{obj}: cannot {action}: {exc!r:.500} (not a transient error, not retried)")


def with_retries(obj: str, action: str, fn: Callable[[], T], policy: RetryPolicy) -> T:
    """``fn()``, retried on transient errors within ``policy``; StorageError otherwise."""
    start = time.monotonic()
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_transient(exc):
                raise _permanent_error(obj, action, exc) from exc
            elapsed = time.monotonic() - start
            delay = policy.backoff_s(attempt - 1)
            if attempt == policy.max_attempts or elapsed + delay > policy.deadline_s:
                raise StorageError(
                    f"{obj}: cannot {action}: still failing after {attempt} attempts in "
                    f"{elapsed:.1f}s (last error: {exc!r:.300}). The retry budget "
                    f"(retry_max_attempts={policy.max_attempts}, retry_deadline_s="
                    f"{policy.deadline_s}) is spent: check the network and the bucket's "
                    "status, or raise the budget in StorageOptions."
                ) from exc
            log.warning(
                "%s: %s failed (attempt %d/%d: %r); retrying in %.2fs",
                obj, action, attempt, policy.max_attempts, exc, delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop always returns or raises


# -- simple object access ---------------------------------------------------------------
def _target(path: str, options: Optional[StorageOptions]) -> tuple[GcsPath, RetryPolicy, gcs_storage.Client]:
    opts = options if options is not None else StorageOptions()
    return GcsPath.parse(path), RetryPolicy.from_options(opts), client(opts.endpoint)


def exists(path: str, options: Optional[StorageOptions] = None) -> bool:
    """True if the object exists, or (like a directory) any object lies under ``path/``."""
    loc, policy, c = _target(path, options)

    def probe() -> bool:
        if loc.name and c.bucket(loc.bucket).blob(loc.name).exists(retry=None, timeout=policy.timeout):
            return True
        prefix = loc.name.rstrip("/") + "/" if loc.name else ""
        try:
            return any(True for _ in c.list_blobs(loc.bucket, prefix=prefix, max_results=1, retry=None,
                                                  timeout=policy.timeout))
        except api_exceptions.NotFound:  # the bucket itself does not exist
            return False

    return with_retries(path, "check existence", probe, policy)


def read_bytes(path: str, options: Optional[StorageOptions] = None) -> bytes:
    """The whole object (for manifests and small files; checked by the library's crc32c/md5)."""
    loc, policy, c = _target(path, options)
    return with_retries(path, "download", lambda: c.bucket(loc.bucket).blob(loc.name).download_as_bytes(
        retry=None, timeout=policy.timeout), policy)


def write_bytes(path: str, data: bytes, options: Optional[StorageOptions] = None,
                content_type: str = "application/octet-stream") -> None:
    """Upload ``data`` as one object (retried: rewriting the same bytes is idempotent)."""
    loc, policy, c = _target(path, options)
    with_retries(path, "upload", lambda: c.bucket(loc.bucket).blob(loc.name).upload_from_string(
        data, content_type=content_type, retry=None, timeout=policy.timeout), policy)


def list_prefix(path: str, options: Optional[StorageOptions] = None) -> list[str]:
    """Sorted ``gs://`` URLs of every object whose name starts with ``path``'s name."""
    loc, policy, c = _target(path, options)

    def listing() -> list[str]:
        blobs = c.list_blobs(loc.bucket, prefix=loc.name, retry=None, timeout=policy.timeout)
        return sorted(f"{SCHEME}{loc.bucket}/{b.name}" for b in blobs)

    return with_retries(path, "list objects", listing, policy)


# -- ranged reads -----------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteObject:
    """One generation of one object, as seen by a metadata GET."""

    url: str
    bucket: str
    name: str
    size: int
    generation: Optional[int]
    endpoint: Optional[str]

    def fetch(self, start: int, end: int, policy: RetryPolicy) -> bytes:
        """Bytes ``[start, end)``, retried until complete (``bytes=N-M`` ranges only)."""
        if start >= end:
            return b""

        def once() -> bytes:
            # A fresh Blob per request: the library rewrites a blob's properties from response
            # headers, so a reused one could lose the pinned generation or race between threads.
            blob = client(self.endpoint).bucket(self.bucket).blob(self.name, generation=self.generation)
            data = blob.download_as_bytes(
                start=start, end=end - 1, raw_download=True, checksum=None, retry=None, timeout=policy.timeout
            )
            if len(data) != end - start:
                raise TruncatedRead(f"asked for {end - start} bytes at {start}, got {len(data)}")
            return data

        return with_retries(self.url, f"read bytes {start}-{end - 1}", once, policy)

    def copy_to(self, out: BinaryIO, policy: RetryPolicy, chunk_bytes: int) -> None:
        """Stream the whole object into ``out`` in ranged chunks (memory: one chunk)."""
        for start in range(0, self.size, chunk_bytes):
            out.write(self.fetch(start, min(self.size, start + chunk_bytes), policy))


def stat(path: str, options: Optional[StorageOptions] = None) -> RemoteObject:
    """Size and generation of ``path``; :class:`StorageNotFoundError` if it does not exist."""
    loc, policy, c = _target(path, options)
    blob = with_retries(path, "read metadata", lambda: c.bucket(loc.bucket).get_blob(
        loc.name, retry=None, timeout=policy.timeout), policy)
    if blob is None:
        raise _permanent_error(path, "read metadata", api_exceptions.NotFound(path))
    endpoint = resolve_endpoint(options.endpoint if options is not None else None)
    return RemoteObject(path, loc.bucket, loc.name, int(blob.size), blob.generation, endpoint)


class RangedReader(io.RawIOBase):
    """A read-only, seekable view of a remote object through a bounded read-ahead window.

    A read inside the window is served from memory; otherwise one ranged GET fetches
    ``max(n, readahead)`` bytes from the read position (reads larger than the window are
    passed through, split into requests of at most 64 MiB). Memory: one window plus the
    read being served. Thread-safe (pyarrow may read from its I/O threads).
    """

    def __init__(self, obj: RemoteObject, policy: RetryPolicy, readahead_bytes: int) -> None:
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


def open_input(path: str, options: Optional[StorageOptions] = None) -> RangedReader:
    """A seekable binary file object over ``path`` doing ranged reads."""
    opts = options if options is not None else StorageOptions()
    return RangedReader(stat(path, opts), RetryPolicy.from_options(opts), opts.readahead_bytes)


# -- lane files -------------------------------------------------------------------------
def _size_mismatch(url: str, actual: int, entry) -> StorageError:
    return StorageError(
        f"{url} has {actual} bytes but the manifest says {entry.bytes}: the object was truncated "
        "or replaced after the manifest was written; re-run the Beam job or restore the object"
    )


def _sha256_mismatch(url: str, actual: str, entry) -> StorageError:
    return StorageError(
        f"{url}: content does not match the manifest (sha256 {actual[:16]}..., manifest "
        f"says {entry.sha256[:16]}...; size matches) after {CHECKSUM_ATTEMPTS} downloads: the "
        "object was overwritten or is corrupt; re-run the Beam job or restore the object"
    )


def open_lane_file(path: str, entry, options: StorageOptions) -> BinaryIO:
    """Open a lane file listed in a manifest (``entry``: :class:`loader.io.manifest.FileEntry`)."""
    policy = RetryPolicy.from_options(options)
    if options.cache_dir is not None:
        lane_cache = cache.LaneFileCache(options.cache_dir, options.cache_max_bytes, options.verify_checksums)
        if lane_cache.fits(entry):
            def fetch(out: BinaryIO) -> None:
                obj = stat(path, options)
                if obj.size != entry.bytes:
                    raise _size_mismatch(path, obj.size, entry)
                obj.copy_to(out, policy, max(options.readahead_bytes, 16 * 1024**2))

            return lane_cache.open(path, entry, fetch)
        log.warning("%s (%d bytes) is larger than cache_max_bytes=%d: reading it uncached",
                    path, entry.bytes, options.cache_max_bytes)
    obj = stat(path, options)
    if obj.size != entry.bytes:
        raise _size_mismatch(path, obj.size, entry)
    if obj.size > options.whole_file_max_bytes:
        return RangedReader(obj, policy, options.readahead_bytes)
    for attempt in range(1, CHECKSUM_ATTEMPTS + 1):
        data = obj.fetch(0, obj.size, policy)
        digest = hashlib.sha256(data).hexdigest()
        if not options.verify_checksums or digest == entry.sha256:
            return io.BytesIO(data)
        log.warning("%s: sha256 %s differs from the manifest's %s (download %d/%d)",
                    path, digest[:16], entry.sha256[:16], attempt, CHECKSUM_ATTEMPTS)
    raise _sha256_mismatch(path, digest, entry)


# -- Beam -------------------------------------------------------------------------------
def beam_gcs_test_setup(endpoint: Optional[str] = None) -> Callable[[], None]:
    """Point Beam's ``gs://`` filesystem at an emulator with anonymous credentials.

    Beam's ``gcsio`` builds its client with ``create_storage_client(options)``, which calls
    ``google.auth.default()`` with 20-30 s of backoff when no credentials exist (once per
    process) before falling back to anonymous; ``--no_auth`` does not reach ``gcsio`` in
    Beam 2.77. ``create_storage_client`` is public in
    ``apache_beam.io.gcp.gcsio`` (``__all__``) and looked up at each ``GcsIO()``; this
    replaces it in the current process with one returning an anonymous client for the
    emulator. Tests only: with real credentials nothing is needed. Runs in-process runners
    only (FnApiRunner / in_memory); separate worker processes would not see it. Returns a
    function that restores the original.
    """
    target = resolve_endpoint(endpoint)
    if target is None:
        raise ValueError("beam_gcs_test_setup needs an emulator: pass endpoint= or set STORAGE_EMULATOR_HOST")
    from apache_beam.io.gcp import gcsio

    original = gcsio.create_storage_client

    def emulator_client(pipeline_options=None, use_credentials=True) -> gcs_storage.Client:
        return gcs_storage.Client(project=None, credentials=AnonymousCredentials(),
                                  client_options={"api_endpoint": target})

    gcsio.create_storage_client = emulator_client

    def restore() -> None:
        gcsio.create_storage_client = original

    return restore
