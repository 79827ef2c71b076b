"""One lane of one source as a positional token stream.

A lane's files are cut into *blocks* (one Parquet row group each). Epoch 0 replays the
blocks and rows in the order the Beam job wrote them (order-key order). Epoch ``e > 0``
replays a permutation seeded by ``(seed, source, lane, e)``: the file order, the row-group
order inside each file and the row order inside each row group are shuffled, so memory stays
bounded by one row group (DESIGN.md allows one file; a row group is tighter and makes a
restore cost one row-group read).

Each block becomes one token array: for every document ``[bos] + ids + [eos]`` (as
configured), concatenated, with the offsets where documents start. The stream's position
is three integers::

    cursor = (epoch, block, offset)      offset = tokens of the block already consumed

so a checkpoint never holds tokens for this stage, and restoring reads exactly one block.
Text blocks are tokenized as the cursor advances (:class:`TextBlock`), so restoring a text
lane tokenizes the block's documents up to ``offset``, at most one row group.

State keys (``get_state``): ``epoch``, ``block``, ``offset``, ``exhausted``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.io import storage
from loader.errors import ZephonError
from loader.stages.features import NO_FEATURES, Feature, column_features, slice_features, wrap_feature
from loader.order.hashing import stable_permutation
from loader.io.manifest import MANIFEST_NAME, FileEntry, Manifest, lane_file_path

log = logging.getLogger(__name__)


class LaneDataError(ZephonError, RuntimeError):
    """A lane file whose content cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class TokenFormat:
    """How documents become tokens: the ids wrapped around every document."""

    bos_id: Optional[int]  # None: no BOS
    eos_id: Optional[int]  # None: no EOS

    @property
    def extra(self) -> int:
        return int(self.bos_id is not None) + int(self.eos_id is not None)


# Text blocks are tokenized as the cursor reaches them, in calls that start at this many
# characters (~10 sequences' worth) and double each call: a row group holds up to 1 MiB of
# text, and tokenizing it in one call made the first batch, a restore and every block change
# wait for the whole group. The calls grow because many small ones serialise: with fixed
# 64 KiB calls ~20% of the tokenizer's CPU time ran on the calling thread, outside its
# thread pool; doubling calls (4-5 per row group) keep that at ~2%, as one call per group.
TOKENIZE_CHARS = 64 * 1024


# Read-ahead: background threads read and decode every stream's next row groups while the
# current one is consumed (pyarrow and numpy release the GIL for this work, so on two or more
# cores it overlaps the packing and collation on the calling thread). The threads are shared by
# all streams of the process; each stream's reads run one after another, in its order (a
# stream's Parquet file is not read by two threads at once). With one thread the reads were
# the bound of pre-tokenized replay on two cores (bench/RESULTS.md, issue 6 profile). The pools
# are rebuilt after a fork, whose child would inherit the pool objects but not their threads.
READ_AHEAD_BLOCKS = 2  # for a lane's only source: one is not enough when every lane changes block at once


def read_ahead_depth(share: Fraction, *, takes_next_block_early: bool = False) -> int:
    """Blocks read ahead by the stream of a source that gets ``share`` of its lane's output.

    A source consumed at half the rate needs half the blocks to cover the same time, so a
    lane holds about ``READ_AHEAD_BLOCKS`` blocks ahead however many sources it mixes (with
    two blocks per source, the trainer's thread of a two-source mix did 8-13% more CPU for
    the same rows: bench/RESULTS.md, issue 4). At least one.

    ``takes_next_block_early``: the stream feeds a token mix, whose bulk reader takes the
    next block as soon as the cursor enters a block (:meth:`LaneTokenStream.documents_ahead`),
    one block earlier than other readers: one more (without it the trainer waited for those
    reads: 0.8x the wall-clock tokens/s).
    """
    return max(1, math.ceil(READ_AHEAD_BLOCKS * share)) + (1 if takes_next_block_early else 0)


_pool_lock = threading.Lock()
_pools: tuple[int, dict[int, ThreadPoolExecutor]] = (os.getpid(), {})


