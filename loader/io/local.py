"""Local paths (no scheme) as a storage backend: the filesystem, directly.

Lane files are opened as native Arrow files and their size is checked against the manifest
(page checksums inside the Parquet file catch corrupted bytes as they are read; the whole
file's SHA-256 with ``verify_local_files``). Writes go to ``<path>.inprogress`` and are
renamed into place, so a reader never sees half a file under the final name.
"""

from __future__ import annotations

import contextlib
import os
from typing import BinaryIO

import pyarrow as pa

from loader.io.backends import LOCAL, ObjectInfo, StorageBackend, register_backend
from loader.errors import StorageError, StorageNotFoundError
from loader.io.storage_options import StorageOptions

INPROGRESS_SUFFIX = ".inprogress"


class LocalBackend(StorageBackend):
    scheme = LOCAL
    beam_filesystem = True  # Beam's local filesystem writes the job's files (FIELD-NOTES: rename pattern)

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def exists(self, path: str, options: StorageOptions) -> bool:
        return os.path.exists(path)

    def stat(self, path: str, options: StorageOptions) -> ObjectInfo:
        try:
            st = os.stat(path)
        except FileNotFoundError as exc:
            raise StorageNotFoundError(f"{path} does not exist") from exc
        return ObjectInfo(path, st.st_size, str(st.st_mtime_ns), None)

    def read_bytes(self, path: str, options: StorageOptions) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def open_input(self, path: str, options: StorageOptions) -> BinaryIO:
        return open(path, "rb")

    def open_lane_file(self, path: str, entry, options: StorageOptions) -> BinaryIO:
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
        # holds (bench/HISTORY.md, "Token column codec and lane file access"). Not a memory map:
        # mapped pages of every open lane file would count in the process's RSS as it reads,
        # which looks like a leak on a long run.
        return pa.OSFile(path, "r")

    def list_objects(self, path: str, options: StorageOptions) -> list[ObjectInfo]:
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        found = []
        for root, _, names in os.walk(directory or "."):
            found += [p for p in (os.path.join(root, n) for n in names) if p.startswith(path)]
        return [self.stat(p, options) for p in sorted(found)]

    def write_atomically(self, path: str, data: bytes, options: StorageOptions) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = path + INPROGRESS_SUFFIX
        with open(temporary, "wb") as fh:
            fh.write(data)
        os.replace(temporary, path)

    def delete(self, path: str, options: StorageOptions) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


register_backend(LocalBackend())
