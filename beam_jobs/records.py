"""A record and its converter: what every input format's reader and every kind's converter build on.

A format's reader (:mod:`beam_jobs.formats`) turns one input file into parsed records, a
kind's converter turns each record into a document or a rejection (:class:`RecordConverter`
for text and chat records; :mod:`beam_jobs.image_records` and
:mod:`beam_jobs.chat_image_records` for records with images). Both register here, by name, and
:func:`beam_jobs.readers.read_records` looks them up: a new input format or kind of record is
a new module that registers itself. The document and rejection tuples, and the rules for a
file that cannot be read to its end, are described in :mod:`beam_jobs.readers`.
"""

from __future__ import annotations

import codecs
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from beam_jobs.chat_records import ChatEncoder, ChatSpec, InvalidUtf8Record
from beam_jobs.input_streams import find_corruption
from beam_jobs.inputs import InputFile
from loader.chat.conversations import ConversationRejected
from loader.errors import ShardJobError, StorageError
from loader.io.storage_options import StorageOptions

logger = logging.getLogger(__name__)

EXCERPT_CHARS = 200  # raw characters kept in a rejection's excerpt
UTF8_BOM = codecs.BOM_UTF8

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
    storage: StorageOptions = StorageOptions()  # how input files (and named images) are read: --s3-*, --storage-*
    kind: Optional[str] = None  # --kind: the named lane kind whose registered converter reads the records

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


def _corrupt_stream_rejection(input_file: InputFile, converter: RecordConverter) -> Optional[Rejection]:
    """The rejection of a compressed file whose data is corrupt: nothing of it is kept."""
    error = find_corruption(input_file, converter.spec.storage)
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


# -- the registries ------------------------------------------------------------------------
# A format's reader: one input file, read with a kind's converter, as (ok, element) pairs.
FormatReader = Callable[[InputFile, RecordConverter], Iterator[tuple[bool, tuple]]]
TEXT_RECORDS = "text"  # plain-text and chat records: RecordConverter itself
IMAGE_RECORDS = "image"  # records with images (--image-field, WebDataset)
IMAGE_CHAT_RECORDS = "image-chat"  # conversations with image parts

_FORMATS: dict[str, tuple[FormatReader, bool]] = {}
_CONVERTERS: dict[str, type[RecordConverter]] = {TEXT_RECORDS: RecordConverter}


def register_format(name: str, *, images_only: bool = False) -> Callable[[FormatReader], FormatReader]:
    """Register ``reader`` as the reader of input format ``name`` (``images_only``: of image jobs only)."""
    def register(reader: FormatReader) -> FormatReader:
        if name in _FORMATS:
            raise ValueError(f"input format {name!r} is registered twice ({_FORMATS[name][0].__module__}, {reader.__module__})")
        _FORMATS[name] = (reader, images_only)
        return reader
    return register


def register_converter(kind: str) -> Callable[[type], type]:
    """Register a :class:`RecordConverter` subclass as the converter of records of ``kind``."""
    def register(converter: type) -> type:
        if kind in _CONVERTERS:
            raise ValueError(f"record kind {kind!r} is registered twice ({_CONVERTERS[kind].__module__}, {converter.__module__})")
        _CONVERTERS[kind] = converter
        return converter
    return register


def record_kind(spec: RecordSpec) -> str:
    """Which converter reads the records of ``spec``: a named lane kind's (``--kind``), else
    :data:`IMAGE_CHAT_RECORDS`, :data:`IMAGE_RECORDS` or :data:`TEXT_RECORDS`."""
    if spec.kind is not None:
        return spec.kind
    if spec.images is not None:
        return IMAGE_CHAT_RECORDS if spec.chat is not None else IMAGE_RECORDS
    return TEXT_RECORDS


def registered_converters() -> tuple[str, ...]:
    """The record kinds that have a converter (a named lane kind registers its own)."""
    return tuple(_CONVERTERS)


def converter_for(spec: RecordSpec, input_file: InputFile,
                  chat_encoder: Optional[ChatEncoder] = None) -> RecordConverter:
    """The converter of ``input_file``'s records under ``spec``."""
    kind = record_kind(spec)
    if kind not in _CONVERTERS:
        raise ValueError(f"no converter is registered for {kind} records (registered: {', '.join(sorted(_CONVERTERS))})")
    return _CONVERTERS[kind](spec, input_file, chat_encoder)


def format_reader(input_file: InputFile, spec: RecordSpec) -> FormatReader:
    """The registered reader of ``input_file``'s format; an unknown format is a ``ValueError``."""
    reader, images_only = _FORMATS.get(input_file.format, (None, False))
    if reader is None or (images_only and spec.images is None):
        raise ValueError(f"unknown input format {input_file.format!r} for {input_file.path}")
    return reader
