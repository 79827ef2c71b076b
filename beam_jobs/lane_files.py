"""Lane layout: keying documents by (lane, file bucket) and writing one lane part file.

::

    document (key, text, ...)
      lane      = lane_of_key(seed, key, L)           # loader.order.hashing, shared with the loader
      order_key = order_key_of(seed, key)             # uint64, rows are sorted by it
      part      = file_bucket(order_key, files_per_lane)  # contiguous ranges of order_key
      -> ((lane, part), row) -> GroupByKey -> sort -> lane=LLLLL/part-PPPPP.parquet

Everything that ends up in a file's bytes is a function of the group's rows: they are
sorted by ``(order_key, key, text, kept fields)`` before writing, row groups are cut by
content (:func:`row_group_bounds`), and the Parquet writer settings are fixed
(:func:`parquet_write_options`; pyarrow writes its version into ``created_by``, so byte
equality holds for one pyarrow version). Files are serialised into memory, so their size
and SHA-256 are known before they are written under a temporary name and renamed.

A bucket that receives no documents writes no file, so part numbers of a lane can have gaps.

Image datasets (``--image-field`` or WebDataset input) add the columns of
:mod:`beam_jobs.image_lanes` after ``text``: ``segments`` (where the images stand in the text,
:mod:`loader.vision.segments`), ``num_images``, ``image_bytes`` (encoded bytes as given, no
Parquet codec), ``image_format``, ``image_width``, ``image_height``, ``image_sha256`` and, with
``--image-policy``, ``image_visual_tokens``; their rows are cut into row groups by text plus
image bytes. Text datasets are written exactly as before (same schema, same bytes).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics

from beam_jobs import progress
from beam_jobs.image_lanes import (
    IMAGE_BYTES_COLUMN,
    IMAGE_COLUMN_CODECS,
    image_columns,
    image_count,
    image_fields,
    image_nbytes,
)
from beam_jobs.outputs import join_output, write_atomically
from beam_jobs.transform_steps import TokenStage, ENTRY_COUNTS
from loader.io.blocks import tokenize_documents
from loader.io.manifest import CONVERSATION_COLUMN, TOMBSTONE_COLUMN, FileEntry, lane_file_path
from loader.io.storage_options import StorageOptions
from loader.order.hashing import file_bucket, lane_of_key, order_key_of
from loader.stages.tokenizer import describe, load_tokenizer

logger = logging.getLogger(__name__)

# A row group ends once it holds this many rows or at least this much text, so the loader
# can seek to a row group on resume without decoding much before it.
ROW_GROUP_MAX_ROWS = 1024
ROW_GROUP_TEXT_BYTES = 1 << 20

# Fixed, explicit writer settings: a pyarrow default that changes cannot change the bytes.
PARQUET_WRITE_OPTIONS: dict[str, Any] = {
    "version": "2.6",
    "compression": "zstd",
    "compression_level": 3,
    "write_page_checksum": True,  # the loader verifies page CRCs on ranged reads
    "use_dictionary": False,
    "data_page_version": "1.0",
    "data_page_size": 1 << 20,
    "store_schema": True,
    "write_batch_size": 1024,
}
# Token ids as little-endian int32 bytes per document: Parquet decodes a binary column ~2x
# faster than list<int32> (no repetition levels) and the loader reads its values buffer as
# the flat id array without a copy. ``np.frombuffer(value, "<i4")`` gives one row's ids.
INPUT_IDS_TYPE = pa.binary()
LOSS_MASK_TYPE = pa.binary()  # one byte (0/1) per id, the feature column of loader.stages.features
# Codec of the input_ids column (every other column is zstd). The loader decodes this column
# on every epoch and is CPU-bound there: lz4 decodes 1.4-1.6x faster than zstd level 3
# (bench/HISTORY.md, "Token column codec and lane file access"); zstd stores fewer bytes,
# which matters more when reads are network-bound and no local cache is used; none skips
# decompression but makes the page checksums run over 4 bytes per token.
TOKEN_COMPRESSIONS = ("lz4", "zstd", "none")
DEFAULT_TOKEN_COMPRESSION = "lz4"
STATISTICS_COLUMNS = ("key", "order_key", "num_tokens")
# Columns stored with the token codec (--token-compression): per-token data the loader decodes
# every epoch. ``loss_mask`` (chat, one byte per id) is a feature column of loader.stages.features.
TOKEN_COLUMNS = ("input_ids", "loss_mask")
RESERVED_COLUMNS = ("key", "order_key", "text", "input_ids", "num_tokens", "loss_mask", CONVERSATION_COLUMN,
                    TOMBSTONE_COLUMN)

# Row tuple between AssignLane and WriteLaneFiles. The order key travels as 8 big-endian
# bytes: Beam's fast coder pickles ints >= 2**63, and bytes compare in unsigned order. A chat
# row (beam_jobs.chat_records) adds its encoding: (input_ids "<i4" bytes, loss_mask uint8 bytes), or
# the conversation JSON (a str) when the loader encodes it online.
# With --transform every row ends with (dropped_by, layout text bytes) (beam_jobs.transform_steps).
LaneRow = tuple  # (order_key_be8: bytes, key: str, text: str, kept_values: tuple[str | None, ...][, encoded][, marker])


def files_per_lane_for(total_text_bytes: int, num_lanes: int, target_file_bytes: int) -> int:
    """``max(1, ceil(total / L / target))``: decided by content, never by input file sizes."""
    per_lane = -(-int(total_text_bytes) // num_lanes)
    return max(1, -(-per_lane // target_file_bytes))


class AssignLaneFn(beam.DoFn):
    """Document -> ``((lane_id, part), LaneRow)``; ``files_per_lane`` is a side input."""

    def __init__(self, seed: int, num_lanes: int):
        self.seed = seed
        self.num_lanes = num_lanes

    def process(self, document: tuple, files_per_lane: int, num_lanes: Optional[int] = None) -> Iterator[tuple]:
        """``num_lanes``: a side input where the job chose the lane count (beam_jobs.lane_count)."""
        key, text, _text_nbytes, kept_values, *encoded = document  # encoded: chat documents only
        lane_id = lane_of_key(self.seed, key, self.num_lanes if num_lanes is None else num_lanes)
        order_key = order_key_of(self.seed, key)
        part = file_bucket(order_key, files_per_lane)
        yield (lane_id, part), (order_key.to_bytes(8, "big"), key, text, kept_values, *encoded)


def lane_schema(pretokenized: bool, keep_fields: Sequence[str], loss_mask: bool = False, conversation: bool = False,
                images: bool = False, visual_tokens: bool = False, tombstones: bool = False):
    """The Arrow schema of a lane file (documented in :mod:`loader.io.manifest`); ``loss_mask``:
    chat data, pre-tokenized with a per-token loss mask; ``conversation``: chat data encoded online;
    ``images``: image documents (:mod:`beam_jobs.image_lanes`), ``visual_tokens`` with a policy;
    ``tombstones``: a ``--transform`` job (the ``dropped_by`` column)."""
    if loss_mask and not pretokenized:
        raise ValueError("a loss_mask column needs the input_ids it is aligned with (pretokenized=True)")
    if conversation and pretokenized:
        raise ValueError("a conversation column is for chat data the loader encodes (pretokenized=False)")
    fields = [pa.field("key", pa.string()), pa.field("order_key", pa.uint64()), pa.field("text", pa.string())]
    if conversation:
        fields.append(pa.field(CONVERSATION_COLUMN, pa.string()))
    if pretokenized:
        fields += [pa.field("input_ids", INPUT_IDS_TYPE), pa.field("num_tokens", pa.int32())]
    if loss_mask:
        fields.append(pa.field("loss_mask", LOSS_MASK_TYPE))
    if images:
        fields += image_fields(visual_tokens)
    if tombstones:
        fields.append(pa.field(TOMBSTONE_COLUMN, pa.int16()))
    fields += [pa.field(name, pa.string()) for name in keep_fields]
    return pa.schema(fields)


def _type_name(arrow_type) -> str:
    # "list<int32>" whatever pyarrow calls the list's child field ("item" / "element").
    if pa.types.is_list(arrow_type):
        return f"list<{_type_name(arrow_type.value_type)}>"
    return str(arrow_type)


def manifest_schema(pretokenized: bool, keep_fields: Sequence[str], loss_mask: bool = False,
                    conversation: bool = False, images: bool = False,
                    visual_tokens: bool = False, tombstones: bool = False) -> list[dict[str, str]]:
    """The schema as the manifest records it: ``[{"name": ..., "type": ...}]``."""
    schema = lane_schema(pretokenized, keep_fields, loss_mask, conversation, images, visual_tokens, tombstones)
    return [{"name": f.name, "type": _type_name(f.type)} for f in schema]


def row_group_bounds(text_nbytes: np.ndarray) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: at most 1024 rows, closed once it holds >= 1 MiB of text."""
    bounds, start, rows, text_bytes = [], 0, 0, 0
    for index, nbytes in enumerate(text_nbytes.tolist()):
        rows += 1
        text_bytes += nbytes
        if rows == ROW_GROUP_MAX_ROWS or text_bytes >= ROW_GROUP_TEXT_BYTES:
            bounds.append((start, index + 1))
            start, rows, text_bytes = index + 1, 0, 0
    if rows:
        bounds.append((start, len(text_nbytes)))
    return bounds


