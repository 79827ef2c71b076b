"""Reading input files into documents and rejections (the ``ReadFiles`` step).

One :class:`ReadDocumentsFn` call reads one whole input file, so reading is parallel across
files. Every record becomes exactly one of

* a document, ``(key, text, text_nbytes, kept_values)`` on the main output, or
* a rejection, ``(file_index, input_path, record_index, reason, detail, excerpt)`` on
  :data:`REJECTED_TAG`, with ``reason`` one of :data:`loader.manifest.REJECT_REASONS`.

Both are plain tuples on purpose: Beam's fast coder handles tuples of str/int/bytes/None
natively and would fall back to pickling for a dataclass.

Records by format
-----------------
* ``jsonl``: one JSON object per line, read line by line (plain, gzip or zstd). Lines are
  decoded as strict UTF-8 here, not by a text wrapper, so one bad line is one
  ``invalid_utf8`` rejection instead of a failed file. The record index is the 0-based line
  number; lines holding only whitespace are not records (skipped, not rejected).
* ``parquet``: one row per record, read in batches of rows; the record index is the row
  number in the file. ``string`` and ``binary`` text columns are checked for UTF-8 per value.
* ``text``: the whole file is one document (record index 0). Use JSONL for one document
  per line.

A document's text is *empty* when ``text.strip() == ""`` (Python's Unicode whitespace).
A ``--keep-fields`` value that is missing or null is stored as a Parquet null, any other
value as its JSON encoding. An ``--id-field`` value that is a string is the key as is, an
integer is its decimal form, anything else its compact JSON; missing or null is rejected.

A file that cannot be opened or decoded part-way (corrupt gzip, truncated Parquet) yields
the documents read before the failure plus one ``unreadable_file`` rejection that carries
the error: the job cannot know how many records the rest held, so it counts as one.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator, Optional, Union

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.metrics import Metrics

from beam_jobs.inputs import InputFile

logger = logging.getLogger(__name__)

REJECTED_TAG = "rejected"
EXCERPT_CHARS = 200  # raw characters kept in a rejection's excerpt
PARQUET_BATCH_ROWS = 1024

Document = tuple  # (key: str, text: str, text_nbytes: int, kept_values: tuple[str | None, ...])
Rejection = tuple  # (file_index, input_path, record_index, reason, detail, excerpt)


@dataclass(frozen=True)
class RecordSpec:
    """Which fields of a record the job uses (``--text-field``, ``--id-field``, ``--keep-fields``)."""

    text_field: str = "text"
    id_field: Optional[str] = None
    keep_fields: tuple[str, ...] = ()


class _InvalidUtf8:
    """Stands in for a Parquet value whose bytes are not UTF-8."""

    def __init__(self, raw: bytes, error: UnicodeDecodeError):
        self.raw = raw
        self.detail = f"byte {error.start}: {error.reason}"


class _ReadFailure:
    """Marks the point where reading a file failed (the rest of the file is lost)."""

    def __init__(self, error: BaseException):
        self.error = error


def _guarded(items: Iterable) -> Iterator:
    """Yield from ``items``; on a read error yield one :class:`_ReadFailure` and stop.

    Only the iteration (I/O, decompression, decoding of the file) is guarded, so a bug in
    the record handling still fails loudly instead of becoming a rejection.
    """
    try:
        iterator = iter(items)
    except Exception as exc:  # opening the file failed
        yield _ReadFailure(exc)
        return
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except Exception as exc:
            yield _ReadFailure(exc)
            return
        yield item


def excerpt_of(raw: Union[bytes, str]) -> str:
    if isinstance(raw, bytes):
        raw = raw[: EXCERPT_CHARS * 4].decode("utf-8", "backslashreplace")
    return raw[:EXCERPT_CHARS]


def key_of_id(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _json_type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _encode_kept(value: Any) -> Optional[str]:
    if value is None:
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _utf8_problem(value: str) -> Optional[str]:
    """Why ``value`` cannot be written as UTF-8 (a lone surrogate from a ``\\udXXX`` escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"character {exc.start}: {exc.reason} (a lone surrogate escape such as \\ud800)"
    return None


class RecordConverter:
    """Turns one parsed record (a dict of field values) into a document or a rejection reason."""

    def __init__(self, spec: RecordSpec, input_file: InputFile):
        self.spec = spec
        self.input_file = input_file

    def reject(self, record_index: int, reason: str, detail: str, raw: Union[bytes, str]) -> Rejection:
        return (
            self.input_file.file_index,
            self.input_file.path,
            record_index,
            reason,
            detail,
            excerpt_of(raw),
        )

    def convert(self, record: dict, record_index: int, raw: Union[bytes, str]) -> tuple[bool, tuple]:
        """``(True, document)`` or ``(False, rejection)``."""
        spec = self.spec
        if spec.text_field not in record:
            return False, self.reject(record_index, "missing_text_field",
                                      f"no field {spec.text_field!r} (set --text-field)", raw)
        text = record[spec.text_field]
        if isinstance(text, _InvalidUtf8):
            return False, self.reject(record_index, "invalid_utf8",
                                      f"field {spec.text_field!r}: {text.detail}", text.raw)
        if not isinstance(text, str):
            return False, self.reject(record_index, "non_string_text",
                                      f"field {spec.text_field!r} is {_json_type_name(text)}, not a string", raw)
        if not text.strip():
            return False, self.reject(record_index, "empty_text",
                                      f"field {spec.text_field!r} is empty or whitespace only", raw)
        if spec.id_field is not None:
            id_value = record.get(spec.id_field)
            if id_value is None:
                return False, self.reject(record_index, "missing_id_field",
                                          f"no value for --id-field {spec.id_field!r}", raw)
            if isinstance(id_value, _InvalidUtf8):
                return False, self.reject(record_index, "invalid_utf8",
                                          f"field {spec.id_field!r}: {id_value.detail}", id_value.raw)
            key = key_of_id(id_value)
        else:
            key = f"{self.input_file.relative_path}#{record_index}"
        kept = []
        for name in spec.keep_fields:
            value = record.get(name)
            if isinstance(value, _InvalidUtf8):
                return False, self.reject(record_index, "invalid_utf8", f"field {name!r}: {value.detail}", value.raw)
            kept.append(_encode_kept(value))
        try:
            text_nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            text_nbytes = -1
        for name, value in ((spec.text_field, text if text_nbytes < 0 else None),
                            (spec.id_field or "key", key), *zip(spec.keep_fields, kept)):
            problem = value is not None and _utf8_problem(value)
            if problem:
                return False, self.reject(record_index, "invalid_utf8", f"field {name!r}: {problem}", raw)
        return True, (key, text, text_nbytes, tuple(kept))


# ---------------------------------------------------------------------------------------
# Per-format readers. Each yields (ok, element) pairs.


@contextlib.contextmanager
def _open_stream(input_file: InputFile) -> Iterator[BinaryIO]:
    """A buffered binary stream of the file's decompressed bytes (via Beam's FileSystems)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(
            FileSystems.open(input_file.path, compression_type=CompressionTypes.UNCOMPRESSED))
        # Decompress here rather than through Beam's CompressedFile: the C stream readers
        # are much faster at line iteration, and behave the same on every filesystem.
        if input_file.compression == "gzip":
            stream = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
        elif input_file.compression == "zstd":
            import zstandard

            stream = stack.enter_context(
                zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        else:
            yield raw
            return
        yield stack.enter_context(io.BufferedReader(stream, buffer_size=1 << 20))


def _read_jsonl(input_file: InputFile, converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    def lines() -> Iterator[bytes]:
        with _open_stream(input_file) as stream:
            yield from stream

    record_index = -1
    for item in _guarded(lines()):
        if isinstance(item, _ReadFailure):
            yield False, _unreadable(converter, record_index + 1, item.error)
            return
        record_index += 1
        raw_line = item.rstrip(b"\n").rstrip(b"\r")
        if not raw_line.strip():
            continue
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield False, converter.reject(record_index, "invalid_utf8", f"byte {exc.start}: {exc.reason}", raw_line)
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            yield False, converter.reject(record_index, "malformed_json", str(exc), raw_line)
            continue
        if not isinstance(record, dict):
            yield False, converter.reject(
                record_index, "malformed_json",
                f"a JSONL record must be a JSON object (got {type(record).__name__})", raw_line)
            continue
        yield converter.convert(record, record_index, raw_line)


def _utf8_values(column) -> list:
    """Python values of a string/binary Arrow column; bad UTF-8 becomes :class:`_InvalidUtf8`."""
    import pyarrow as pa

    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            column.validate(full=True)  # checks UTF-8 of the whole batch at C speed
            return column.to_pylist()
        except pa.ArrowInvalid:
            column = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    values = []
    for raw in column.to_pylist():
        if raw is None:
            values.append(None)
            continue
        try:
            values.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            values.append(_InvalidUtf8(raw, exc))
    return values


def _read_parquet(input_file: InputFile, spec: RecordSpec,
                  converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    wanted = [spec.text_field, *([spec.id_field] if spec.id_field else []), *spec.keep_fields]

    def batches():
        with FileSystems.open(input_file.path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
            parquet_file = pq.ParquetFile(handle)
            present = [n for n in dict.fromkeys(wanted) if n in parquet_file.schema_arrow.names]
            for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=present):
                yield batch

    record_index = 0
    for batch in _guarded(batches()):
        if isinstance(batch, _ReadFailure):
            yield False, _unreadable(converter, record_index, batch.error)
            return
        columns = {}
        for name in batch.schema.names:
            column = batch.column(name)
            textual = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            binary_text = name == spec.text_field and (
                pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type))
            columns[name] = _utf8_values(column) if textual or binary_text else column.to_pylist()
        for row in range(batch.num_rows):
            record = {name: values[row] for name, values in columns.items()}
            # Parquet has no "absent" value: a null text is reported like a JSON null.
            yield converter.convert(record, record_index, _row_excerpt(record))
            record_index += 1


def _row_excerpt(record: dict) -> str:
    shown = {k: (v.raw if isinstance(v, _InvalidUtf8) else v) for k, v in record.items()}
    return json.dumps(shown, ensure_ascii=False, default=str)[:EXCERPT_CHARS]


def _read_text(input_file: InputFile, converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    def whole_file() -> Iterator[bytes]:
        with _open_stream(input_file) as stream:
            yield stream.read()

    for data in _guarded(whole_file()):
        if isinstance(data, _ReadFailure):
            yield False, _unreadable(converter, 0, data.error)
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield False, converter.reject(0, "invalid_utf8", f"byte {exc.start}: {exc.reason}", data)
            return
        yield converter.convert({converter.spec.text_field: text}, 0, data)


def _unreadable(converter: RecordConverter, record_index: int, error: BaseException) -> Rejection:
    logger.warning("input file %s is unreadable after %d records: %s: %s",
                   converter.input_file.path, record_index, type(error).__name__, error)
    return converter.reject(record_index, "unreadable_file",
                            f"{type(error).__name__}: {error}"[:1000], b"")


def read_records(input_file: InputFile, spec: RecordSpec) -> Iterator[tuple[bool, tuple]]:
    """Every record of one file as ``(True, document)`` or ``(False, rejection)``."""
    converter = RecordConverter(spec, input_file)
    if input_file.format == "jsonl":
        return _read_jsonl(input_file, converter)
    if input_file.format == "parquet":
        return _read_parquet(input_file, spec, converter)
    if input_file.format == "text":
        return _read_text(input_file, converter)
    raise ValueError(f"unknown input format {input_file.format!r} for {input_file.path}")


class ReadDocumentsFn(beam.DoFn):
    """Input file tuple -> documents (main output) and rejections (:data:`REJECTED_TAG`)."""

    def __init__(self, spec: RecordSpec):
        self.spec = spec
        self.documents_counter = Metrics.counter("zephon.shard", "documents_read")
        self.rejected_counter = Metrics.counter("zephon.shard", "records_rejected")
        self.files_counter = Metrics.counter("zephon.shard", "files_read")

    def process(self, file_tuple: tuple) -> Iterator:
        input_file = InputFile.from_tuple(file_tuple)
        documents = rejected = 0
        for ok, element in read_records(input_file, self.spec):
            if ok:
                documents += 1
                yield element
            else:
                rejected += 1
                yield pvalue.TaggedOutput(REJECTED_TAG, element)
        # Counted once per file: a per-element counter update costs more than the parse.
        self.documents_counter.inc(documents)
        self.rejected_counter.inc(rejected)
        self.files_counter.inc()
