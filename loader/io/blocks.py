"""Blocks: a row group's documents decoded into one token array, and the chunks taken from it.

A block holds every document of one row group as ``[bos] + ids + [eos]`` (as configured),
back to back, with the offsets where documents start, plus the per-token feature arrays
(:mod:`loader.stages.features`) aligned with the tokens. A lane's kind
(:mod:`loader.kinds`) turns a row group's column values into a block, with the types here.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from loader.errors import LaneDataError
from loader.stages.features import NO_FEATURES, Feature, wrap_feature


@dataclass(frozen=True)
class TokenFormat:
    """How documents become tokens: the ids wrapped around every document."""

    bos_id: Optional[int]  # None: no BOS
    eos_id: Optional[int]  # None: no EOS

    @property
    def extra(self) -> int:
        return int(self.bos_id is not None) + int(self.eos_id is not None)


# Text blocks are tokenized as the cursor reaches them, in calls that start at this many
# characters (~2 sequences of 2048 tokens) and double each call: a row group holds up to
# 1 MiB of text, and tokenizing it in one call made the first batch, a restore and every
# block change wait for the whole group. The calls grow because many small ones serialise:
# with fixed 64 KiB calls ~20% of the tokenizer's CPU time ran on the calling thread, outside
# its thread pool; doubling calls (6-7 per row group) keep that small. Starting at 64 KiB
# instead of 16 KiB cost a fresh text loader 2.5x the CPU to its first batch (every lane
# of the batch tokenizes its first call: 0.51-0.58 s against 0.17-0.26 s; bench/HISTORY.md,
# "worker changes (helper A/B pairs, load 2-16)").
TOKENIZE_CHARS = 16 * 1024
# ...up to this much text per tokenizer thread: larger calls made a worker (one thread) stop
# delivering for 100-700 ms at a time, which its prefetch could not cover (text, 2 workers, busy
# trainer: 1.1 M tok/s in bursts, 1.7 M tok/s with the cap and a deeper prefetch; in-process,
# two threads, the cap cost nothing measurable: bench/HISTORY.md, "issue 16, text with
# workers").
MAX_TOKENIZE_CHARS_PER_THREAD = 64 * 1024


def tokenizer_threads() -> int:
    """The tokenizer's thread pool size in this process (``RAYON_NUM_THREADS``, which the
    worker pool sets per worker, else one thread per core)."""
    try:
        return max(1, int(os.environ.get("RAYON_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


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
    transform_counts: Optional[object] = None  # what the source's transforms did to the row group (loader.transforms)
    # Documents refused while decoding, per reason (``{reason: count}``, complete after ``ensure``),
    # in a block that refuses online (chat, images: ``LaneKind.rejects_online``); None: it refuses none.
    reject_counts = None

    def ensure(self, position: int) -> None:
        """Make ``tokens`` extend past ``position``, or hold the whole block."""

    def prepare(self) -> None:
        """Do now, on the prepare thread (:func:`loader.io.read_ahead.prepare_later`), work that
        ``ensure`` would do when the stream reaches the block, until :meth:`claim` is called."""

    def claim(self) -> None:
        """The stream takes the block from the read-ahead: from now on only the stream's thread
        touches it. Waits for a :meth:`prepare` in progress; none starts after it."""


class TextBlock(Block):
    """A text row group, tokenized lazily, whole documents per call (see ``TOKENIZE_CHARS``).

    Not prepared ahead (:meth:`Block.prepare`): the stream's own calls already run on the
    tokenizer's thread pool, and tokenizing read-ahead blocks on the prepare thread cost 16%
    more CPU per token in-process for no gain in tokens/s (bench/HISTORY.md, "issue 17, online
    chat")."""

    def __init__(self, texts: list, tokenizer, token_format: TokenFormat) -> None:
        super().__init__(tokens=np.zeros(0, dtype=np.int32), doc_starts=np.zeros(1, dtype=np.int64),
                         complete=not texts)
        self._texts = texts
        self.documents = len(texts)
        # Kept after the block is complete: a cursor's document names where its text starts.
        self._char_ends = np.cumsum([len(t) for t in texts]) if texts else np.zeros(0, dtype=np.int64)
        self._next = 0  # first document not tokenized yet
        self._chars = TOKENIZE_CHARS  # text of the next call
        self._max_chars = MAX_TOKENIZE_CHARS_PER_THREAD * tokenizer_threads()
        self._tokenizer = tokenizer
        self._format = token_format

    def ensure(self, position: int) -> None:
        while not self.complete and len(self.tokens) <= position:
            self._tokenize_more()

    def char_start(self, document: int) -> int:
        """Where ``document``'s text starts in the row group's text (its documents back to back)."""
        return int(self._char_ends[document - 1]) if document > 0 else 0

    def document_at(self, offset: int) -> dict:
        """A cursor's ``document`` (its stream state; see :func:`cursor_document`): the index,
        first token and first character of the document a cursor at ``offset`` is in. The
        character binds the index to the data (a restore checks it before it trusts the rest)."""
        index, token_start = cursor_document(self.doc_starts, offset)
        return {"index": index, "token_start": token_start, "char_start": self.char_start(index)}

    @property
    def untouched(self) -> bool:
        """Nothing tokenized yet (:meth:`skip_to` may still be called)."""
        return self._next == 0 and not self.complete

    def skip_to(self, document: int, token_start: int) -> None:
        """Tokenize from ``document`` on, whose first token is ``token_start`` in the block: a
        restored cursor's :func:`cursor_document`, so that a restore tokenizes from the cursor's
        document, not from the start of the row group (up to ~230 K tokens per lane, which
        every lane of a resumed rank paid before its first sequence: bench/HISTORY.md, "Issue 16:
        the harness audit").

        The documents before it are never read again by the restored stream (every cursor is
        at or after ``token_start``). Their token positions hold zeros, and their
        ``doc_starts`` entries zeros too: all of them below ``token_start``, so a search for
        any position at or after it finds the same index as in the whole block (and document
        indices, which name rows, stay those of the whole block). Tokenizing a document does
        not depend on the others, so the tokens from ``token_start`` on are the whole block's.
        """
        if not self.untouched:
            raise RuntimeError("internal error: skip_to on a text block already tokenized")
        self.tokens = np.zeros(token_start, dtype=np.int32)
        self.doc_starts = np.zeros(document + 1, dtype=np.int64)
        self.doc_starts[document] = token_start
        self._next = document
        if document == len(self._texts):
            self.complete = True
            self._texts = None

    def _tokenize_more(self) -> None:
        start = self._next
        chars_before = int(self._char_ends[start - 1]) if start else 0
        end = int(np.searchsorted(self._char_ends, chars_before + self._chars, side="right"))
        end = min(max(end, start + 1), len(self._texts))
        self._chars = min(2 * self._chars, self._max_chars)
        flat, lengths = tokenize_documents(self._tokenizer, self._texts[start:end])
        part = wrap_documents(flat, lengths, self._format)
        # New arrays, not in-place growth: chunks already taken are views of the old ones.
        self.doc_starts = np.concatenate([self.doc_starts[:-1], part.doc_starts + len(self.tokens)])
        self.tokens = np.concatenate([self.tokens, part.tokens])
        self._next = end
        if end == len(self._texts):
            self.complete = True
            self._texts = None


def cursor_document(doc_starts: np.ndarray, offset: int) -> tuple[int, int]:
    """``(index, first token)`` of the document a cursor at ``offset`` is in (the next one's
    start when it stands at a document boundary; the first of several empty documents at one
    position). A text stream's state carries it (``document``: :meth:`TextBlock.document_at`), for
    :meth:`TextBlock.skip_to`."""
    start = int(doc_starts[doc_starts.searchsorted(offset, side="right") - 1])
    return int(doc_starts.searchsorted(start, side="left")), start


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


def tokenize_documents(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, lengths)``: every text's ids, one flat int32 array, and each text's length (int64).

    The one tokenization of documents, offline (the Beam job's ``--tokenizer``) and online (the
    loader's text blocks, the audit's lengths, image documents' text parts), so the two cannot
    differ. ``encode_batch_fast`` gives ``encode``'s ids (it only skips character offsets) on all
    cores; no special tokens, because the token format adds BOS/EOS the same way for both.
    """
    id_lists = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)] if texts else []
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


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
