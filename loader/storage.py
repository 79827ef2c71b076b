"""Paths and byte access for local directories and ``gs://`` buckets.

The loader, the manifest reader and the CLI go through this module, so a dataset behaves
the same on local disk and in a bucket. Local paths use the filesystem directly; ``gs://``
paths use ``google-cloud-storage`` (see :mod:`loader.gcs`), which honours
``STORAGE_EMULATOR_HOST`` for tests.
"""

from __future__ import annotations

import os
from typing import BinaryIO


def is_gcs(path: str) -> bool:
    return path.startswith("gs://")


def join(base: str, *parts: str) -> str:
    if is_gcs(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return os.path.join(base, *parts)


def exists(path: str) -> bool:
    if is_gcs(path):
        from loader import gcs

        return gcs.exists(path)
    return os.path.exists(path)


def read_bytes(path: str) -> bytes:
    if is_gcs(path):
        from loader import gcs

        return gcs.read_bytes(path)
    with open(path, "rb") as fh:
        return fh.read()


def open_input(path: str) -> BinaryIO:
    """A seekable binary file object for ``path`` (ranged reads on ``gs://``)."""
    if is_gcs(path):
        from loader import gcs

        return gcs.open_input(path)
    return open(path, "rb")


# ---------------------------------------------------------------------------------------
# Lane files: what the loader opens. One function, so local and gs:// behave the same.

from dataclasses import dataclass as _dataclass
from typing import Optional as _Optional


class StorageError(IOError):
    """A lane file that cannot be read correctly; the message names the object."""


@_dataclass(frozen=True)
class StorageOptions:
    """How the loader reads lane files. Documented in README ("Storage options")."""

    cache_dir: _Optional[str] = None  # local cache for remote lane files (None = no cache)
    cache_max_bytes: int = 10 * 1024**3
    verify_checksums: bool = True  # compare with the manifest's sha256 where the file is read whole
    endpoint: _Optional[str] = None  # explicit GCS endpoint (else STORAGE_EMULATOR_HOST / Google)


def open_lane_file(dataset_path: str, entry, options: StorageOptions = StorageOptions()) -> BinaryIO:
    """Open a lane part file (``entry`` is a :class:`loader.manifest.FileEntry`) for pyarrow.

    Local files are opened directly and their size is checked against the manifest (page
    checksums inside the Parquet file catch corrupted bytes as they are read).
    """
    path = join(dataset_path, entry.path)
    if is_gcs(path):
        from loader import gcs

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
    return open(path, "rb")
