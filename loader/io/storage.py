"""Paths and byte access for local directories and ``gs://`` buckets.

The loader, the manifest reader and the CLI go through this module, so a dataset behaves
the same on local disk and in a bucket. Local paths use the filesystem directly; ``gs://``
paths use ``google-cloud-storage`` (see :mod:`loader.io.gcs`), which honours
``STORAGE_EMULATOR_HOST`` for tests.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import pyarrow as pa

# The options and errors of every backend; users import them from here.
from loader.errors import StorageError, StorageNotFoundError
from loader.io.storage_options import StorageOptions


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