def _read_ahead_pool(threads: int) -> ThreadPoolExecutor:
    global _pools
    with _pool_lock:
        if _pools[0] != os.getpid():
            _pools = (os.getpid(), {})
        pool = _pools[1].get(threads)
        if pool is None:
            pool = _pools[1][threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zephon-read-ahead")
        return pool


# -- integrity checks --------------------------------------------------------------------
# What a lane file is checked against (README "Data integrity"): on open, the Parquet footer
# against the manifest entry (rows, row groups) and, with ``verify_local_files``, a local
# file's SHA-256; on every row-group read, the rows decoded against the footer (a flipped bit
# in a page header, which page checksums do not cover, can make a row group decode as fewer
# rows without an error); once a file's row groups have all been read, its tokens against the
# manifest. All of it runs once per file or per row group, never per sequence.

_FIX = "re-run the Beam job or restore the file from a good copy"
PART_FILE_NAME = re.compile(r"part-\d{5,}\.parquet")

# Local lane files whose SHA-256 matched the manifest in this process, by identity on disk
# (a file replaced in place is hashed again): each is hashed once per process, on first open.
_verified_local_files: set[tuple] = set()


def verify_local_file(path: str, handle, entry: FileEntry) -> None:
    """Hash a local lane file through the handle pyarrow will read (then rewound) and compare
    it with the manifest's SHA-256, unless this process already verified the same file."""
    st = os.fstat(handle.fileno())
    identity = (path, entry.sha256, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _verified_local_files:
        return
    digest = storage.sha256_of_file(handle)
    handle.seek(0)
    if digest != entry.sha256:
        raise LaneDataError(
            f"{path}: SHA-256 {digest} does not match the manifest's {entry.sha256} (verify_local_files): "
            f"the file is corrupt or was replaced; {_FIX}"
        )
    _verified_local_files.add(identity)


def check_footer(metadata: pq.FileMetaData, entry: FileEntry, path: str) -> None:
    """The footer promises what the manifest does: the rows, and the row groups if recorded."""
    problems = []
    if metadata.num_rows != entry.rows:
        problems.append(f"footer says {metadata.num_rows} rows, manifest says {entry.rows}")
    if entry.row_groups > 0 and metadata.num_row_groups != entry.row_groups:
        problems.append(f"footer says {metadata.num_row_groups} row groups, manifest says {entry.row_groups}")
    group_rows = sum(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
    if group_rows != metadata.num_rows:
        problems.append(f"footer's row groups hold {group_rows} rows, its total says {metadata.num_rows}")
    if problems:
        raise LaneDataError(f"{path}: " + "; ".join(problems) + f": the file or the manifest is corrupt; {_FIX}")


def check_no_unlisted_files(dataset_path: str, lane_id: int, files: list[FileEntry]) -> None:
    """A local lane directory holds exactly the manifest's part files of the lane.

    The Beam job clears its output before writing, so a part file that the manifest does not
    list means an entry was removed from the manifest (its lane would silently lose those
    documents). One directory listing per lane and process; not done on ``gs://``, where it
    would cost a request per lane.
    """
    lane_dir = storage.join(dataset_path, os.path.dirname(lane_file_path(lane_id, 0)))
    try:
        names = os.listdir(lane_dir)
    except FileNotFoundError:
        return  # the listed files are reported missing when opened
    listed = {os.path.basename(f.path) for f in files}
    unlisted = sorted(n for n in names if PART_FILE_NAME.fullmatch(n) and n not in listed)
    if unlisted:
        raise LaneDataError(
            f"{lane_dir} holds {unlisted} but {MANIFEST_NAME} does not list them: the manifest is not the "
            "one the Beam job wrote with these files (an entry was removed?); re-run the Beam job or "
            "restore the manifest"
        )


def check_row_group(rows: int, metadata: pq.FileMetaData, row_group: int, path: str) -> None:
    """A row group read yields exactly the rows its footer entry promises."""
    expected = metadata.row_group(row_group).num_rows
    if rows != expected:
        raise LaneDataError(
            f"{path}: row group {row_group} decoded to {rows} rows, its footer says {expected}: "
            f"the file is corrupt (a damaged page header?); {_FIX}"
        )


@dataclass
class Block:
    """A row group's documents as one token array plus document start offsets.

    A pre-tokenized block is complete when read. A :class:`TextBlock` covers the documents
    tokenized so far: ``ensure(position)`` extends it; the cursor math is the same.
    """

    tokens: np.ndarray  # int32, all documents of the block back to back
    doc_starts: np.ndarray  # int64, len = documents + 1; last entry = len(tokens)
    complete: bool = True  # False: documents after the last ``doc_starts`` entry are still text
    features: Mapping[str, np.ndarray] = NO_FEATURES  # per-token arrays aligned with ``tokens`` (loader.stages.features)

    def ensure(self, position: int) -> None:
        """Make ``tokens`` extend past ``position``, or hold the whole block."""


class TextBlock(Block):
    """A text row group, tokenized lazily, whole documents per call (see ``TOKENIZE_CHARS``)."""

    def __init__(self, texts: list, tokenizer, token_format: TokenFormat) -> None:
        super().__init__(tokens=np.zeros(0, dtype=np.int32), doc_starts=np.zeros(1, dtype=np.int64),
                         complete=not texts)
        self._texts = texts
        self._char_ends = np.cumsum([len(t) for t in texts]) if texts else None
        self._next = 0  # first document not tokenized yet
        self._chars = TOKENIZE_CHARS  # text of the next call
        self._tokenizer = tokenizer
        self._format = token_format

    def ensure(self, position: int) -> None:
        while not self.complete and len(self.tokens) <= position:
            self._tokenize_more()

    def _tokenize_more(self) -> None:
        start = self._next
        chars_before = int(self._char_ends[start - 1]) if start else 0
        end = int(np.searchsorted(self._char_ends, chars_before + self._chars, side="right"))
        end = min(max(end, start + 1), len(self._texts))
        self._chars *= 2
        encoded = self._tokenizer.encode_batch_fast(self._texts[start:end], add_special_tokens=False)
        id_lists = [e.ids for e in encoded]
        lengths = np.fromiter((len(ids) for ids in id_lists), dtype=np.int64, count=len(id_lists))
        flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths.sum()))
        part = wrap_documents(flat, lengths, self._format)
        # New arrays, not in-place growth: chunks already taken are views of the old ones.
        self.doc_starts = np.concatenate([self.doc_starts[:-1], part.doc_starts + len(self.tokens)])
        self.tokens = np.concatenate([self.tokens, part.tokens])
        self._next = end
        if end == len(self._texts):
            self.complete = True
            self._texts = self._char_ends = None


@dataclass(frozen=True)
class Chunk:
    """Tokens taken from a stream: ``doc_starts`` are offsets in ``tokens`` where a document begins.

    ``features``: per-token arrays aligned with ``tokens`` (:mod:`loader.stages.features`), e.g.
    ``loss_mask`` read from the lane files, or ``token_sources`` (int8) set by token-unit
    mixing, where one chunk can hold documents of several sources; with it, a chunk of whole
    rows cut in bulk carries ``row_majority``, each row's majority source (most tokens,
    lowest id on ties).
    """

    tokens: np.ndarray
    doc_starts: np.ndarray
    features: Mapping[str, np.ndarray] = NO_FEATURES
    row_majority: Optional[list[int]] = None

    @property
    def token_sources(self) -> Optional[np.ndarray]:
        return self.features.get("token_sources")


@dataclass
class DocumentsView:
    """The documents a bulk reader may take: the rest of the current block and, when both
    are fully tokenized and the epoch has another block, the next block as well.

    Positions are *virtual*: offsets in the current block, then ``len(current) + offset`` in
    the next one. A document never spans two blocks, and the last document of the view ends
    strictly before the view's end (a document that reaches it is left to ``take``).
    """

    blocks: list  # token arrays: the current block [, the next]
    cursor: int  # virtual position of the stream's cursor
    ends: np.ndarray  # virtual end of each document from the cursor on
    epoch: int
    block_index: int  # of the current block
    features: tuple = ()  # each block's features (loader.stages.features), as ``blocks``

    def slices(self, start: int, end: int, feature: Optional[str] = None) -> list[np.ndarray]:
        """The tokens (or feature ``feature``'s values) at virtual positions ``[start, end)``,
        one slice per block touched."""
        arrays = self.blocks if feature is None else [f[feature] for f in self.features]
        first = len(self.blocks[0])
        if end <= first:
            return [arrays[0][start:end]]
        if start >= first:
            return [arrays[1][start - first : end - first]]
        return [arrays[0][start:first], arrays[1][: end - first]]

    def where(self, position: int) -> tuple[int, int]:
        """``(block index, offset)`` of a virtual position; the current block's end is the
        next block's start, as ``take`` leaves the cursor after a block's last document."""
        first = len(self.blocks[0])
        if position < first or len(self.blocks) == 1:
            return self.block_index, position
        return self.block_index + 1, position - first


def _binary_scalar(data: bytes, binary_type: pa.DataType) -> pa.Scalar:
    """A binary scalar built from buffers: ``pa.scalar(bytes)`` (and Python bytes passed to a
    compute function) import pandas when it is installed, ~0.2 s that a restore's first batch
    would wait for."""
    offset_type = np.int64 if pa.types.is_large_binary(binary_type) else np.int32
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=offset_type))
    return pa.Array.from_buffers(binary_type, 1, [None, offsets, pa.py_buffer(data)])[0]


