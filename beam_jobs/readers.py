"""Reading input files into documents and rejections (the ``ReadFiles`` step).

One :class:`ReadDocumentsFn` call reads one whole input file, so reading is parallel across
files. Every record becomes exactly one of

* a document, ``(key, text, text_nbytes, kept_values)`` on the main output (a chat record,
  with ``--messages-field``, adds ``(input_ids bytes, loss_mask bytes)``: see
  :mod:`beam_jobs.chat_records`), or
* a rejection, ``(file_index, input_path, record_index, reason, detail, excerpt)`` on
  :data:`REJECTED_TAG`, with ``reason`` one of :data:`loader.io.manifest.REJECT_REASONS`.

Both are plain tuples on purpose: Beam's fast coder handles tuples of str/int/bytes/None
natively and would fall back to pickling for a dataclass.

Records by format
-----------------
* ``jsonl``: one JSON object per line, read line by line (plain, gzip or zstd). Lines are
  decoded as strict UTF-8 here, not by a text wrapper, so one bad line is one
  ``invalid_utf8`` rejection instead of a failed file. The record index is the 0-based line
  number; lines holding only whitespace are not records (skipped, not rejected). A line
  ends at ``\\n``; a ``\\r`` before it is dropped (CRLF files). A record nested deeper than
  :data:`MAX_JSON_DEPTH` arrays/objects is ``malformed_json`` (checked before parsing, so
  the outcome never depends on the interpreter's stack depth).
* ``parquet``: one row per record, read row group by row group in batches of rows; the
  record index is the row number in the file. ``string`` and ``binary`` text columns are
  checked for UTF-8 per value.
* ``text``: the whole file is one document (record index 0). Use JSONL for one document
  per line.
* ``webdataset``: image jobs only, one sample per record (:mod:`beam_jobs.webdataset`); an
  image job's JSONL/Parquet records are read as above and converted by
  :mod:`beam_jobs.image_records`, whose documents add ``(segments, images)``.

A UTF-8 byte-order mark at the very start of a ``jsonl`` or ``text`` file (after
decompression) is dropped; anywhere else it is data.

Unreadable files (one validation layer for every format)
--------------------------------------------------------
A file that cannot be opened or decoded part-way yields the records decoded before the
failure plus one ``unreadable_file`` rejection whose record index is the first record not
read and whose detail carries the error: the job cannot know how many records the rest
held, so it counts as one. "Decoded before the failure" is the same rule for every codec: a
record is kept only if all its bytes came out of the decoder intact, so the record cut in
half is never a document. The checks:

* gzip and zstd streams never end silently early (:mod:`beam_jobs.input_streams`); a
  compressed file whose data is corrupt rather than cut (a checksum, CRC or block error)
  is decoded once before parsing and keeps nothing, because those codecs check their
  checksum only after handing out the bytes, so the records before the damage may be
  altered;
* jsonl, any codec: a last line without ``\\n`` that is not whole JSON or UTF-8 means the
  file ends inside a record;
* parquet: the ``PAR1`` magic at the start (pyarrow checks only the end), a readable
  footer, page CRCs where the writer stored them, and the rows of every row group against
  the footer's count (a damaged page header can make a row group decode as zero rows).

A cut exactly between two gzip members or zstd frames, or right after a ``\\n`` of an
uncompressed file, leaves a valid, shorter file that no reader can tell from an intact one.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Union

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.metrics import Metrics

from beam_jobs import job_files, progress
from beam_jobs.chat_records import ChatEncoder, ChatSpec, InvalidUtf8Record
from beam_jobs.input_streams import check_parquet_magic, find_corruption, open_stream
from beam_jobs.inputs import InputFile
from beam_jobs.outputs import ShardJobError
from loader.io.storage_options import StorageError

logger = logging.getLogger(__name__)

REJECTED_TAG = "rejected"
EXCERPT_CHARS = 200  # raw characters kept in a rejection's excerpt
PARQUET_BATCH_ROWS = 1024
UTF8_BOM = codecs.BOM_UTF8
# Deeper JSON is a malformed_json rejection. Python's parser recurses once per level against
# the interpreter's recursion limit (1000 by default) shared with the caller's stack, so an
# explicit limit well below it makes the outcome the same on every runner; real records
# nest a few levels.
MAX_JSON_DEPTH = 256

Document = tuple  # (key: str, text: str, text_nbytes: int, kept_values: tuple[str | None, ...])
Rejection = tuple  # (file_index, input_path, record_index, reason, detail, excerpt)


@dataclass(frozen=True)
class RecordSpec:
    """Which fields of a record the job uses (``--text-field``, ``--id-field``, ``--keep-fields``)."""

    text_field: str = "text"
    id_field: Optional[str] = None
    keep_fields: tuple[str, ...] = ()
    chat: Optional[ChatSpec] = None  # --messages-field: records are conversations (beam_jobs.chat_records)
    images: Optional[Any] = None  # an image job: beam_jobs.image_records.ImageSpec

    @property
    def content_fields(self) -> tuple[str, ...]:
        """The fields a document's content comes from: the text (and images), or the conversation's."""
        if self.chat is not None:
            return self.chat.record_fields
        if self.images is not None and self.images.image_field is not None:
            return (self.text_field, self.images.image_field)
        return (self.text_field,)


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
    the record handling still fails loudly instead of becoming a rejection. A
    :class:`StorageError` (the store failed past its retry budget, or the object changed
    while being read) fails the job instead: the file's records are not bad, and rejecting
    them would lose them.
    """
    try:
        iterator = iter(items)
    except StorageError as exc:
        raise ShardJobError(str(exc)) from exc
    except Exception as exc:  # opening the file failed
        yield _ReadFailure(exc)
        return
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except StorageError as exc:
            raise ShardJobError(str(exc)) from exc
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

    def __init__(self, spec: RecordSpec, input_file: InputFile, chat_encoder: Optional[ChatEncoder] = None):
        if (spec.chat is None) != (chat_encoder is None):
            raise ValueError("a chat RecordSpec needs its loaded ChatEncoder, and only it")
        self.spec = spec
        self.input_file = input_file
        self.chat_encoder = chat_encoder

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
        """``(True, document)`` or ``(False, rejection)``.

        A chat document carries a fifth element, ``(input_ids bytes, loss_mask bytes)``.
        """
        spec = self.spec
        if self.chat_encoder is not None:
            return self._convert_chat(record, record_index, raw)
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
        return self._document(record, record_index, raw, text)

    def _convert_chat(self, record: dict, record_index: int, raw: Union[bytes, str]) -> tuple[bool, tuple]:
        from loader.chat import ConversationRejected

        try:
            text, encoded = self.chat_encoder.encode(record)
        except ConversationRejected as exc:
            return False, self.reject(record_index, exc.reason, exc.detail, raw)
        except InvalidUtf8Record as exc:
            return False, self.reject(record_index, "invalid_utf8", str(exc), raw)
        return self._document(record, record_index, raw, text, encoded)

    def _document(self, record: dict, record_index: int, raw: Union[bytes, str], text: str,
                  encoded: Optional[tuple] = None) -> tuple[bool, tuple]:
        """The document of a record whose content is ``text`` (id, kept fields and UTF-8 checked)."""
        spec = self.spec
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
        if encoded is not None:
            return True, (key, text, text_nbytes, tuple(kept), encoded)
        return True, (key, text, text_nbytes, tuple(kept))


