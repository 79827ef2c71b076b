"""Paths and byte access for local directories and ``gs://`` buckets.

The loader, the manifest reader and the CLI go through this module, so a dataset behaves
the same on local disk and in a bucket. Local paths use the filesystem directly; ``gs://``
paths use ``google-cloud-storage`` (see :mod:`loader.io.gcs`), which honours
``STORAGE_EMULATOR_HOST`` for tests.
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

import pyarrow as pa

from loader.errors import ZephonError


def is_gcs(path: str) -> bool:
    return path.startswith("gs://")


def join(base: str, *parts: str) -> str:
    if is_gcs(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return os.path.join(base, *parts)


def exists(path: str, options: "StorageOptions | None" = None) -> bool:
    if is_gcs(path):
        from loader.io import gcs

        return gcs.exists(path, options)
    return os.path.exists(path)


def read_bytes(path: str, options: "StorageOptions | None" = None) -> bytes:
    if is_gcs(path):
        from loader.io import gcs

        return gcs.read_bytes(path, options)
    with open(path, "rb") as fh:
        return fh.read()


def read_user_text(path: str, options, *, error: type, noun: str, named_by: str, directory_hint: str) -> str:
    """A file a user named (a tokenizer, a chat template) as UTF-8 text, local or ``gs://``.

    Every failure is an ``error`` naming the ``noun`` ("tokenizer", "chat template"), the path
    and where the path came from (``named_by``, e.g. "config field 'tokenizer'"); a failed
    ``gs://`` read stays the :class:`StorageError` that already names the object.
    """
    try:
        raw = read_bytes(path, options)
    except StorageNotFoundError as exc:
        raise error(f"{noun} file {path} does not exist ({named_by})") from exc
    except StorageError:
        raise
    except FileNotFoundError as exc:
        raise error(f"{noun} file {path} does not exist ({named_by})") from exc
    except IsADirectoryError as exc:
        raise error(f"{noun} {path} is a directory; {directory_hint}") from exc
    except OSError as exc:
        raise error(f"{noun} file {path} cannot be read ({exc.strerror or exc})") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{noun} file {path} is not UTF-8 text ({exc})") from exc


def open_input(path: str) -> BinaryIO:
    """A seekable binary file object for ``path`` (ranged reads on ``gs://``)."""
    if is_gcs(path):
        from loader.io import gcs

        return gcs.open_input(path)
    return open(path, "rb")


# ---------------------------------------------------------------------------------------
# Lane files: what the loader opens. One function, so local and gs:// behave the same.

from dataclasses import dataclass as _dataclass
from typing import Optional as _Optional
from typing import ClassVar as _ClassVar

from loader import validation as _rules


class StorageError(ZephonError, IOError):
    """A lane file that cannot be read correctly; the message names the object."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist (``except FileNotFoundError`` catches it too)."""


_MIB = 1024**2
CHECKSUM_ATTEMPTS = 2  # a whole download whose sha256 mismatches the manifest is fetched once more, then fails


@_dataclass(frozen=True)
class StorageOptions:
    """How the loader reads lane files. Documented in README ("Storage options").

    The retry fields bound every remote request (``gs://``): a request that fails with a
    transient error (HTTP 408/429/5xx, connection reset, timeout, truncated body) is retried
    with exponential backoff and full jitter, at most ``retry_max_attempts`` times and no
    longer than ``retry_deadline_s`` (plus the attempt in flight, itself bounded by
    ``request_timeout_s``). Permanent errors (404, 403, checksum mismatch) are not retried.
    """

    cache_dir: _Optional[str] = None  # local cache for remote lane files (None = no cache)
    cache_max_bytes: int = 10 * 1024**3
    verify_checksums: bool = True  # compare with the manifest's sha256 where the file is read whole
    verify_local_files: bool = False  # sha256 of local lane files on first open (off: README "Data integrity")
    endpoint: _Optional[str] = None  # explicit GCS endpoint (else STORAGE_EMULATOR_HOST / Google)
    retry_max_attempts: int = 8  # attempts per request, the first one included
    retry_initial_backoff_s: float = 0.5  # backoff cap before the 1st retry; doubles each retry
    retry_max_backoff_s: float = 16.0  # ceiling of the backoff cap
    retry_deadline_s: float = 120.0  # no new attempt starts after this many seconds
    request_timeout_s: float = 60.0  # connect/read timeout of one HTTP request
    readahead_bytes: int = 8 * _MIB  # ranged-read window (memory per open remote file)
    whole_file_max_bytes: int = 4 * _MIB  # remote files up to this size are fetched whole + sha256-checked

    # Checked by loader.validation; the LoaderConfig ``storage`` table reuses these rules.
    FIELD_RULES: _ClassVar[dict] = {
        "cache_dir": _rules.OrAbsent(_rules.FilePath()),
        "cache_max_bytes": _rules.Integer(minimum=1),
        "verify_checksums": _rules.Boolean(),
        "verify_local_files": _rules.Boolean(),
        "endpoint": _rules.OrAbsent(_rules.Text()),
        "retry_max_attempts": _rules.Integer(minimum=1),
        "retry_initial_backoff_s": _rules.Number(minimum=0),
        "retry_max_backoff_s": _rules.Number(minimum=0),
        "retry_deadline_s": _rules.Number(minimum=0),
        "request_timeout_s": _rules.Number(minimum=0, exclusive=True,
                                           hint="a request without a timeout can hang forever"),
        "readahead_bytes": _rules.Integer(minimum=1),
        "whole_file_max_bytes": _rules.Integer(minimum=0),
    }

    def __post_init__(self) -> None:
        from loader.config import ConfigError

        _rules.validate_instance(self, ConfigError, "StorageOptions")


HASH_CHUNK_BYTES = 4 * _MIB


def sha256_of_file(handle) -> str:
    """Hex SHA-256 of ``handle`` from its position to its end, in 4 MiB chunks.

    The one way lane files are hashed after they are written: cached copies
    (:mod:`loader.io.cache`) and local lane files (``verify_local_files``). An Arrow file
    hands out its chunks without a copy (``read_buffer``); hashlib releases the GIL while
    it hashes a large chunk, so a read-ahead thread hashing a file leaves the trainer's
    thread free.
    """
    read = getattr(handle, "read_buffer", None) or handle.read
    sha = hashlib.sha256()
    while len(chunk := read(HASH_CHUNK_BYTES)):
        sha.update(chunk)
    return sha.hexdigest()


def open_lane_file(dataset_path: str, entry, options: StorageOptions = StorageOptions()) -> BinaryIO:
    """Open a lane part file (``entry`` is a :class:`loader.io.manifest.FileEntry`) for pyarrow.

    Local files are opened directly and their size is checked against the manifest (page
    checksums inside the Parquet file catch corrupted bytes as they are read). ``gs://``
    files: see :func:`loader.io.gcs.open_lane_file` (size check, sha256 where read whole,
    ranged reads otherwise, retries, and the optional local cache of :mod:`loader.io.cache`).
    """
    path = join(dataset_path, entry.path)
    if is_gcs(path):
        from loader.io import gcs

        return gcs.open_lane_file(path, entry, options)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError as exc:
        raise StorageError(
            f"{path} is listed in the manifest but does not exist; the dataset is incomplete "
            "(re-run the Beam job, or restore the file)"
        ) from exc
    if size != entry.bytes:
        raise StorageError(
            f"{path} has {size} bytes but the manifest says {entry.bytes}: the file is truncated "
            "or was replaced; re-run the Beam job or restore the file"
        )
    # A native Arrow file, not a Python file object: pyarrow then reads without calling back
    # into Python, so the read-ahead thread does not queue for the GIL the trainer's thread
    # holds (bench/RESULTS.md, "Token column codec and lane file access"). Not a memory map:
    # mapped pages of every open lane file would count in the process's RSS as it reads,
    # which looks like a leak on a long run.
    return pa.OSFile(path, "r")
