"""Every file the sharding job reads, lists, writes or deletes, on any storage backend.

One rule decides who moves the bytes of a path: the loader's storage backend registered for
its scheme (:func:`loader.io.backends.backend_for`, so an unsupported scheme is refused the
same way in the job and in the loader). A backend with ``beam_filesystem`` (local paths,
``gs://``) is left to Beam's ``FileSystems``, as the job has always done (Dataflow's own
gcsio; local writes by the ``.inprogress`` + rename pattern of FIELD-NOTES). The others
(``s3://``) go through the backend itself: reads pinned to the version seen at open, writes
as one atomic PUT, errors that name the object and the fix, one retry budget.

How the job reaches a remote backend is a :class:`~loader.io.storage_options.StorageOptions`
that every function here takes: the job's ``--s3-*`` and ``--storage-*`` flags
(:func:`add_storage_arguments`), else the client library's own lookup (for S3: ``AWS_*``
variables, profiles, ``AWS_ENDPOINT_URL``). It is an argument, never a module global, so
each step that does I/O carries it in its constructor arguments and a worker process of any
runner (Dataflow, ``multi_processing``) unpickles the options the job was launched with.
"""

from __future__ import annotations

import io
import re
from typing import BinaryIO

from apache_beam.io.filesystem import CompressionTypes, FileSystem
from apache_beam.io.filesystems import FileSystems

from loader.io import storage
from loader.io.backends import backend_for
from loader.io.storage_options import StorageOptions

INPROGRESS_SUFFIX = ".inprogress"
READ_BUFFER_BYTES = 1024**2  # line iteration over a ranged reader: one request per window, not per line


def uses_beam_filesystem(path: str) -> bool:
    """True when Beam's FileSystems move ``path``'s bytes (local, ``gs://``); refuses unsupported schemes."""
    return backend_for(path).beam_filesystem


def open_read(path: str, storage_options: StorageOptions) -> BinaryIO:
    """A binary stream of the file's stored (still compressed) bytes, seekable."""
    if uses_beam_filesystem(path):
        return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    return io.BufferedReader(storage.open_input(path, storage_options), buffer_size=READ_BUFFER_BYTES)


def _static_prefix(pattern: str) -> str:
    match = re.search(r"[*?\[]", pattern)
    return pattern if match is None else pattern[: match.start()]


def match(pattern: str, storage_options: StorageOptions) -> dict[str, int]:
    """``{path: size}`` of every file ``pattern`` matches (``*`` within a directory, ``**`` across)."""
    if uses_beam_filesystem(pattern):
        (result,) = FileSystems.match([pattern])
        return {m.path: m.size_in_bytes for m in result.metadata_list}
    regex = re.compile(FileSystem.translate_pattern(pattern))  # Beam's glob syntax: every scheme matches alike
    listed = backend_for(pattern).list_objects(_static_prefix(pattern), storage_options)
    return {obj.url: obj.size for obj in listed if regex.fullmatch(obj.url)}


def write_atomically(path: str, data: bytes, storage_options: StorageOptions) -> None:
    """``data`` under ``path``, never visible half-written.

    Beam's filesystems: ``path + '.inprogress'``, then a rename; a retried bundle rewrites
    the same names, so retries overwrite instead of duplicating. Other backends: their own
    atomic write (one S3 PUT: the object appears whole or not at all).
    """
    if not uses_beam_filesystem(path):
        storage.write_atomically(path, data, storage_options)
        return
    temporary = path + INPROGRESS_SUFFIX
    handle = FileSystems.create(temporary, compression_type=CompressionTypes.UNCOMPRESSED)
    try:
        handle.write(data)
    finally:
        handle.close()
    FileSystems.rename([temporary], [path])


def delete(path: str, storage_options: StorageOptions) -> None:
    if uses_beam_filesystem(path):
        FileSystems.delete([path])
        return
    backend_for(path).delete(path, storage_options)