# ---------------------------------------------------------------------------------------
# Per-format readers. Each yields (ok, element) pairs.


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal (unrolled loop)
_JSON_DECODER = json.JSONDecoder()


def json_nesting_depth(line: str) -> int:
    """How many arrays/objects deep ``line`` nests, ignoring brackets inside strings."""
    import numpy as np

    structure = _JSON_STRING.sub("", line).encode("utf-8", "surrogatepass")
    codes = np.frombuffer(structure, dtype=np.uint8)
    steps = np.isin(codes, (0x5B, 0x7B)).astype(np.int64) - np.isin(codes, (0x5D, 0x7D))
    return int(np.cumsum(steps).max(initial=0))


class LineRejection(NamedTuple):
    """Why a JSONL line is not a record; ``incomplete`` when its bytes are not whole JSON text."""

    reason: str
    detail: str
    incomplete: bool


def parse_jsonl_line(raw_line: bytes) -> Union[dict, LineRejection]:
    """The record on one JSONL line (without its newline), or why it is rejected."""
    try:
        line = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LineRejection("invalid_utf8", f"byte {exc.start}: {exc.reason}", True)
    # Cheap bound first (two C-speed counts); only a line with many brackets is scanned.
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH:
        depth = json_nesting_depth(line)
        if depth > MAX_JSON_DEPTH:
            return LineRejection("malformed_json", f"nested {depth} arrays/objects deep, more than the "
                                 f"limit of {MAX_JSON_DEPTH}", False)
    try:
        record = _JSON_DECODER.decode(line)
    except RecursionError:  # only reachable when the caller's stack is already very deep
        return LineRejection("malformed_json", f"nested too deeply for the JSON parser (limit {MAX_JSON_DEPTH})", False)
    except ValueError as exc:
        return LineRejection("malformed_json", str(exc), True)
    if not isinstance(record, dict):
        return LineRejection("malformed_json",
                             f"a JSONL record must be a JSON object (got {_json_type_name(record)})", False)
    return record


