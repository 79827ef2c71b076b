"""The decompressed bytes of one input file, or an error: never a silently short stream.

:func:`open_stream` is the only way the readers get at a ``jsonl`` / ``text`` file's bytes.
Whatever the codec, the stream either delivers every byte the file encodes or raises when
it reaches the damage, *after* handing out every byte decoded before it. The readers turn
that error into one ``unreadable_file`` rejection (:mod:`beam_jobs.readers`).

Codec checks::

    none   nothing to check (a cut after a newline leaves a valid, shorter file)
    gzip   Python's gzip: EOFError when a member ends early, BadGzipFile on a bad CRC,
           length or trailing bytes that are not a member
    zstd   ZstdFramesReader: EOFError when the data ends inside a frame, ZstdError on a
           corrupt block or a content checksum mismatch

A cut exactly between two complete gzip members or zstd frames is a valid file with fewer
members: no reader can tell it from an intact one.

Cut or corrupt: gzip and zstd check a member's / frame's checksum only at its end, after
handing out what it decoded, so a bit flip can alter records that come out before the
error. :func:`find_corruption` therefore decodes a compressed file once, discarding the
bytes, before its records are parsed: a corrupt stream keeps nothing (which records before
the damage are intact cannot be told), while a stream that merely ends early keeps the
records before the cut (a cut does not change the bytes before it). Cost: one more
decompression and read of each compressed input.
"""

from __future__ import annotations

import contextlib
import gzip
import io
from typing import BinaryIO, Iterator, Optional

from beam_jobs import job_files
from beam_jobs.inputs import InputFile
from loader.io.storage_options import StorageOptions

STREAM_BUFFER_BYTES = 1 << 20
PARQUET_MAGIC = b"PAR1"


class ZstdFramesReader(io.RawIOBase):
    """The decompressed bytes of concatenated zstd frames; ``EOFError`` if the data ends inside one.

    zstandard's ``stream_reader`` returns a short read with no error when its input ends
    inside a frame (at a block boundary nothing at all is reported), so frames are decoded
    here one ``decompressobj`` at a time: a frame object that has not reached its end when
    the input runs out means the file was cut. Bytes decoded before the cut are returned
    first; the error comes with the read after them.
    """

    INPUT_CHUNK_BYTES = 1 << 15  # compressed bytes fed per step: bounds one step's output
    OUTPUT_WRITE_BYTES = 1 << 20  # zstandard's output buffer per decompress call

    def __init__(self, compressed: BinaryIO):
        import zstandard

        super().__init__()
        self._compressed = compressed
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressobj of the frame being decoded; None between frames
        self._frames_done = 0
        self._compressed_bytes = 0
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            if not self._decode_next_chunk():
                return 0
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def discard_all(self) -> None:
        """Decode the rest of the data without keeping it (an integrity check); raises like ``read``."""
        self._pending = memoryview(b"")
        while self._decode_next_chunk():
            self._pending = memoryview(b"")

    def _decode_next_chunk(self) -> bool:
        """Decode the next chunk of input into ``_pending``; False at a clean end of the data."""
        data = self._compressed.read(self.INPUT_CHUNK_BYTES)
        if not data:
            if self._frame is not None:
                raise EOFError(
                    f"zstd data ends inside frame {self._frames_done} after {self._compressed_bytes} "
                    "compressed bytes: the file is truncated")
            return False
        self._compressed_bytes += len(data)
        decoded = []
        while data:
            if self._frame is None:
                self._frame = self._decompressor.decompressobj(write_size=self.OUTPUT_WRITE_BYTES)
            decoded.append(self._frame.decompress(data))
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the start of the next frame, if any
            self._frame = None
            self._frames_done += 1
        self._pending = memoryview(b"".join(decoded))
        return True


@contextlib.contextmanager
def open_stream(input_file: InputFile, storage_options: StorageOptions) -> Iterator[BinaryIO]:
    """A buffered binary stream of the file's decompressed bytes (:func:`beam_jobs.job_files.open_read`)."""
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(job_files.open_read(input_file.path, storage_options))
        # Decompress here rather than through Beam's CompressedFile: the C stream readers
        # are much faster at line iteration, and behave the same on every filesystem.
        if input_file.compression == "gzip":
            stream = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
        elif input_file.compression == "zstd":
            stream = stack.enter_context(ZstdFramesReader(raw))
        else:
            yield raw
            return
        yield stack.enter_context(io.BufferedReader(stream, buffer_size=STREAM_BUFFER_BYTES))


def find_corruption(input_file: InputFile, storage_options: StorageOptions) -> Optional[Exception]:
    """The error of a compressed file whose data is corrupt (not just cut short), else None."""
    if input_file.compression == "none":
        return None
    try:
        with job_files.open_read(input_file.path, storage_options) as raw:
            if input_file.compression == "zstd":
                ZstdFramesReader(raw).discard_all()
            else:
                with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                    while stream.read(STREAM_BUFFER_BYTES):
                        pass
    except EOFError:  # ends early: the reader keeps the records before the cut
        return None
    except Exception as exc:  # noqa: BLE001 - any decoding or I/O error makes the file unreadable
        return exc
    return None


def check_parquet_magic(handle: BinaryIO) -> None:
    """Raise ``ValueError`` unless the file starts with ``PAR1`` (pyarrow checks only the end)."""
    head = handle.read(len(PARQUET_MAGIC))
    handle.seek(0)
    if head != PARQUET_MAGIC:
        raise ValueError(f"the file starts with {head!r}, not the Parquet magic {PARQUET_MAGIC!r}: "
                         "its header is damaged or it is not a Parquet file")
