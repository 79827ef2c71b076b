"""Paths and byte access for local directories and object stores (``gs://``, ``s3://``).

The loader, the manifest reader, the CLI and the Beam job go through this module, so a
dataset behaves the same on local disk and in a bucket. Each function hands the path to the
backend registered for its scheme (:mod:`loader.io.backends`): local paths use the
filesystem directly, ``gs://`` google-cloud-storage (:mod:`loader.io.gcs`), ``s3://`` boto3
(:mod:`loader.io.s3`). A scheme without a backend (``az://``, ``hf://``) is refused with
an :class:`~loader.io.backends.UnsupportedSchemeError` listing those that have one.
"""

from __future__ import annotations

from typing import BinaryIO

from loader.io.backends import UnsupportedSchemeError, backend_for, is_remote, scheme_of
# The options and errors of every backend; users import them from here.
from loader.errors import StorageError, StorageNotFoundError
from loader.io.storage_options import StorageOptions

__all__ = [
    "StorageError", "StorageNotFoundError", "StorageOptions", "UnsupportedSchemeError", "exists", "is_gcs",
    "is_remote", "join", "list_prefix", "open_input", "open_lane_file", "read_bytes", "read_user_text",
    "scheme_of", "write_atomically",
]


def _options(options: "StorageOptions | None") -> StorageOptions:
    return options if options is not None else StorageOptions()


def is_gcs(path: str) -> bool:
    return scheme_of(path) == "gs"


def join(base: str, *parts: str) -> str:
    return backend_for(base).join(base, *parts)


def exists(path: str, options: "StorageOptions | None" = None) -> bool:
    return backend_for(path).exists(path, _options(options))


def read_bytes(path: str, options: "StorageOptions | None" = None) -> bytes:
    return backend_for(path).read_bytes(path, _options(options))


def write_atomically(path: str, data: bytes, options: "StorageOptions | None" = None) -> None:
    """``data`` under ``path``, seen whole or not at all (how a manifest is committed)."""
    backend_for(path).write_atomically(path, data, _options(options))


def list_prefix(path: str, options: "StorageOptions | None" = None) -> list[str]:
    """Sorted paths of every object (file) whose path starts with ``path``."""
    return [obj.url for obj in backend_for(path).list_objects(path, _options(options))]


def read_user_text(path: str, options, *, error: type, noun: str, named_by: str, directory_hint: str) -> str:
    """A file a user named (a tokenizer, a chat template) as UTF-8 text, local or remote.

    Every failure is an ``error`` naming the ``noun`` ("tokenizer", "chat template"), the path
    and where the path came from (``named_by``, e.g. "config field 'tokenizer'"); a failed
    remote read stays the :class:`StorageError` that already names the object.
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


def open_input(path: str, options: "StorageOptions | None" = None) -> BinaryIO:
    """A seekable binary file object for ``path`` (ranged reads of one pinned version, remote)."""
    return backend_for(path).open_input(path, _options(options))


# ---------------------------------------------------------------------------------------
# Lane files: what the loader opens. One function, so every backend behaves the same.

def open_lane_file(dataset_path: str, entry, options: StorageOptions = StorageOptions()) -> BinaryIO:
    """Open a lane part file (``entry`` is a :class:`loader.io.manifest.FileEntry`) for pyarrow.

    Local files are opened directly and their size is checked against the manifest (page
    checksums inside the Parquet file catch corrupted bytes as they are read). Remote files:
    see :func:`loader.io.remote_files.open_remote_lane_file` (size check, sha256 where read
    whole, ranged reads of a pinned version otherwise, retries, and the optional local cache
    of :mod:`loader.io.cache`).
    """
    backend = backend_for(dataset_path)
    return backend.open_lane_file(backend.join(dataset_path, entry.path), entry, options)
