"""``gs://`` access on google-cloud-storage: the ``gs`` storage backend (:mod:`loader.io.backends`).

Guarantees:

* :func:`open_lane_file` checks the object's size against the manifest before any data
  moves, then reads it whole (SHA-256-checked), ranged or through the cache, as every
  remote backend does (:func:`loader.io.remote_files.open_remote_lane_file`).
* Every request is retried on transient failures (HTTP 408/429/5xx, connection resets,
  timeouts, truncated bodies) with exponential backoff and full jitter, within the budget
  of :class:`loader.io.storage.StorageOptions` (``retry_*``, :mod:`loader.io.retries`). Permanent failures raise
  :class:`loader.io.storage.StorageError` naming ``gs://bucket/name`` and what to do.
* Ranged reads pin the object generation seen at open: an object replaced mid-read fails
  (404 on GCS) instead of mixing bytes of two versions.
* One client per process and endpoint, re-created after ``fork`` (a connection pool must
  never be shared between a worker and its parent).

Credentials: Application Default Credentials. When ``STORAGE_EMULATOR_HOST`` is set or
``StorageOptions.endpoint`` is given, anonymous credentials against that endpoint.
"""

from __future__ import annotations

import http.client
import os
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, TypeVar

import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs_storage
from google.cloud.storage import exceptions as gcs_exceptions

from loader.io import remote_files
from loader.io.backends import ObjectInfo, StorageBackend, register_backend, split_bucket_path
from loader.io.clients import PerProcessClients
from loader.io.remote_files import RangedReader
from loader.io.retries import TRANSIENT_STATUS, RetryPolicy, TruncatedRead, run_with_retries
from loader.errors import StorageError, StorageNotFoundError
from loader.io.storage_options import StorageOptions

T = TypeVar("T")

SCHEME = "gs://"


# -- paths ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GcsPath:
    bucket: str
    name: str  # may be "" (the bucket itself) or a prefix

    @classmethod
    def parse(cls, path: str) -> "GcsPath":
        return cls(*split_bucket_path(path, "gs"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.name}"


# -- one client per process -------------------------------------------------------------
def resolve_endpoint(endpoint: Optional[str] = None) -> Optional[str]:
    """The endpoint to use: ``endpoint``, else ``STORAGE_EMULATOR_HOST``, else None (Google)."""
    chosen = endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    if chosen and "://" not in chosen:
        chosen = "http://" + chosen
    return chosen.rstrip("/") if chosen else None


def client(endpoint: Optional[str] = None) -> gcs_storage.Client:
    """The process's client for ``endpoint`` (see :func:`resolve_endpoint`)."""
    return _clients.get(resolve_endpoint(endpoint))


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


_clients: PerProcessClients[Optional[str], gcs_storage.Client] = PerProcessClients(_make_client)


# -- retries ----------------------------------------------------------------------------
def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return exc.code in TRANSIENT_STATUS
    if isinstance(exc, gcs_exceptions.InvalidResponse):
        return getattr(exc.response, "status_code", None) in TRANSIENT_STATUS
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
    return run_with_retries(obj, action, fn, policy, is_transient=is_transient, permanent_error=_permanent_error)


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
        remote_files.copy_to(self, out, policy, chunk_bytes)


def stat(path: str, options: Optional[StorageOptions] = None) -> RemoteObject:
    """Size and generation of ``path``; :class:`StorageNotFoundError` if it does not exist."""
    loc, policy, c = _target(path, options)
    blob = with_retries(path, "read metadata", lambda: c.bucket(loc.bucket).get_blob(
        loc.name, retry=None, timeout=policy.timeout), policy)
    if blob is None:
        raise _permanent_error(path, "read metadata", api_exceptions.NotFound(path))
    endpoint = resolve_endpoint(options.endpoint if options is not None else None)
    return RemoteObject(path, loc.bucket, loc.name, int(blob.size), blob.generation, endpoint)


def open_input(path: str, options: Optional[StorageOptions] = None) -> RangedReader:
    """A seekable binary file object over ``path`` doing ranged reads."""
    opts = options if options is not None else StorageOptions()
    return RangedReader(stat(path, opts), RetryPolicy.from_options(opts), opts.readahead_bytes)


# -- lane files -------------------------------------------------------------------------
def open_lane_file(path: str, entry, options: StorageOptions) -> BinaryIO:
    """Open a lane file listed in a manifest (``entry``: :class:`loader.io.manifest.FileEntry`);
    see :func:`loader.io.remote_files.open_remote_lane_file`."""
    return remote_files.open_remote_lane_file(path, entry, options, lambda: stat(path, options))


def delete(path: str, options: Optional[StorageOptions] = None) -> None:
    """Remove the object (absent is fine)."""
    loc, policy, c = _target(path, options)

    def remove() -> None:
        try:
            c.bucket(loc.bucket).blob(loc.name).delete(retry=None, timeout=policy.timeout)
        except api_exceptions.NotFound:
            pass

    with_retries(path, "delete", remove, policy)


# -- the backend ------------------------------------------------------------------------
class GcsBackend(StorageBackend):
    """``gs://`` behind the backend protocol: the functions of this module."""

    scheme = "gs"
    beam_filesystem = True  # the job keeps Beam's gcsio (Dataflow's own, tested in tests/gcs)

    def exists(self, path: str, options: StorageOptions) -> bool:
        return exists(path, options)

    def stat(self, path: str, options: StorageOptions) -> ObjectInfo:
        obj = stat(path, options)
        return ObjectInfo(path, obj.size, None if obj.generation is None else str(obj.generation), None)

    def read_bytes(self, path: str, options: StorageOptions) -> bytes:
        return read_bytes(path, options)

    def open_input(self, path: str, options: StorageOptions) -> BinaryIO:
        return open_input(path, options)

    def open_lane_file(self, path: str, entry, options: StorageOptions) -> BinaryIO:
        return open_lane_file(path, entry, options)

    def list_objects(self, path: str, options: StorageOptions) -> list[ObjectInfo]:
        loc, policy, c = _target(path, options)

        def listing() -> list[ObjectInfo]:
            blobs = c.list_blobs(loc.bucket, prefix=loc.name, retry=None, timeout=policy.timeout)
            return sorted((ObjectInfo(f"{SCHEME}{loc.bucket}/{b.name}", int(b.size), str(b.generation), None)
                           for b in blobs), key=lambda o: o.url)

        return with_retries(path, "list objects", listing, policy)

    def write_atomically(self, path: str, data: bytes, options: StorageOptions) -> None:
        write_bytes(path, data, options)  # an upload is atomic: the object appears whole or not at all

    def delete(self, path: str, options: StorageOptions) -> None:
        delete(path, options)


register_backend(GcsBackend())


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