def _read_jsonl(input_file: InputFile, converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    def lines() -> Iterator[bytes]:
        with open_stream(input_file) as stream:
            yield from stream

    corrupt = _corrupt_stream_rejection(input_file, converter)
    if corrupt is not None:
        yield False, corrupt
        return
    record_index = -1
    for item in _guarded(lines()):
        if isinstance(item, _ReadFailure):
            yield False, _unreadable(converter, record_index + 1, item.error)
            return
        record_index += 1
        # Only the file's last line can lack its newline (a stream hands out whole lines).
        terminated = item.endswith(b"\n")
        raw_line = item.rstrip(b"\n").rstrip(b"\r")
        if record_index == 0 and raw_line.startswith(UTF8_BOM):
            raw_line = raw_line[len(UTF8_BOM):]
        if not raw_line.strip():
            continue
        parsed = parse_jsonl_line(raw_line)
        if isinstance(parsed, dict):
            yield converter.convert(parsed, record_index, raw_line)
            continue
        if not terminated and parsed.incomplete:
            # The file ends inside a record: it was cut, not written that way.
            yield False, _unreadable(converter, record_index, EOFError(
                f"the file ends inside record {record_index} (its last line has no newline and is not "
                f"whole JSON: {parsed.detail}): the file is truncated"), raw_line)
            return
        yield False, converter.reject(record_index, parsed.reason, parsed.detail, raw_line)


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
    wanted = [*spec.content_fields, *([spec.id_field] if spec.id_field else []), *spec.keep_fields]

    def batches():
        with job_files.open_read(input_file.path) as handle:
            check_parquet_magic(handle)
            parquet_file = pq.ParquetFile(handle, page_checksum_verification=True)
            present = [n for n in dict.fromkeys(wanted) if n in parquet_file.schema_arrow.names]
            for group in range(parquet_file.num_row_groups):
                promised = parquet_file.metadata.row_group(group).num_rows
                rows = 0
                for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group],
                                                       columns=present):
                    rows += batch.num_rows
                    yield batch
                if rows != promised:
                    raise ValueError(f"row group {group} decoded as {rows} rows but the footer promises "
                                     f"{promised}: a page is damaged")

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
        with open_stream(input_file) as stream:
            yield stream.read()

    corrupt = _corrupt_stream_rejection(input_file, converter)
    if corrupt is not None:
        yield False, corrupt
        return
    for data in _guarded(whole_file()):
        if isinstance(data, _ReadFailure):
            yield False, _unreadable(converter, 0, data.error)
            return
        if data.startswith(UTF8_BOM):
            data = data[len(UTF8_BOM):]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield False, converter.reject(0, "invalid_utf8", f"byte {exc.start}: {exc.reason}", data)
            return
        yield converter.convert({converter.spec.text_field: text}, 0, data)


def _corrupt_stream_rejection(input_file: InputFile, converter: RecordConverter) -> Optional[Rejection]:
    """The rejection of a compressed file whose data is corrupt: nothing of it is kept."""
    error = find_corruption(input_file)
    if error is None:
        return None
    return _unreadable(converter, 0, error, note=(
        " (nothing of the file is kept: its codec checks a checksum only at the end, so which "
        "records before the damage are intact cannot be told)"))


def _unreadable(converter: RecordConverter, record_index: int, error: BaseException,
                raw: Union[bytes, str] = b"", note: str = "") -> Rejection:
    """The one rejection of a file that cannot be read from ``record_index`` on."""
    detail = f"{type(error).__name__}: {error}"[:1000] + note
    logger.warning("input file %s is unreadable from record %d on: %s",
                   converter.input_file.path, record_index, detail)
    return converter.reject(record_index, "unreadable_file", detail, raw)


def read_records(input_file: InputFile, spec: RecordSpec,
                 chat_encoder: Optional[ChatEncoder] = None) -> Iterator[tuple[bool, tuple]]:
    """Every record of one file as ``(True, document)`` or ``(False, rejection)``."""
    if spec.images is not None:  # image documents: beam_jobs.image_records, beam_jobs.webdataset
        from beam_jobs.image_records import ImageRecordConverter

        if spec.chat is not None:  # conversations with image parts: beam_jobs.chat_image_records
            from beam_jobs.chat_image_records import ChatImageRecordConverter as ImageRecordConverter
        converter = ImageRecordConverter(spec, input_file, chat_encoder)
        if input_file.format == "webdataset":
            from beam_jobs.webdataset import read_webdataset

            return read_webdataset(input_file, converter)
    else:
        converter = RecordConverter(spec, input_file, chat_encoder)
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
        self.chat_encoder: Optional[ChatEncoder] = None

    def setup(self) -> None:
        if self.spec.chat is not None:
            self.chat_encoder = ChatEncoder.load(self.spec.chat)

    def process(self, file_tuple: tuple) -> Iterator:
        input_file = InputFile.from_tuple(file_tuple)
        documents = rejected = 0
        for ok, element in read_records(input_file, self.spec, self.chat_encoder):
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
        progress.stage("ReadFiles").add(files=1, documents=documents, rejected=rejected)  # beam_jobs.progress