def _binary_rows(values: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """A binary column chunk with null rows made empty, and its rows' byte offsets (a view)."""
    if values.null_count:
        values = pc.fill_null(values, _binary_scalar(b"", values.type))
    offset_type = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    offsets = np.frombuffer(values.buffers()[1], dtype=offset_type)[values.offset : values.offset + len(values) + 1]
    return values, offsets


def _token_rows(values: pa.Array, where: str, row_group: int, wrap_ids: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(flat int32 ids, lengths)`` of an ``input_ids`` column chunk, in either encoding.

    ``binary`` (what the Beam job writes): each row holds its ids as little-endian int32
    bytes, so the values buffer *is* the flat id array (zero-copy; Parquet decodes it ~2x
    faster than a list column). ``list<int32>`` (older datasets, hand-made ones) is flattened.
    Null rows are empty documents in both. ``wrap_ids``: ids per row already added around
    each document (only named in the error for a malformed row).
    """
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        values, offsets = _binary_rows(values)
        byte_lengths = np.diff(offsets).astype(np.int64)
        if len(byte_lengths) and (byte_lengths % 4).any():
            raise _partial_ids_error(byte_lengths, where, row_group, wrap_ids)
        data = values.buffers()[2]
        start = int(offsets[0]) if len(offsets) else 0
        flat = np.frombuffer(data, dtype="<i4", count=int(offsets[-1] - start) // 4 if len(offsets) else 0,
                             offset=start) if data is not None else np.zeros(0, np.int32)
        return flat.astype(np.int32, copy=False), byte_lengths // 4
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) or not pa.types.is_integer(
            values.type.value_type):
        raise LaneDataError(f"{where}: input_ids has type {values.type}; expected binary (what the Beam job "
                            "writes) or a list of integer ids: re-run the Beam job")
    ids = values.flatten()  # skips the sub-lists behind null rows, and the slice offset
    if ids.null_count:
        raise LaneDataError(f"{where}: row group {row_group}: input_ids holds null token ids; "
                            "the file was not written by the Beam job (re-run it)")
    lengths = np.diff(_numpy_view(values.offsets)).astype(np.int64)
    if values.null_count:  # null rows are empty documents
        valid = np.unpackbits(np.frombuffer(values.buffers()[0], np.uint8), bitorder="little")
        lengths[valid[values.offset : values.offset + len(values)] == 0] = 0
    return _numpy_view(ids).astype(np.int32, copy=False), lengths


def _partial_ids_error(byte_lengths: np.ndarray, where: str, row_group: int, wrap_ids: int) -> LaneDataError:
    """The error for the first row whose ``input_ids`` bytes are not whole int32 ids."""
    bad = int(np.flatnonzero(byte_lengths % 4)[0])
    return LaneDataError(
        f"{where}: row group {row_group}, row {bad}: input_ids holds {int(byte_lengths[bad]) - 4 * wrap_ids} bytes, "
        "not a whole number of int32 ids; the file was not written by the Beam job (re-run it)"
    )


def _numpy_view(array: pa.Array) -> np.ndarray:
    """Zero-copy numpy view of an integer array without nulls. Not ``Array.to_numpy``: that
    imports pandas when it is installed (see :func:`_binary_scalar`)."""
    dtype = np.dtype(str(array.type))  # int8 ... uint64 name numpy dtypes too
    data = array.buffers()[1]
    if data is None or not len(array):
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def feature_values(values: pa.Array, feature: Feature, block: Block, fmt: TokenFormat, where: str,
                   row_group: int) -> np.ndarray:
    """A feature column chunk (rows in replay order, as ``block``'s) laid out like the block's
    tokens, BOS/EOS values included (:func:`loader.stages.features.wrap_feature`).

    ``binary`` (what the Beam job writes): each row holds one little-endian ``feature.dtype``
    element per id of its ``input_ids`` row; ``list<int>`` is read too. Null rows are empty.
    Every row must hold exactly as many values as its ``input_ids`` row holds ids, and the
    values must lie in the feature's ``value_range``.
    """
    name = feature.column
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        values, offsets = _binary_rows(values)
        byte_lengths = np.diff(offsets).astype(np.int64)
        itemsize = feature.dtype.itemsize
        if itemsize > 1 and len(byte_lengths) and (byte_lengths % itemsize).any():
            bad = int(np.flatnonzero(byte_lengths % itemsize)[0])
            raise LaneDataError(f"{where}: row group {row_group}, row {bad}: {name} holds {int(byte_lengths[bad])} "
                                f"bytes, not a whole number of {feature.dtype} values; re-run the Beam job")
        data, start = values.buffers()[2], int(offsets[0]) if len(offsets) else 0
        count = int(offsets[-1] - start) // itemsize if len(offsets) else 0
        flat = np.frombuffer(data, dtype=feature.dtype.newbyteorder("<"), count=count, offset=start) \
            if data is not None else np.zeros(0, feature.dtype)
        lengths = byte_lengths // itemsize
    elif (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) and pa.types.is_integer(
            values.type.value_type):
        flat = values.flatten()
        if flat.null_count:
            raise LaneDataError(f"{where}: row group {row_group}: {name} holds null values; re-run the Beam job")
        flat = _numpy_view(flat)
        lengths = np.diff(_numpy_view(values.offsets)).astype(np.int64)
        if values.null_count:
            valid = np.unpackbits(np.frombuffer(values.buffers()[0], np.uint8), bitorder="little")
            lengths[valid[values.offset : values.offset + len(values)] == 0] = 0
    else:
        raise LaneDataError(f"{where}: {name} has type {values.type}; expected binary (one {feature.dtype} per "
                            "token, what the Beam job writes) or a list of integers: re-run the Beam job")
    id_lengths = np.diff(block.doc_starts) - fmt.extra
    if len(lengths) != len(id_lengths) or (lengths != id_lengths).any():
        bad = int(np.flatnonzero(lengths != id_lengths)[0]) if len(lengths) == len(id_lengths) else 0
        raise LaneDataError(f"{where}: row group {row_group}, row {bad}: {name} holds {int(lengths[bad])} values "
                            f"but input_ids holds {int(id_lengths[bad])} ids (one value per token is needed); "
                            "the file was not written by the Beam job (re-run it)")
    if feature.value_range is not None and len(flat):
        low, high = feature.value_range
        if int(flat.min()) < low or int(flat.max()) > high:
            bad = int(np.flatnonzero((flat < low) | (flat > high))[0])
            raise LaneDataError(f"{where}: row group {row_group}: {name} holds {int(flat[bad])}; its values must be "
                                f"in [{low}, {high}] (re-run the Beam job)")
    return wrap_feature(feature, flat, lengths, block.doc_starts, fmt.bos_id is not None, fmt.eos_id is not None)


def pretokenized_block(values: pa.Array, fmt: TokenFormat, where: str, row_group: int) -> Block:
    """A row group's ``input_ids`` column (rows in replay order) as a wrapped :class:`Block`.

    For the binary encoding BOS/EOS are joined onto every row by an Arrow kernel, which
    runs without the GIL: on the read-ahead thread a numpy pass would stall the trainer's
    thread for its whole length. The joined values buffer is the block's token array.
    """
    if fmt.extra and (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        if values.null_count:
            values = pc.fill_null(values, _binary_scalar(b"", values.type))
        parts = [values]
        if fmt.bos_id is not None:
            parts.insert(0, _binary_scalar(np.array([fmt.bos_id], "<i4").tobytes(), values.type))
        if fmt.eos_id is not None:
            parts.append(_binary_scalar(np.array([fmt.eos_id], "<i4").tobytes(), values.type))
        joined = pc.binary_join_element_wise(*parts, _binary_scalar(b"", values.type))
        return _joined_block(joined, where, row_group, wrap_ids=fmt.extra)
    flat, lengths = _token_rows(values, where, row_group)
    return wrap_documents(flat, lengths, fmt)


def _joined_block(joined: pa.Array, where: str, row_group: int, wrap_ids: int) -> Block:
    """The block of a freshly joined binary array (offset 0, no nulls): its byte offsets,
    divided by 4, are the document starts. Few numpy calls on purpose: on the read-ahead
    thread each call on more than a few hundred elements releases the GIL and must win it
    back from the trainer's thread, a hand-off that costs more than the call itself."""
    if len(joined) == 0:
        return Block(tokens=np.zeros(0, np.int32), doc_starts=np.zeros(1, np.int64))
    offset_type = np.int64 if pa.types.is_large_binary(joined.type) else np.int32
    offsets = np.frombuffer(joined.buffers()[1], dtype=offset_type, count=len(joined) + 1)
    if np.bitwise_or.reduce(offsets) & 3:  # offsets[0] == 0: every row is whole int32 ids
        raise _partial_ids_error(np.diff(offsets), where, row_group, wrap_ids)
    doc_starts = offsets.astype(np.int64)
    doc_starts >>= 2
    data = joined.buffers()[2]
    tokens = np.frombuffer(data, dtype="<i4", count=int(doc_starts[-1])) if data is not None else np.zeros(0, np.int32)
    return Block(tokens=tokens.astype(np.int32, copy=False), doc_starts=doc_starts)


def wrap_documents(flat_ids: np.ndarray, lengths: np.ndarray, fmt: TokenFormat) -> Block:
    """Insert BOS/EOS around each document, vectorised over the whole block.

    The special ids are written at their positions and the document ids fill the rest
    through a boolean mask: one pass over the block, without the int64 index array a
    scatter would need (this runs once per row group, ~9x faster than a scatter).
    """
    lengths = lengths.astype(np.int64, copy=False)
    num_docs = len(lengths)
    out_starts = np.zeros(num_docs + 1, dtype=np.int64)
    np.cumsum(lengths + fmt.extra, out=out_starts[1:])
    if fmt.extra == 0:
        return Block(tokens=np.asarray(flat_ids, dtype=np.int32), doc_starts=out_starts)
    out = np.empty(int(out_starts[-1]), dtype=np.int32)
    is_document_token = np.ones(len(out), dtype=bool)
    if fmt.bos_id is not None:
        out[out_starts[:-1]] = fmt.bos_id
        is_document_token[out_starts[:-1]] = False
    if fmt.eos_id is not None:
        out[out_starts[1:] - 1] = fmt.eos_id
        is_document_token[out_starts[1:] - 1] = False
    out[is_document_token] = flat_ids
    return Block(tokens=out, doc_starts=out_starts)


class LaneTokenStream:
    """Tokens of one (source, lane), epoch after epoch, addressed by a three-int cursor."""

    def __init__(
        self,
        *,
        dataset_path: str,
        manifest: Manifest,
        source_name: str,
        lane_id: int,
        seed: int,
        token_format: TokenFormat,
        tokenizer=None,  # a tokenizers.Tokenizer for text lanes; None for pre-tokenized
        max_epochs: Optional[int] = None,
        storage_options: storage.StorageOptions = storage.StorageOptions(),
        read_ahead: bool = False,
        read_ahead_threads: int = 1,
        read_ahead_blocks: int = READ_AHEAD_BLOCKS,
    ) -> None:
        self.dataset_path = dataset_path
        self.source_name = source_name
        self.lane_id = lane_id
        self.seed = seed
        self.token_format = token_format
        self.tokenizer = tokenizer
        self.max_epochs = max_epochs
        self.storage_options = storage_options
        self.pretokenized = manifest.pretokenized
        # Per-token features read with the ids: the registered columns the lane files hold
        # (the manifest's schema lists them; only pre-tokenized ids have values to align with).
        self.features: tuple[Feature, ...] = column_features(
            c.get("name") for c in manifest.schema) if self.pretokenized else ()
        if not self.pretokenized and tokenizer is None:
            raise ValueError("a tokenizer is needed for text lanes")
        self.files: list[FileEntry] = manifest.lane_files(lane_id)  # rows >= 1 each (Manifest.from_dict)
        if not storage.is_gcs(dataset_path):
            check_no_unlisted_files(dataset_path, lane_id, self.files)
        if not self.files:
            raise LaneDataError(
                f"lane {lane_id} of source {source_name!r} ({dataset_path}) has no documents: its "
                f"{MANIFEST_NAME} lists no file of the lane. The dataset has {manifest.documents} documents "
                f"in {manifest.num_lanes} lanes; "
                "re-shard it with fewer lanes (--num-lanes) so that every lane holds data."
            )
        self._row_groups: dict[int, int] = {}
        # Rows of each (file, row group) read so far (dict writes are atomic): lets the reads
        # of later epochs get their row order computed on the thread that queues them.
        self._group_rows: dict[tuple[int, int], int] = {}
        # Tokens of each row group read so far, per file, until the file's total is checked.
        self._file_group_tokens: dict[int, dict[int, int]] = {}
        self._tokens_checked: set[int] = set()
        self._epoch_blocks: dict[int, list[tuple[int, int]]] = {}
        self._open_file: tuple[int, pq.ParquetFile, object] | None = None
        self._block_key: tuple[int, int] | None = None
        self._block: Optional[Block] = None
        self.epoch = 0
        self.block_index = 0
        self.offset = 0
        self.exhausted = False
        self._restored_path: Optional[str] = None  # a restored cursor not yet checked against its block
        self.read_ahead = read_ahead
        self.read_ahead_threads = read_ahead_threads
        self.read_ahead_blocks = read_ahead_blocks  # see read_ahead_depth
        # Blocks being read in the background, in stream order: ((epoch, block), future).
        # While any is pending only the read-ahead thread touches the open Parquet file.
        self._ahead: collections.deque[tuple[tuple[int, int], Future]] = collections.deque()
        # Reads queued for this stream's drain task (at most one runs at a time), with where
        # each block lives; guarded by _unread_lock, as is _draining.
        self._unread: collections.deque[
            tuple[tuple[int, int], Future, tuple[int, int], Optional[np.ndarray]]] = collections.deque()
        self._unread_lock = threading.Lock()
        self._draining = False
        # The next block, read early by documents_ahead: ((epoch, block), Block).
        self._peeked: Optional[tuple[tuple[int, int], Block]] = None

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The features every chunk of this stream carries (registry order)."""
        return tuple(f.name for f in self.features)

    # -- state -------------------------------------------------------------------------
    def get_state(self) -> dict:
        return {"epoch": self.epoch, "block": self.block_index, "offset": self.offset, "exhausted": self.exhausted}

    def set_state(self, state: dict, path: str = "stream") -> None:
        """Continue from ``state``, checked by ``loader.checkpoint.schema`` (``ZephonLoader.load_state_dict``).

        What only the data can tell is checked when the cursor's block is first read: that
        the block exists (manifests without row-group counts) and that ``offset`` lies inside
        its tokens; a :class:`~loader.checkpoint.state.StateError` then names ``path`` (the cursor's JSON
        path in the checkpoint).
        """
        self.epoch = int(state["epoch"])
        self.block_index = int(state["block"])
        self.offset = int(state["offset"])
        self.exhausted = bool(state.get("exhausted", False))
        self._restored_path = None if self.exhausted else path
        if self._restored_path is not None and self._block_key == (self.epoch, self.block_index) \
                and self._block is not None:
            self._check_restored_cursor(self.epoch, self.block_index, self._block)

    def _check_restored_cursor(self, epoch: int, block_index: int, block: Optional[Block] = None) -> None:
        """The checks of a restored cursor that need the data (see :meth:`set_state`)."""
        from loader.checkpoint.state import StateError

        path = self._restored_path
        if (epoch, block_index) != (self.epoch, self.block_index):
            return
        blocks = len(self.blocks_of_epoch(epoch))
        if block_index >= blocks:
            raise StateError(f"{path}.block: lane {self.lane_id} of source {self.source_name!r} has {blocks} "
                             f"blocks (row groups) per epoch, so block must be in [0, {blocks - 1}] (got {block_index})")
        if block is None:
            return
        block.ensure(self.offset)
        if self.offset > len(block.tokens):
            raise StateError(f"{path}.offset: block {block_index} of epoch {epoch} (lane {self.lane_id} of source "
                             f"{self.source_name!r}) holds {len(block.tokens)} tokens, so offset must be in "
                             f"[0, {len(block.tokens)}] (got {self.offset})")
        self._restored_path = None

    # -- epoch layout ------------------------------------------------------------------
    def _num_row_groups(self, file_ordinal: int) -> int:
        if file_ordinal not in self._row_groups:
            entry = self.files[file_ordinal]
            if entry.row_groups > 0:
                self._row_groups[file_ordinal] = entry.row_groups
            else:
                self._row_groups[file_ordinal] = self._parquet(file_ordinal).metadata.num_row_groups
        return self._row_groups[file_ordinal]

    def blocks_of_epoch(self, epoch: int) -> list[tuple[int, int]]:
        """``(file_ordinal, row_group)`` pairs in the order epoch ``epoch`` replays them."""
        if epoch not in self._epoch_blocks:
            if len(self._epoch_blocks) > 2:
                self._epoch_blocks.clear()
            files = range(len(self.files))
            if epoch > 0:
                files = stable_permutation(len(self.files), self.seed, "files", self.source_name, self.lane_id, epoch)
            blocks: list[tuple[int, int]] = []
            for file_ordinal in files:
                file_ordinal = int(file_ordinal)
                count = self._num_row_groups(file_ordinal)
                groups = range(count)
                if epoch > 0:
                    groups = stable_permutation(
                        count, self.seed, "row_groups", self.source_name, self.lane_id, epoch, file_ordinal
                    )
                blocks.extend((file_ordinal, int(g)) for g in groups)
            self._epoch_blocks[epoch] = blocks
        return self._epoch_blocks[epoch]

    # -- reading -----------------------------------------------------------------------
    def _parquet(self, file_ordinal: int) -> pq.ParquetFile:
        if self._open_file is None or self._open_file[0] != file_ordinal:
            self._close_file()
            entry = self.files[file_ordinal]
            path = storage.join(self.dataset_path, entry.path)
            handle = storage.open_lane_file(self.dataset_path, entry, self.storage_options)
            try:
                if self.storage_options.verify_local_files and not storage.is_gcs(path):
                    verify_local_file(path, handle, entry)
                # pre_buffer (pyarrow's default) sends every local row-group read through
                # Arrow's I/O thread pool with an fadvise first: 150-350 us per read for
                # nothing when the file is in the page cache (bench/RESULTS.md, "Token column
                # codec and lane file access"). Remote files keep it: it coalesces ranged reads.
                parquet = pq.ParquetFile(handle, page_checksum_verification=True,
                                         pre_buffer=storage.is_gcs(self.dataset_path))
                check_footer(parquet.metadata, entry, path)
            except BaseException as exc:
                handle.close()  # pyarrow closes only sources it opened itself
                if isinstance(exc, ZephonError) or not isinstance(exc, Exception):
                    raise  # already names the file and the fix (a 403 is not corruption), or Ctrl-C
                # Whatever pyarrow raises on bad bytes (ArrowInvalid, OSError, ...) names the file.
                raise LaneDataError(
                    f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc}); it is corrupt "
                    f"or truncated: {_FIX}"
                ) from exc
            self._open_file = (file_ordinal, parquet, handle)
        return self._open_file[1]

    def close(self) -> None:
        """Release the open lane file (file descriptors are not left to the GC)."""
        self._settle_read_ahead()
        self._peeked = None
        self._close_file()

    def _close_file(self) -> None:  # also on the read-ahead thread, which must not settle itself
        if self._open_file is not None:
            _, parquet, handle = self._open_file
            parquet.close()
            handle.close()  # pyarrow closes only sources it opened itself
            self._open_file = None

    def _load_block(self, epoch: int, block_index: int) -> Block:
        if self._block_key == (epoch, block_index) and self._block is not None:
            return self._block  # checked first: this is the per-sequence path
        key = (epoch, block_index)
        if self._restored_path is not None:  # before the read: the block may not exist
            self._check_restored_cursor(epoch, block_index)
        block = None
        if self._peeked is not None and self._peeked[0] == key:
            block, self._peeked = self._peeked[1], None
        else:
            block = self._settle_read_ahead(wanted=key)
        if block is None:
            block = self._read_block(epoch, *self.blocks_of_epoch(epoch)[block_index])
        self._block_key, self._block = key, block
        if self._restored_path is not None:
            self._check_restored_cursor(epoch, block_index, block)
        if self.read_ahead:
            self._start_read_ahead(epoch, block_index)
        return block

    def _next_block_key(self, epoch: int, block_index: int) -> Optional[tuple[int, int]]:
        if block_index + 1 < len(self.blocks_of_epoch(epoch)):
            return epoch, block_index + 1
        if self.max_epochs is not None and epoch + 1 >= self.max_epochs:
            return None
        return epoch + 1, 0

    def _start_read_ahead(self, epoch: int, block_index: int) -> None:
        """Queue reads of the blocks after ``(epoch, block_index)``, ``read_ahead_blocks`` of them."""
        key = (epoch, block_index)
        for _ in range(self.read_ahead_blocks):
            key = self._next_block_key(*key)
            if key is None:
                return
            if any(pending == key for pending, _ in self._ahead):
                continue
            future: Future = Future()
            self._ahead.append((key, future))
            # The epoch layout is looked up on this thread: the reader gets file and row group.
            where = self.blocks_of_epoch(key[0])[key[1]]
            # The row order is ~a dozen NumPy calls: on the read-ahead thread each is a GIL
            # hand-off with this thread, so it is computed here when the size is known.
            rows = self._group_rows.get(where)
            order = self._row_order(key[0], *where, rows) if key[0] > 0 and rows is not None else None
            with self._unread_lock:
                self._unread.append((key, future, where, order))
                start = not self._draining
                self._draining = True
            if start:
                _read_ahead_pool(self.read_ahead_threads).submit(self._drain_reads)

    def _drain_reads(self) -> None:
        """On a read-ahead thread: this stream's queued reads, in order, until none is left."""
        while True:
            with self._unread_lock:
                if not self._unread:
                    self._draining = False
                    return
                (epoch, _), future, where, order = self._unread.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # dropped by _settle_read_ahead before it started
            try:
                future.set_result(self._read_block(epoch, *where, order=order))
            except BaseException as exc:  # handed to whoever waits for the block
                future.set_exception(exc)

    def wait_for_read_ahead(self) -> None:
        """Block until every read queued ahead has finished (the blocks stay queued)."""
        wait([future for _, future in self._ahead])

    def _settle_read_ahead(self, wanted: Optional[tuple[int, int]] = None) -> Optional[Block]:
        """The block ``wanted`` if it is the next one read ahead, else None (all reads dropped).

        Reads that turn out not to be wanted (after ``set_state``) are waited for and
        dropped, errors and all: only blocks the stream really reads may fail it.
        """
        if self._ahead and self._ahead[0][0] == wanted:
            return self._ahead.popleft()[1].result()  # a read error surfaces here, as from a direct read
        while self._ahead:
            _, future = self._ahead.popleft()
            if not future.cancel():  # already running or done: wait, and drop its error
                future.exception()
        return None

    def _row_order(self, epoch: int, file_ordinal: int, row_group: int, rows: int) -> np.ndarray:
        """The order epoch ``epoch`` replays the rows of a row group in (int64)."""
        return stable_permutation(rows, self.seed, "rows", self.source_name, self.lane_id, epoch, file_ordinal, row_group)

    def _read_block(self, epoch: int, file_ordinal: int, row_group: int, order: Optional[np.ndarray] = None) -> Block:
        """``order``: the row order of ``epoch`` > 0 if already computed (else computed here).

        Errors name the file and row group; on a read-ahead thread they travel in the read's
        future and are raised to whoever takes the block (in a worker process, inside the
        ``WorkerError`` that carries the worker's traceback).
        """
        entry = self.files[file_ordinal]
        path = storage.join(self.dataset_path, entry.path)
        column = "input_ids" if self.pretokenized else "text"
        try:
            parquet = self._parquet(file_ordinal)
            # One column: pyarrow's thread pool parallelises across columns, so for us it is
            # only a hand-off (and more threads per worker process); ~8% less CPU without.
            columns = [column] + [f.column for f in self.features]
            table = parquet.read_row_group(row_group, columns=columns, use_threads=False)
            # combine_chunks copies even a single chunk
            values, *feature_columns = [c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in table.columns]
            check_row_group(len(values), parquet.metadata, row_group, path)
            self._group_rows[(file_ordinal, row_group)] = len(values)
            if epoch > 0:
                if order is None or len(order) != len(values):
                    order = self._row_order(epoch, file_ordinal, row_group, len(values))
                # Arrow's take copies the rows in C++ without the GIL (on the read-ahead thread a
                # Python loop over the rows would stall the trainer's thread). Indices from the
                # buffer: pa.array(ndarray) imports pandas when it is installed, a fraction of a
                # second on the first call, paid by a restore's first batch.
                indices = pa.Array.from_buffers(pa.int64(), len(order), [None, pa.py_buffer(order)])
                values = pc.take(values, indices)
                feature_columns = [pc.take(c, indices) for c in feature_columns]
            if not self.pretokenized:
                return TextBlock(values.to_pylist(), self.tokenizer, self.token_format)
            block = pretokenized_block(values, self.token_format, path, row_group)
            if self.features:
                block.features = {f.name: feature_values(c, f, block, self.token_format, path, row_group)
                                  for f, c in zip(self.features, feature_columns)}
        except ZephonError:
            raise  # already names the file (a StorageError also says what to do about storage)
        except Exception as exc:  # whatever pyarrow or numpy raise on bad bytes
            raise LaneDataError(
                f"{path}: row group {row_group} cannot be read ({type(exc).__name__}: {exc}); the file is "
                f"corrupt: {_FIX}"
            ) from exc
        documents = len(block.doc_starts) - 1
        self._note_group_tokens(file_ordinal, row_group, len(block.tokens) - self.token_format.extra * documents)
        return block

    def _note_group_tokens(self, file_ordinal: int, row_group: int, tokens: int) -> None:
        """Once every row group of a file has been read, its tokens must be the manifest's."""
        if file_ordinal in self._tokens_checked:
            return
        seen = self._file_group_tokens.setdefault(file_ordinal, {})
        seen[row_group] = tokens
        if len(seen) < self._num_row_groups(file_ordinal):
            return
        entry = self.files[file_ordinal]
        total = sum(seen.values())
        del self._file_group_tokens[file_ordinal]
        self._tokens_checked.add(file_ordinal)
        if entry.tokens is not None and total != entry.tokens:
            raise LaneDataError(
                f"{storage.join(self.dataset_path, entry.path)}: its {len(seen)} row groups hold {total} tokens, "
                f"the manifest says {entry.tokens}: the file or the manifest is corrupt; {_FIX}"
            )

    def _advance_block(self) -> None:
        self.block_index += 1
        self.offset = 0
        if self.block_index >= len(self.blocks_of_epoch(self.epoch)):
            self.epoch += 1
            self.block_index = 0
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                self.exhausted = True

    def at_document_start(self) -> bool:
        """True when the next token is a document's first (or nothing is left)."""
        if self.exhausted or self.offset == 0:
            return True
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset)
        k = np.searchsorted(block.doc_starts, self.offset)
        return k < len(block.doc_starts) and block.doc_starts[k] == self.offset

    def documents_ahead(self, min_tokens: int) -> Optional[DocumentsView]:
        """The documents a bulk reader may take from the cursor on (see :class:`DocumentsView`).

        The current block is tokenized to at least ``min_tokens`` past the cursor (text); the
        next block joins the view only when fewer than ``min_tokens`` are left in this one.
        None when the stream is exhausted.
        """
        if self.exhausted:
            return None
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset + min_tokens)
        blocks, starts, features = [block.tokens], block.doc_starts, [block.features]
        short = len(block.tokens) - self.offset < min_tokens  # else the next block is not needed yet
        if short and block.complete and self.block_index + 1 < len(self.blocks_of_epoch(self.epoch)):
            following = self._next_block_in_epoch()
            # A text block is tokenized only once the cursor reaches it: tokenizing it here
            # would front-load work (first batch, restore) for every lane at once.
            if following.complete:
                blocks.append(following.tokens)
                features.append(following.features)
                starts = np.concatenate([starts[:-1], following.doc_starts + len(block.tokens)])
        lo = starts.searchsorted(self.offset, side="right")
        hi = starts.searchsorted(sum(len(b) for b in blocks), side="left")
        return DocumentsView(blocks=blocks, cursor=self.offset, ends=starts[lo:hi],
                             epoch=self.epoch, block_index=self.block_index, features=tuple(features))

    def _next_block_in_epoch(self) -> Block:
        """The block after the current one (same epoch), kept until the cursor gets there."""
        key = (self.epoch, self.block_index + 1)
        if self._peeked is not None and self._peeked[0] == key:
            return self._peeked[1]
        block = self._settle_read_ahead(wanted=key)  # the read-ahead's head, or nothing pending
        if block is None:
            block = self._read_block(key[0], *self.blocks_of_epoch(key[0])[key[1]])
        self._peeked = (key, block)
        return block

    def move_to(self, view: DocumentsView, position: int) -> None:
        """Put the cursor at a virtual position of ``view`` (bulk readers)."""
        self.block_index, self.offset = view.where(position)

    def state_at(self, view: DocumentsView, position: int) -> dict:
        """The state with the cursor at a virtual position of ``view``."""
        block_index, offset = view.where(position)
        return {"epoch": view.epoch, "block": block_index, "offset": offset, "exhausted": False}

    def rewound_state(self, rows: int, row_len: int) -> dict:
        """The state before the last ``rows`` rows of ``row_len`` (all in the current block)."""
        return dict(self.get_state(), offset=self.offset - rows * row_len)

    def take_rows(self, row_len: int, max_rows: int) -> Optional[Chunk]:
        """Up to ``max_rows`` whole rows of ``row_len`` tokens from the current block, or None.

        The bulk form of ``take(row_len)`` repeated: it returns only rows that end strictly
        inside the current block (so the cursor stays in the block and one subtraction undoes
        the rows not used yet) and None when not even one row does; the caller then falls
        back to :meth:`take`. ``tokens`` has length ``k * row_len``.
        """
        if self.exhausted:
            return None
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset + row_len)
        offset = self.offset
        rows = min(max_rows, (len(block.tokens) - offset - 1) // row_len)
        if rows < 1:
            return None
        end = offset + rows * row_len
        self.offset = end
        doc_starts = block.doc_starts
        lo, hi = doc_starts.searchsorted(offset), doc_starts.searchsorted(end)
        return Chunk(tokens=block.tokens[offset:end], doc_starts=doc_starts[lo:hi] - offset,
                     features=slice_features(block.features, offset, end))

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        """Up to ``n`` tokens from the cursor on (fewer only at exhaustion or a document end).

        With ``within_document`` the chunk stops at the end of the current document. Returns
        None when the stream is exhausted.
        """
        if self.exhausted:
            return None
        # Fast path, nearly every call: the chunk lies inside the current block and does not
        # reach its end (so no block change can follow).
        block = self._load_block(self.epoch, self.block_index)
        block.ensure(self.offset + n)
        offset, doc_starts = self.offset, block.doc_starts
        if offset < len(block.tokens):
            end = offset + n
            if within_document:
                end = min(end, int(doc_starts[doc_starts.searchsorted(offset, side="right")]))
            if offset < end < len(block.tokens):
                self.offset = end
                lo, hi = doc_starts.searchsorted(offset), doc_starts.searchsorted(end)
                return Chunk(tokens=block.tokens[offset:end], doc_starts=doc_starts[lo:hi] - offset,
                             features=slice_features(block.features, offset, end))
        pieces: list[np.ndarray] = []
        feature_pieces: list = []
        starts: list[np.ndarray] = []
        taken = 0
        while taken < n and not self.exhausted:
            block = self._load_block(self.epoch, self.block_index)
            offset = self.offset
            block.ensure(offset + n - taken)  # so that a short block means its real end
            tokens, doc_starts = block.tokens, block.doc_starts
            available = len(tokens) - offset
            if available <= 0:
                self._advance_block()
                continue
            count = min(n - taken, available)
            if within_document:
                next_doc = int(doc_starts[doc_starts.searchsorted(offset, side="right")])
                count = min(count, next_doc - offset)
            lo = doc_starts.searchsorted(offset)
            hi = doc_starts.searchsorted(offset + count)
            pieces.append(tokens[offset : offset + count])
            feature_pieces.append(slice_features(block.features, offset, offset + count))
            starts.append(doc_starts[lo:hi] - (offset - taken))
            self.offset = offset + count
            taken += count
            if self.offset >= len(tokens):
                self._advance_block()
            if within_document:
                break
        if taken == 0:
            return None
        tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        doc_starts = starts[0] if len(starts) == 1 else np.concatenate(starts)
        features = feature_pieces[0]
        if len(feature_pieces) > 1 and features:  # a stream's blocks all carry its features
            features = {name: np.concatenate([f[name] for f in feature_pieces]) for name in features}
        return Chunk(tokens=tokens, doc_starts=doc_starts, features=features)