def tokenize_texts(tokenizer, texts: list[str]):
    """``(input_ids BinaryArray of little-endian int32 ids, num_tokens int32 ndarray)`` of one batch,
    tokenized as the loader tokenizes online (:func:`loader.io.blocks.tokenize_documents`)."""
    flat_ids, lengths = tokenize_documents(tokenizer, texts)
    num_tokens = lengths.astype(np.int32)
    offsets = np.zeros(len(num_tokens) + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=offsets[1:])
    return token_bytes_array(flat_ids, offsets), num_tokens


def token_bytes_array(flat_ids: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """The ``input_ids`` column (``INPUT_IDS_TYPE``) of rows ``flat_ids[offsets[i]:offsets[i+1]]``."""
    byte_offsets = np.asarray(offsets, dtype=np.int64) * 4
    if len(byte_offsets) and byte_offsets[-1] >= 1 << 31:
        raise ValueError(f"a row group of {int(byte_offsets[-1]) // 4} tokens exceeds the 2 GiB of one binary column chunk")
    byte_offsets = byte_offsets.astype(np.int32)
    data = np.ascontiguousarray(flat_ids, dtype="<i4")
    return pa.Array.from_buffers(INPUT_IDS_TYPE, len(byte_offsets) - 1,
                                 [None, pa.py_buffer(byte_offsets), pa.py_buffer(data)])


@dataclass(frozen=True)
class SerializedLaneFile:
    data: bytes
    rows: int
    tokens: Optional[int]
    row_groups: int
    duplicate_keys: int
    images: int = 0  # image datasets: images in the file (summed into the manifest's "images")
    tombstones: int = 0  # --transform: rows of dropped documents
    longest: int = 0  # tokens of the file's longest document (pre-tokenized and encoded chat rows)


def sort_rows(rows: Iterable[LaneRow], has_kept_fields: bool) -> list[LaneRow]:
    """Rows in lane order; ties (duplicate keys) are broken by content, never by arrival."""
    if not has_kept_fields:
        return sorted(rows)  # kept_values is () in every row, so plain tuple order is enough
    # row[4:]: an image row's payload (not a function of its text, unlike a chat row's encoding)
    return sorted(rows, key=lambda row: (row[0], row[1], row[2], tuple((v is not None, v or "") for v in row[3]),
                                         row[4:]))


def parquet_write_options(schema: pa.Schema, token_compression: str = DEFAULT_TOKEN_COMPRESSION) -> dict[str, Any]:
    """The writer settings of a lane file with ``schema``: fixed, so equal rows give equal bytes.

    The per-token columns (:data:`TOKEN_COLUMNS`) get ``token_compression``: the loader
    decodes them together every epoch.
    """
    if token_compression not in TOKEN_COMPRESSIONS:
        raise ValueError(f"token compression must be one of {TOKEN_COMPRESSIONS} (got {token_compression!r})")
    options = dict(PARQUET_WRITE_OPTIONS)
    options["write_statistics"] = [c for c in STATISTICS_COLUMNS if c in schema.names]
    options["sorting_columns"] = [pq.SortingColumn(schema.get_field_index("order_key"))]
    if "input_ids" in schema.names:
        codecs = {name: PARQUET_WRITE_OPTIONS["compression"] for name in schema.names}
        for name in TOKEN_COLUMNS:
            if name in codecs:
                codecs[name] = token_compression
        options["compression"] = codecs
        options["compression_level"] = {
            name: PARQUET_WRITE_OPTIONS["compression_level"] for name, codec in codecs.items() if codec == "zstd"
        }
    if IMAGE_BYTES_COLUMN in schema.names:  # image datasets: encoded images are compressed already
        codecs = {name: IMAGE_COLUMN_CODECS.get(name, PARQUET_WRITE_OPTIONS["compression"]) for name in schema.names}
        options["compression"] = codecs
        options["compression_level"] = {name: PARQUET_WRITE_OPTIONS["compression_level"]
                                        for name, codec in codecs.items() if codec == "zstd"}
    return options


def encoded_token_columns(rows: Sequence[LaneRow]) -> tuple[pa.Array, np.ndarray, pa.Array]:
    """``(input_ids, num_tokens, loss_mask)`` columns of chat rows, from each row's encoding."""
    id_bytes = [row[4][0] for row in rows]
    num_tokens = np.fromiter((len(b) // 4 for b in id_bytes), dtype=np.int32, count=len(rows))
    for row, count in zip(rows, num_tokens.tolist()):
        if len(row[4][1]) != count:
            raise ValueError(f"row {row[1]!r}: loss_mask holds {len(row[4][1])} bytes for {count} ids")
    return pa.array(id_bytes, INPUT_IDS_TYPE), num_tokens, pa.array([row[4][1] for row in rows], LOSS_MASK_TYPE)


def serialize_lane_file(sorted_rows: Sequence[LaneRow], keep_fields: Sequence[str], tokenizer=None,
                        token_compression: str = DEFAULT_TOKEN_COMPRESSION,
                        encoded: bool = False, conversations: bool = False, images: bool = False,
                        visual_tokens: bool = False, markers: Optional[Sequence[tuple[int, int]]] = None,
                        token_stage=None) -> SerializedLaneFile:
    """The exact bytes of one lane part file holding ``sorted_rows`` in that order.

    ``markers``: a ``--transform`` job's ``(dropped_by, layout text bytes)`` per row (the
    ``dropped_by`` column; row groups are cut by the original documents' text bytes, so a
    tombstone or a changed text leaves them as they would be without the transforms);
    ``token_stage``: its tokens-stage transforms (:class:`beam_jobs.transform_steps.TokenStage`),
    applied to each row group's ids right after tokenization.

    ``images``: image rows carrying ``(segments, images)`` (:mod:`beam_jobs.image_records`),
    written as the image columns of :mod:`beam_jobs.image_lanes` (``visual_tokens``: with the
    counts of ``--image-policy``); their image bytes count with the text when cutting row groups.

    ``encoded``: chat rows that carry their ``input_ids`` and ``loss_mask``
    (:mod:`beam_jobs.chat_records`), written as they are; ``conversations``: chat rows that carry
    their conversation JSON, for the loader to encode; otherwise ``tokenizer`` (if any)
    tokenizes the text.
    """
    if (encoded or conversations) and tokenizer is not None:
        raise ValueError("chat rows are encoded by the job or by the loader, not by tokenizer=; pass tokenizer=None")
    schema = lane_schema(tokenizer is not None or encoded, keep_fields, loss_mask=encoded, conversation=conversations,
                         images=images, visual_tokens=visual_tokens, tombstones=markers is not None)
    keys = pa.array([row[1] for row in sorted_rows], pa.string())
    order_keys = pa.array(np.frombuffer(b"".join(row[0] for row in sorted_rows), dtype=">u8").astype(np.uint64))
    texts = pa.array([row[2] for row in sorted_rows], pa.string())
    kept_columns = [pa.array([row[3][k] for row in sorted_rows], pa.string()) for k in range(len(keep_fields))]
    conversation_column = pa.array([row[5 if images else 4] for row in sorted_rows], pa.string()) \
        if conversations else None  # chat with images: after the image payload (beam_jobs.chat_image_records)
    if markers is not None:
        content_nbytes = np.fromiter((m[1] for m in markers), dtype=np.int64, count=len(markers))
        dropped_by = np.fromiter((m[0] for m in markers), dtype=np.int16, count=len(markers))
    else:
        content_nbytes = pc.binary_length(texts).to_numpy(zero_copy_only=False)
    bounds = row_group_bounds(content_nbytes + image_nbytes(sorted_rows) if images else content_nbytes)

    sink = pa.BufferOutputStream()
    total_tokens = longest = 0
    with pq.ParquetWriter(sink, schema, **parquet_write_options(schema, token_compression)) as writer:
        for start, stop in bounds:
            length = stop - start
            columns = [keys.slice(start, length), order_keys.slice(start, length), texts.slice(start, length)]
            if conversation_column is not None:
                columns.append(conversation_column.slice(start, length))
            if tokenizer is not None:
                input_ids, num_tokens = tokenize_texts(tokenizer, [row[2] for row in sorted_rows[start:stop]])
                if token_stage is not None:
                    input_ids, num_tokens = _token_stage(token_stage, sorted_rows[start:stop], input_ids, num_tokens,
                                                         dropped_by[start:stop], columns)
                total_tokens += int(num_tokens.sum())
                longest = max(longest, int(num_tokens.max(initial=0)))
                columns += [input_ids, pa.array(num_tokens)]
            elif encoded:
                input_ids, num_tokens, loss_mask = encoded_token_columns(sorted_rows[start:stop])
                total_tokens += int(num_tokens.sum())
                longest = max(longest, int(np.max(num_tokens, initial=0)))
                columns += [input_ids, pa.array(num_tokens), loss_mask]
            if images:
                columns += image_columns(sorted_rows[start:stop], visual_tokens)
            if markers is not None:
                columns.append(pa.array(dropped_by[start:stop], pa.int16()))
            kept = [column.slice(start, length) for column in kept_columns]
            if markers is not None and token_stage is not None:
                live = pa.array(dropped_by[start:stop] < 0)  # tokens-stage drops lose their kept fields too
                kept = [pc.if_else(live, column, pa.scalar(None, pa.string())) for column in kept]
            columns += kept
            # One write_table call with row_group_size >= its rows is exactly one row group.
            writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=length)
    duplicate_keys = sum(1 for a, b in zip(sorted_rows, sorted_rows[1:]) if a[1] == b[1])
    return SerializedLaneFile(
        data=sink.getvalue().to_pybytes(),
        rows=len(sorted_rows),
        tokens=total_tokens if tokenizer is not None or encoded else None,
        row_groups=len(bounds),
        duplicate_keys=duplicate_keys,
        images=image_count(sorted_rows) if images else 0,
        tombstones=int((dropped_by >= 0).sum()) if markers is not None else 0,
        longest=longest,
    )


def _token_stage(stage, rows: Sequence[LaneRow], input_ids: pa.Array, num_tokens: np.ndarray,
                 dropped_by: np.ndarray, columns: list) -> tuple[pa.Array, np.ndarray]:
    """A row group's ids through the tokens-stage transforms; a row they drop becomes a tombstone
    (its text in ``columns`` emptied)."""
    flat = np.frombuffer(input_ids.buffers()[2], dtype="<i4") if input_ids.buffers()[2] is not None \
        else np.zeros(0, np.int32)
    live_before = dropped_by < 0
    result = stage.apply(rows, flat, num_tokens, dropped_by)  # updates dropped_by
    if result is None:
        return input_ids, num_tokens
    id_arrays, num_tokens = result
    if (live_before != (dropped_by < 0)).any():
        texts = columns[2]
        columns[2] = pc.if_else(pa.array(dropped_by < 0), texts, pa.scalar("", pa.string()))
    offsets = np.zeros(len(id_arrays) + 1, dtype=np.int64)
    np.cumsum(num_tokens, out=offsets[1:])
    flat = np.concatenate(id_arrays).astype(np.int32, copy=False) if id_arrays else np.zeros(0, np.int32)
    return token_bytes_array(flat, offsets), num_tokens


class WriteLaneFileFn(beam.DoFn):
    """``((lane_id, part), rows)`` -> writes ``lane=LLLLL/part-PPPPP.parquet``, yields its FileEntry dict."""

    def __init__(self, output: str, keep_fields: Sequence[str], tokenizer_path: Optional[str],
                 tokenizer_fingerprint: Optional[str], token_compression: str = DEFAULT_TOKEN_COMPRESSION,
                 encoded: bool = False, conversations: bool = False, images: bool = False,
                 visual_tokens: bool = False, tombstones: bool = False, token_stage: Optional[dict] = None,
                 storage_options: StorageOptions = StorageOptions()):
        # tombstones: a --transform job, whose rows end with their (dropped_by, layout bytes) marker;
        # token_stage: the TokenStage arguments of its tokens-stage transforms (built on the worker).
        self.tombstones = tombstones
        self.token_stage_args = token_stage
        self.token_stage = None
        # encoded: chat rows arrive tokenized (ReadFiles encoded them); conversations: chat rows
        # carry their conversation JSON (encoded online); tokenizer_path is then None. images:
        # image rows (beam_jobs.image_records); each entry then also says how many images it holds.
        self.encoded = encoded
        self.conversations = conversations
        self.images = images
        self.visual_tokens = visual_tokens
        self.output = output
        self.storage_options = storage_options  # --s3-*, --storage-*: lane files written, the tokenizer read with them
        self.token_compression = token_compression
        self.keep_fields = tuple(keep_fields)
        self.tokenizer_path = tokenizer_path
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.tokenizer = None
        self.duplicates_counter = Metrics.counter("zephon.shard", "duplicate_keys")
        self.files_counter = Metrics.counter("zephon.shard", "lane_files_written")  # beam_jobs.progress
        self.rows_counter = Metrics.counter("zephon.shard", "rows_written")
        self.bytes_counter = Metrics.counter("zephon.shard", "bytes_written")
        self.tokens_counter = Metrics.counter("zephon.shard", "tokens_written")

    def setup(self) -> None:
        if self.token_stage_args is not None:
            self.token_stage = TokenStage(**self.token_stage_args)
        if self.tokenizer_path is None:
            return

        self.tokenizer = load_tokenizer(self.tokenizer_path, self.storage_options)
        actual = describe(self.tokenizer).fingerprint
        if actual != self.tokenizer_fingerprint:
            raise RuntimeError(
                f"zephon shard: --tokenizer {self.tokenizer_path} changed while the job ran "
                f"(fingerprint {actual[:12]} on a worker, {str(self.tokenizer_fingerprint)[:12]} at launch); "
                "re-run with a tokenizer file that is not being rewritten."
            )

    def process(self, element: tuple) -> Iterator[dict]:
        (lane_id, part), rows = element
        sorted_rows = sort_rows(rows, bool(self.keep_fields))
        markers = None
        if self.token_stage is not None:
            self.token_stage.begin_file()
        if self.tombstones:
            markers = [row[-1] for row in sorted_rows]
            sorted_rows = [row[:-1] for row in sorted_rows]
        serialized = serialize_lane_file(sorted_rows, self.keep_fields, self.tokenizer, self.token_compression,
                                         self.encoded, self.conversations, self.images, self.visual_tokens,
                                         markers=markers, token_stage=self.token_stage)
        extra = {"images": serialized.images} if self.images else {}
        if self.encoded or self.tokenizer_path is not None:  # the manifest's longest_tokens (chat: chat.longest_tokens)
            extra["longest_tokens"] = serialized.longest
        if self.tombstones:  # summed by CommitManifest
            extra["tombstones"] = serialized.tombstones
            if self.token_stage is not None:
                extra[ENTRY_COUNTS] = self.token_stage.entry_counts()
        relative_path = lane_file_path(lane_id, part)
        write_atomically(join_output(self.output, relative_path), serialized.data, self.storage_options)
        self.files_counter.inc()
        self.rows_counter.inc(serialized.rows)
        self.bytes_counter.inc(len(serialized.data))
        self.tokens_counter.inc(serialized.tokens or 0)
        progress.stage("WriteLaneFiles").add(files=1, rows=serialized.rows, bytes=len(serialized.data))
        if serialized.duplicate_keys:
            self.duplicates_counter.inc(serialized.duplicate_keys)
            logger.warning("%s holds %d rows whose key repeats the previous row's key "
                           "(duplicate --id-field values); all are kept, ordered by text",
                           relative_path, serialized.duplicate_keys)
        yield FileEntry(
            path=relative_path,
            lane=lane_id,
            part=part,
            rows=serialized.rows,
            bytes=len(serialized.data),
            sha256=hashlib.sha256(serialized.data).hexdigest(),
            tokens=serialized.tokens,
            row_groups=serialized.row_groups,
        ).to_dict() | extra  # summed by CommitManifest
