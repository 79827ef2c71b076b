"""The storage backend protocol and its registry by URL scheme.

A path is *remote* when it starts with ``scheme://``; everything else is a local path. The
one rule every "is this path remote, and who reads it" question in the loader and the Beam
job goes through is :func:`backend_for`: the local backend for a path without a scheme, the
backend registered for the scheme otherwise, and for a scheme nobody registered an
:class:`UnsupportedSchemeError` that lists the schemes that are supported (an ``az://`` or
``s3:/`` typo is never read as a local relative path).

Built-in backends register themselves when their module is imported; the registry imports
them on first use of their scheme (``google-cloud-storage`` and ``boto3`` are slow to
import), so ``import loader`` stays light:

=========  =========================  ==========================================
scheme     module                     pinned by
=========  =========================  ==========================================
(none)     :mod:`loader.io.local`     size (and SHA-256 with verify_local_files)
``gs``     :mod:`loader.io.gcs`       object generation
``s3``     :mod:`loader.io.s3`        version id (versioned buckets), else ETag
=========  =========================  ==========================================

A new backend is a module with a :class:`StorageBackend` subclass that calls
:func:`register_backend` at import time (and, to be found lazily, an entry in
:data:`BUILTIN_BACKENDS`); nothing else in the loader or the job names a scheme.
"""

from __future__ import annotations

import importlib
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Optional

from loader.errors import StorageError, UnsupportedSchemeError
from loader.io.storage_options import StorageOptions

LOCAL = ""  # the scheme of a path without one
# scheme -> module whose import registers it (imported on first use, see the module docstring)
BUILTIN_BACKENDS = {LOCAL: "loader.io.local", "gs": "loader.io.gcs", "s3": "loader.io.s3"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class ObjectInfo:
    """What a metadata request says about one object (or local file).

    ``version``: what pins it (a GCS generation, an S3 version id or ``etag:"..."``, a
    local file's mtime in ns); ``checksum``: the store's own whole-object checksum when it
    keeps one (``sha256:<hex>``, ``md5:<hex>``, ``crc32c:<base64>``...), else None.
    """

    url: str
    size: int
    version: Optional[str]
    checksum: Optional[str]


class StorageBackend(ABC):
    """One storage system, as the loader and the Beam job use it.

    Every method takes the path in its user form (``s3://bucket/key``) and the
    :class:`StorageOptions` of the read; every failure is a :class:`StorageError` that names
    the object and the fix (a missing object: :class:`StorageNotFoundError`). Remote
    backends run each request through :func:`loader.io.retries.run_with_retries`.
    """

    scheme: str = LOCAL
    # True: the Beam job leaves this scheme to Beam's own FileSystems (local, gs://);
    # False: the job reads and writes it through this backend (beam_jobs.job_files).
    beam_filesystem: bool = False

    @property
    def remote(self) -> bool:
        return self.scheme != LOCAL

    def join(self, base: str, *parts: str) -> str:
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])

    @abstractmethod
    def exists(self, path: str, options: StorageOptions) -> bool:
        """True if the object exists, or (like a directory) anything lies under ``path/``."""

    @abstractmethod
    def stat(self, path: str, options: StorageOptions) -> ObjectInfo:
        """Size, version and checksum of one object; StorageNotFoundError if it is absent."""

    @abstractmethod
    def read_bytes(self, path: str, options: StorageOptions) -> bytes:
        """The whole object (manifests, tokenizers, templates, images), from one version."""

    @abstractmethod
    def open_input(self, path: str, options: StorageOptions) -> BinaryIO:
        """A seekable binary file object over one version of the object (ranged reads)."""

    @abstractmethod
    def open_lane_file(self, path: str, entry, options: StorageOptions) -> BinaryIO:
        """A lane file checked against its manifest entry (size before any data; see the backends)."""

    @abstractmethod
    def list_objects(self, path: str, options: StorageOptions) -> list[ObjectInfo]:
        """Every object whose path (in the user form) starts with ``path``, sorted by path."""

    @abstractmethod
    def write_atomically(self, path: str, data: bytes, options: StorageOptions) -> None:
        """Write ``data`` so that a reader sees the whole of it under ``path`` or nothing (the
        manifest's commit: written last, after every lane file)."""

    @abstractmethod
    def delete(self, path: str, options: StorageOptions) -> None:
        """Remove one object (absent is fine)."""


_registry: dict[str, StorageBackend] = {}
_lock = threading.Lock()


def register_backend(backend: StorageBackend) -> None:
    """Make ``backend`` the one that serves ``backend.scheme://`` paths (last registration wins)."""
    if not isinstance(backend, StorageBackend):
        raise TypeError(f"register_backend needs a StorageBackend (got {type(backend).__name__})")
    with _lock:
        _registry[backend.scheme] = backend


def scheme_of(path: str) -> str:
    """``"s3"`` for ``s3://b/k``, ``""`` (:data:`LOCAL`) for a path without a scheme."""
    match = _SCHEME.match(path)
    return match.group(1).lower() if match else LOCAL


def is_remote(path: str) -> bool:
    """True for any ``scheme://`` path, supported or not (an unsupported one fails when used)."""
    return scheme_of(path) != LOCAL


def split_bucket_path(path: str, scheme: str) -> tuple[str, str]:
    """``("bucket", "key/of/object")`` of ``scheme://bucket/key/of/object`` (the key may be "")."""
    prefix = f"{scheme}://"
    if not path.startswith(prefix):
        raise ValueError(f"not a {prefix} path (got {path!r})")
    bucket, _, key = path[len(prefix):].partition("/")
    if not bucket:
        raise StorageError(f"{path}: no bucket name; write {prefix}BUCKET/prefix")
    return bucket, key


def supported_schemes() -> list[str]:
    """``["gs", "s3", ...]``: the schemes with a backend (built in or registered)."""
    return sorted(({s for s in BUILTIN_BACKENDS} | set(_registry)) - {LOCAL})


def backend_for(path: str) -> StorageBackend:
    """The backend serving ``path``; :class:`UnsupportedSchemeError` if its scheme has none."""
    scheme = scheme_of(path)
    backend = _registry.get(scheme)
    if backend is not None:
        return backend
    module = BUILTIN_BACKENDS.get(scheme)
    if module is None:
        shown = ", ".join(f"{s}://" for s in supported_schemes())
        raise UnsupportedSchemeError(
            f"{path}: the storage scheme {scheme}:// is not supported; supported: {shown} and local "
            "paths (a path without a scheme). Copy the data to one of those, or register a backend "
            "for it (loader.io.backends.register_backend)."
        )
    try:
        importlib.import_module(module)  # registers the backend (heavy client libraries load here)
    except ImportError as exc:
        raise StorageError(
            f"{path}: {scheme}:// paths need the Python package {exc.name!r}, which is not installed "
            f"({exc}); install zephon with its dependencies (pip install -e .) or pip install {exc.name}"
        ) from exc
    if scheme not in _registry:
        raise AssertionError(f"{module} did not register a backend for {scheme or 'local'} paths")
    return _registry[scheme]
