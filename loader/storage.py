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
