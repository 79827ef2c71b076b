"""Packing: documents of a token stream into fixed-length sequences.

Two modes, one output type (:class:`PackedSequence`):

``concat``
    Documents (already wrapped in BOS/EOS by the stream) are joined and cut every
    ``seq_len`` tokens; the remainder carries into the next sequence. The packer holds no
    tokens: its whole state is the stream's cursor.

``best_fit``
    Documents are never split unless longer than ``seq_len`` (then they are cut into
    ``seq_len`` pieces, the last piece placed like a document). Up to ``open_bins`` bins
    stay open; a piece goes to the open bin with the least room that still fits it; when
    none fits and all bins are open, the fullest bin (oldest on ties) is emitted padded
    and a new bin opened. The state holds the open bins' tokens: bounded by
    ``open_bins x seq_len`` ids per lane and source.

Labels follow the Hugging Face convention (the model shifts them): ``labels == input_ids``
except ``-100`` on padding and on the first token of every document, which no token of the
same document predicts. ``segment_starts`` mark where position ids restart (every document
or document piece, and the padding tail), from which the batch builds ``position_ids`` and
``cu_seqlens``. Per-token features (:mod:`loader.stages.features`) travel with the tokens through
cuts, carries and bins; a feature with a label rule (``loss_mask``) adds ``-100`` where it
is 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

import numpy as np

from loader.checkpoint.records import StateSnapshot
from loader.errors import StateError
from loader.io.blocks import Chunk
from loader.io.lane_reader import LaneTokenStream
from loader.order.best_fit import OpenBins
from loader.stages.features import FEATURES, IGNORE_INDEX, NO_FEATURES, in_order, lay_out, mask_labels
from loader.stages.stream import TokenStream
from loader.stages.packer_records import (
    BINS, DOC_STARTS, PIECE_ORIGINS, PIECE_STARTS, SERIAL, STREAM, TOKENS, best_fit_state, concat_state,
)


@dataclass
class PackedSequence:
    input_ids: np.ndarray  # int32 [seq_len]
    labels: np.ndarray  # int32 [seq_len]
    segment_starts: np.ndarray  # int32, sorted, starts with 0
    features: Mapping[str, np.ndarray] = NO_FEATURES  # name -> [seq_len] (loader.stages.features), pad values on padding
    majority_source: int = -1  # token-unit mixing: the source with most tokens, if counted already
    padding: int = 0  # pad tokens at the tail (loader.metrics counts them; full concat rows have none)
    images: Optional[object] = None  # image sources: the pixels of its image refs (loader.vision.resolve)

    @property
    def token_sources(self) -> Optional[np.ndarray]:
        """int8 [seq_len] source of every token (-1 on padding), token-unit mixing only."""
        return self.features.get("token_sources")


class _ConcatFill:
    """Rows cut in bulk from one block (see :meth:`ConcatPacker._fill`): a ``[rows, seq_len]``
    view of the block's tokens. Where documents start in each row is worked out on first
    request: a batch of ``input_ids`` alone never asks."""

    __slots__ = ("input_ids", "features", "majority", "_fill_doc_starts", "_doc_starts", "_doc_bounds")

    def __init__(self, chunk: Chunk, rows: int, seq_len: int) -> None:
        self.input_ids = chunk.tokens.reshape(rows, seq_len)
        self.features = {name: values.reshape(rows, seq_len) for name, values in chunk.features.items()} \
            if chunk.features else None
        self.majority = chunk.row_majority
        self._fill_doc_starts = chunk.doc_starts  # int64, offsets in the fill
        self._doc_starts: Optional[np.ndarray] = None
        self._doc_bounds: list[int] = []

    def row_features(self, row: int) -> Mapping[str, np.ndarray]:
        return NO_FEATURES if self.features is None else {n: v[row] for n, v in self.features.items()}

    def row_doc_starts(self, row: int) -> np.ndarray:
        if self._doc_starts is None:
            rows, seq_len = self.input_ids.shape
            starts = self._fill_doc_starts
            self._doc_bounds = starts.searchsorted(np.arange(0, (rows + 1) * seq_len, seq_len)).tolist()
            self._doc_starts = (starts % seq_len).astype(np.int32)
        return self._doc_starts[self._doc_bounds[row] : self._doc_bounds[row + 1]]


class ConcatRow(PackedSequence):
    """A full concat row of a :class:`_ConcatFill`: ``labels`` and ``segment_starts`` are
    derived on demand from where its documents start (a full row has no padding).

    The batch builder (``ZephonLoader._collate``) derives labels, position ids and
    cu_seqlens of a whole micro-batch of such rows from ``doc_starts`` in one pass instead
    of building per-row arrays.
    """

    def __init__(self, fill: _ConcatFill, row: int) -> None:
        self.input_ids = fill.input_ids[row]
        self.features = fill.row_features(row)
        self.majority_source = -1 if fill.majority is None else fill.majority[row]
        self._fill, self._row = fill, row

    @property
    def doc_starts(self) -> np.ndarray:
        """int32 offsets in the row where a document begins."""
        return self._fill.row_doc_starts(self._row)

    @property
    def segment_starts(self) -> np.ndarray:  # type: ignore[override]
        # The row start and every document start; concat wraps documents (BOS or EOS), so the
        # document starts are distinct, and np.unique covers the general case.
        starts = self.doc_starts
        if len(starts) > 1 and not (starts[1:] > starts[:-1]).all():
            starts = np.unique(starts)
        if len(starts) and starts[0] == 0:
            return starts
        return np.concatenate((_ZERO, starts), dtype=np.int32)

    @property
    def labels(self) -> np.ndarray:  # type: ignore[override]
        labels = self.input_ids.astype(np.int32, copy=True)
        labels[self.doc_starts] = IGNORE_INDEX
        if self.features:
            mask_labels(labels, self.features)
        return labels


_ZERO = np.zeros(1, dtype=np.int64)


def _sequence_from_chunk(chunk: Chunk, seq_len: int, pad_id: int) -> Optional[PackedSequence]:
    """The one-piece case of :func:`_sequence_from_pieces` (every concat sequence) without
    the per-piece loop and ``np.unique``: a chunk's ``doc_starts`` are already sorted, so the
    segment starts are ``0``, the document starts and the padding start, in that order.
    Returns None when the starts repeat (empty documents with no BOS/EOS); the general path
    removes the duplicates.
    """
    tokens, doc_starts = chunk.tokens, chunk.doc_starts
    n = len(tokens)
    if len(doc_starts) > 1 and not (doc_starts[1:] > doc_starts[:-1]).all():
        return None
    if n == seq_len:
        input_ids = tokens.astype(np.int32, copy=True)
    else:
        input_ids = np.full(seq_len, pad_id, dtype=np.int32)
        input_ids[:n] = tokens
    labels = input_ids.copy()
    labels[doc_starts] = IGNORE_INDEX
    labels[n:] = IGNORE_INDEX
    parts = [doc_starts]
    if not len(doc_starts) or doc_starts[0] != 0:
        parts.insert(0, _ZERO)
    if n < seq_len:
        parts.append(np.array([n], dtype=np.int64))
    segment_starts = np.concatenate(parts, dtype=np.int32)
    return PackedSequence(input_ids=input_ids, labels=labels, segment_starts=segment_starts, padding=seq_len - n)


def _sequence_from_pieces(
    pieces: list[Chunk], seq_len: int, pad_id: int, piece_segment_starts: bool, features: tuple[str, ...] = ()
) -> PackedSequence:
    """Lay pieces out back to back, pad the tail, derive labels and segments. ``features``:
    the loader's per-token features, laid out even where the pieces lack them (a source
    without the feature: its default on the tokens, its pad value on the padding)."""
    if len(pieces) == 1 and not pieces[0].features and not features:
        # A single piece's own start is 0, a segment start anyway: piece_segment_starts
        # adds nothing.
        sequence = _sequence_from_chunk(pieces[0], seq_len, pad_id)
        if sequence is not None:
            return sequence
    used = sum(len(p.tokens) for p in pieces)
    input_ids = np.full(seq_len, pad_id, dtype=np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
    segments: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    at = 0
    for piece in pieces:
        n = len(piece.tokens)
        input_ids[at : at + n] = piece.tokens
        labels[at : at + n] = piece.tokens
        doc_starts = piece.doc_starts + at
        labels[doc_starts] = IGNORE_INDEX
        segments.append(doc_starts)
        if piece_segment_starts:
            segments.append(np.array([at], dtype=np.int64))
        at += n
    if used < seq_len:
        segments.append(np.array([used], dtype=np.int64))
    segment_starts = np.unique(np.concatenate(segments)).astype(np.int32)
    laid_out = NO_FEATURES
    names = in_order([*features, *(name for p in pieces for name in p.features)])
    if names:
        laid_out = lay_out(names, [p.features for p in pieces], [len(p.tokens) for p in pieces], seq_len)
        mask_labels(labels, laid_out)
    return PackedSequence(input_ids=input_ids, labels=labels, segment_starts=segment_starts, features=laid_out,
                          padding=seq_len - used)


class ConcatPacker:
    """State keys (its record, ``concat``: :mod:`loader.stages.packer_records`): ``stream`` (the
    stream cursor). Holds no tokens.

    Rows that lie inside one block are cut in bulk (:meth:`_fill`: up to ``FILL_TOKENS``
    tokens, one reshape, views of the block) and handed out one by one as :class:`ConcatRow`;
    the per-sequence work was what capped pre-tokenized replay. Rows cut but not handed out yet
    are not part of the state: ``get_state`` moves the cursor back over them, so a
    checkpoint is the same whether or not a fill was in flight.
    """

    # Tokens per fill (at least one row): fewer, larger fills were faster than 16 Ki in A/B runs
    # at seq_len 1024; the fill's arrays are a few hundred KiB per lane and source.
    FILL_TOKENS = 1 << 16

    def __init__(self, stream: TokenStream, seq_len: int, pad_id: int, features: tuple[str, ...] = ()) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.features = features  # the loader's (see _sequence_from_pieces); full rows need none
        self._bulk = True  # cut rows in bulk where the stream can (take_rows); tests switch it off to compare
        # The current fill: rows ``_next_row .. _fill_rows - 1`` are not handed out yet.
        self._fill_rows = self._next_row = 0
        self._cut_rows: Optional[_ConcatFill] = None  # the current fill

    def next_sequence(self) -> Optional[PackedSequence]:
        """The next ``seq_len`` tokens; a short final sequence is padded; None when exhausted."""
        if self._next_row < self._fill_rows or (self._bulk and self._fill()):
            self._next_row += 1
            return ConcatRow(self._cut_rows, self._next_row - 1)
        chunk = self.stream.take(self.seq_len)
        if chunk is None:
            return None
        return _sequence_from_pieces([chunk], self.seq_len, self.pad_id, piece_segment_starts=False,
                                     features=self.features)

    def rows_waiting(self) -> int:
        """Rows of the current fill not handed out yet; when the fill is used up, the next one
        is cut first (0: the next sequence is not a bulk row: :meth:`next_sequence` makes it)."""
        if self._next_row == self._fill_rows and self._bulk:
            self._fill()
        return self._fill_rows - self._next_row

    def take_fill_row(self) -> tuple["_ConcatFill", int]:
        """The next sequence as ``(fill, row)`` without a :class:`ConcatRow` (after :meth:`rows_waiting`
        said there is one): the loader's bulk path builds a micro-batch from these."""
        row = self._next_row
        self._next_row = row + 1
        return self._cut_rows, row

    def _fill(self) -> bool:
        seq_len = self.seq_len
        chunk = self.stream.take_rows(seq_len, max(1, self.FILL_TOKENS // seq_len))
        if chunk is None:
            return False
        rows = len(chunk.tokens) // seq_len
        self._cut_rows = _ConcatFill(chunk, rows, seq_len)
        self._fill_rows, self._next_row = rows, 0
        return True

    def get_state(self) -> dict:
        waiting = self._fill_rows - self._next_row
        if waiting:  # rows cut but not handed out: the stream's state before them
            return {STREAM: self.stream.rewound_state(waiting, self.seq_len)}
        return {STREAM: self.stream.get_state()}

    def snapshot(self) -> dict:
        """The state as of now where a worker ships it (:meth:`get_state`: a concat state is small)."""
        return self.get_state()

    def cursor_snapshot(self) -> "StateSnapshot | dict":
        """``get_state()`` as of now, as four integers until it is saved: the loader takes one
        per lane at every step boundary (building the dicts there was ~15% of in-process
        replay with one micro-batch per step). Transform counters, a text cursor's document,
        and a token mix's streams (a ``MixedTokenStream``: one cursor per source), are built now."""
        stream = self.stream
        if not isinstance(stream, LaneTokenStream) or not stream.state_is_cursor:
            return self.get_state()
        return StateSnapshot(concat_state, *self.cursor())

    def cursor(self) -> tuple[int, int, int, bool]:
        """``(epoch, block, offset, exhausted)`` of a plain stream's state as of now (rows cut but
        not handed out moved back over, as :meth:`get_state` does): :func:`concat_state`'s arguments."""
        stream = self.stream
        offset = stream.offset - (self._fill_rows - self._next_row) * self.seq_len
        return stream.epoch, stream.block_index, offset, stream.exhausted

    def set_state(self, state: dict, path: str = "packer") -> None:
        """``state`` as checked by ``loader.checkpoint.schema``; ``path``: its JSON path, for errors."""
        self._fill_rows = self._next_row = 0
        self._cut_rows = None
        self.stream.set_state(state[STREAM], path=f"{path}.{STREAM}")


class _Piece:
    """A piece an open bin holds, read like a :class:`Chunk` (``tokens``, ``doc_starts``,
    ``features``): ``tokens`` a view of its bin's own buffer (a view of the source block would keep
    the whole block alive while the bin is open), features copies, and ``origin``: the stream
    cursor ``(epoch, block, offset)`` of its first token, None where unknown (restored from a
    version-1 state); ``begins``: True when ``doc_starts`` is ``[0]``, False when it is empty,
    None otherwise (documents the general layout handles). A slotted class: building the frozen
    ``Chunk`` dataclass cost more than the origin adds."""

    __slots__ = ("tokens", "doc_starts", "features", "origin", "begins")

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, features: Mapping[str, np.ndarray],
                 origin: Optional[tuple[int, int, int]], begins: Optional[bool]) -> None:
        self.tokens, self.doc_starts, self.features, self.origin = tokens, doc_starts, features, origin
        self.begins = begins


def _begins(doc_starts: np.ndarray) -> Optional[bool]:
    """:attr:`_Piece.begins` of a piece's ``doc_starts``."""
    if not len(doc_starts):
        return False
    return True if len(doc_starts) == 1 and doc_starts[0] == 0 else None


def _read_only(values) -> np.ndarray:
    array = np.array(values, dtype=np.int64)
    array.flags.writeable = False
    return array


_STARTS_DOCUMENT = _read_only([0])  # a piece's doc_starts: shared, never written
_INSIDE_DOCUMENT = _read_only([])


class _BlockPieces:
    """The document pieces of one block of a :class:`LaneTokenStream` from a cursor on, as
    ``take(seq_len, within_document=True)`` would return them one by one, computed in bulk:
    starts, ends and whether each begins a document (Python lists), only pieces that end
    strictly inside the block (``take``'s fast path: the last piece, and the block change after
    it, are left to ``take``)."""

    __slots__ = ("block", "key", "starts", "ends", "begins", "next")

    def __init__(self, block, key: tuple[int, int], offset: int, seq_len: int) -> None:
        self.block, self.key, self.next = block, key, 0
        doc_starts = block.doc_starts
        first = int(doc_starts.searchsorted(offset, side="right"))
        bounds = doc_starts[first - 1 :].copy()
        bounds[0] = offset  # the document under the cursor, from the cursor on
        lengths = np.diff(bounds)
        counts = -(-lengths // seq_len)  # pieces per document (an empty document has none)
        total = int(counts.sum())
        doc = np.repeat(np.arange(len(lengths)), counts)
        # k-th piece of its document: its index minus the document's first piece index.
        k = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = bounds[doc] + k * seq_len
        ends = np.minimum(starts + seq_len, bounds[doc + 1])
        inside = ends < len(block.tokens)
        begins = (k == 0) & ((doc > 0) | (offset == doc_starts[first - 1]))
        self.starts = starts[inside].tolist()
        self.ends = ends[inside].tolist()
        self.begins = begins[inside].tolist()


class BestFitPacker:
    """State keys (its record, ``best_fit``: :mod:`loader.stages.packer_records`): ``stream``,
    ``bins`` (open bins: ``tokens``, ``doc_starts``, ``piece_starts``, ``piece_origins``), ``serial``.

    The placement rule is :class:`loader.order.best_fit.OpenBins` (the audit's replay runs the
    same one on lengths). Each open bin fills a buffer of ``seq_len`` ids as pieces join it, which
    an emitted bin hands out as its ``input_ids``. Over a plain lane stream's complete blocks
    without features the pieces are cut in bulk per block (:class:`_BlockPieces`) and the cursor
    moved as ``take`` moves it; everything else takes piece by piece.

    ``piece_origins`` (state version 2): per piece ``[epoch, block, offset]``, the stream cursor
    of its first token (the stream's ``last_origin`` after the take; under token mixing, in the
    stream of the source ``token_sources`` names), so ``zephon audit`` can resolve an open bin
    to its documents. A bin restored from a version-1 state does not know its pieces' origins
    and saves none until it is emitted; a restore puts saved origins back.
    """

    def __init__(self, stream: TokenStream, seq_len: int, pad_id: int, open_bins: int,
                 features: tuple[str, ...] = (), max_images: Optional[int] = None,
                 images_in: Optional[Callable[[object], int]] = None) -> None:
        self.stream = stream
        # Image sources: a bin whose images (``images_in(piece)``, the kind's count: LaneKind.bin_cap)
        # would exceed this is not a fit (loader.vision.block).
        self.max_images = max_images if images_in is not None else None
        self.images_in = images_in
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.features = features  # the loader's (see _sequence_from_pieces)
        self.bins = OpenBins(seq_len, open_bins, self.max_images)
        self._buffers: dict[int, np.ndarray] = {}  # bin serial -> its input ids so far, padded
        self._padded = np.full(seq_len, pad_id, dtype=np.int32)  # a new bin's buffer: a copy (np.full costs 4x)
        # Bulk pieces: plain lane streams, a loader without per-token features, no image cap (a capped
        # bin counts each piece's images: the general path); tests switch it off to compare.
        self._bulk = type(stream) is LaneTokenStream and not features and self.max_images is None
        self._pieces: Optional[_BlockPieces] = None

    @property
    def serial(self) -> int:
        return self.bins.serial

    def next_sequence(self) -> Optional[PackedSequence]:
        bins, seq_len = self.bins, self.seq_len
        while True:
            pieces = self._pieces
            stream = self.stream
            if pieces is not None and pieces.next < len(pieces.starts) and stream.offset == pieces.starts[pieces.next] \
                    and (stream.epoch, stream.block_index) == pieces.key and not stream.exhausted:
                sequence = self._bulk_sequence(pieces)
                if sequence is not None:
                    return sequence
                continue
            if self._bulk and self._cut_pieces():
                continue
            chunk = stream.take(seq_len, within_document=True)
            if chunk is None:  # exhausted: flush the fullest open bin, then end
                emitted = bins.flush()
                return None if emitted is None else self._sequence(emitted)
            if len(chunk.tokens) == seq_len:  # a full piece of a long document is a sequence on its own
                return _sequence_from_pieces([chunk], seq_len, self.pad_id, piece_segment_starts=True,
                                             features=self.features)
            features = {n: v.copy() for n, v in chunk.features.items()} if chunk.features else NO_FEATURES
            emitted = self._place(chunk.tokens, chunk.doc_starts.copy(), features,
                                  stream.last_origin, _begins(chunk.doc_starts))
            if emitted is not None:
                return self._sequence(emitted)

    def _bulk_sequence(self, pieces: _BlockPieces) -> Optional[PackedSequence]:
        """Place the block's bulk pieces from ``pieces.next`` on until one makes a sequence (returned)
        or none is left (None); the stream's cursor is moved past the last piece placed, as ``take``
        would have moved it. The per-piece loop of the packer: integers and one copy per piece."""
        bins, seq_len, buffers, pad_id = self.bins, self.seq_len, self._buffers, self.pad_id
        starts, ends, begins = pieces.starts, pieces.ends, pieces.begins
        tokens = pieces.block.tokens
        epoch, block_index = pieces.key
        place = bins.place
        k, count, sequence = pieces.next, len(starts), None
        while k < count:
            start, end = starts[k], ends[k]
            k += 1
            if end - start == seq_len:  # a full piece of a long document is a sequence on its own
                sequence = _full_sequence(tokens[start:end], begins[k - 1])
                break
            starts_document = begins[k - 1]
            piece = _Piece(None, _STARTS_DOCUMENT if starts_document else _INSIDE_DOCUMENT, NO_FEATURES,
                           (epoch, block_index, start), starts_document)
            emitted = place(end - start, piece)
            serial, at = bins.last_serial, bins.last_at
            buffer = buffers.get(serial)
            if buffer is None:
                buffer = buffers[serial] = self._padded.copy()
            view = buffer[at : at + end - start]
            view[:] = tokens[start:end]
            piece.tokens = view
            if emitted is not None:
                sequence = self._sequence(emitted)
                break
        pieces.next = k
        stream = self.stream
        stream.offset, stream.last_origin = ends[k - 1], (epoch, block_index, starts[k - 1])
        return sequence

    def _cut_pieces(self) -> bool:
        """Cut the current block's pieces in bulk from the cursor on (:class:`_BlockPieces`); False
        when this block cannot be (text still to tokenize, features, empty documents) or has no
        piece ending inside it."""
        stream = self.stream
        if stream.exhausted:
            return False
        key = (stream.epoch, stream.block_index)
        current = self._pieces
        if current is not None and current.key == key and current.next >= len(current.starts) \
                and stream.offset >= (current.starts[-1] if current.starts else 0):
            return False  # this block's bulk pieces are used up: take the rest
        block = stream.current_block()
        if not block.complete or block.features or stream.offset >= len(block.tokens):
            return False
        doc_starts = block.doc_starts
        if len(doc_starts) > 1 and not (doc_starts[1:] > doc_starts[:-1]).all():
            return False  # empty documents: take's doc_starts repeat, the general path keeps them
        self._pieces = _BlockPieces(block, key, stream.offset, self.seq_len)
        return bool(self._pieces.starts)

    def _place(self, tokens: np.ndarray, doc_starts: np.ndarray, features, origin, begins) -> Optional[list]:
        """The rule's placement of a piece (not a full one); its tokens are written into its bin's buffer."""
        bins = self.bins
        piece = _Piece(tokens, doc_starts, features, origin, begins)
        emitted = bins.place(len(tokens), piece, self.images_in(piece) if self.max_images is not None else 0)
        serial, at = bins.last_serial, bins.last_at
        buffer = self._buffers.get(serial)
        if buffer is None:
            buffer = self._buffers[serial] = self._padded.copy()
        n = len(tokens)
        buffer[at : at + n] = tokens
        piece.tokens = buffer[at : at + n]
        return emitted

    def _sequence(self, pieces: list) -> PackedSequence:
        """The sequence of the bin just emitted (its buffer as ``input_ids``, labels and segments)."""
        seq_len = self.seq_len
        input_ids = self._buffers.pop(self.bins.emitted_serial)
        starts, begin_at, at = [], [], 0
        for piece in pieces:
            if piece.begins is None or piece.features or self.features:  # the general layout
                return _sequence_from_pieces(pieces, seq_len, self.pad_id, piece_segment_starts=True,
                                             features=self.features)
            starts.append(at)
            if piece.begins:
                begin_at.append(at)
            at += len(piece.tokens)
        labels = input_ids.copy()
        labels[begin_at] = IGNORE_INDEX
        labels[at:] = IGNORE_INDEX
        if at < seq_len:
            starts.append(at)
        return PackedSequence(input_ids=input_ids, labels=labels, segment_starts=np.array(starts, dtype=np.int32),
                              padding=seq_len - at)

    def snapshot(self) -> "StateSnapshot":
        """The state as of now, cheap to take: ``get_state()``'s arrays are built only if used.

        Pieces are never changed once made (bins only gain pieces), so holding the lists of
        pieces is enough. The loader takes one of these per lane at every step boundary;
        building the arrays costs hundreds of microseconds per lane.
        """
        return StateSnapshot(self.state_of, self.stream.get_state(), self.serial,
                             [(serial, list(pieces)) for serial, _, pieces in self.bins.bins()])

    def get_state(self) -> dict:
        return self.state_of(self.stream.get_state(), self.serial,
                              [(serial, pieces) for serial, _, pieces in self.bins.bins()])

    @staticmethod
    def state_of(stream_state: dict, serial: int, open_bins: list[tuple[int, list[_Piece]]]) -> dict:
        bins = []
        for bin_serial, pieces in open_bins:
            tokens = np.concatenate([p.tokens for p in pieces])
            piece_starts = np.cumsum([0] + [len(p.tokens) for p in pieces[:-1]])
            doc_starts = np.concatenate(
                [p.doc_starts + s for p, s in zip(pieces, piece_starts)]
            ) if pieces else np.zeros(0, np.int64)
            # numpy arrays here; loader.checkpoint.state turns them into JSON lists only when saving,
            # so snapshotting after every sequence (worker prefetch) stays cheap.
            saved = {
                SERIAL: bin_serial,
                TOKENS: tokens,
                PIECE_STARTS: piece_starts.astype(np.int64),
                DOC_STARTS: doc_starts.astype(np.int64),
            }
            for name in pieces[0].features:  # registry order (token_sources first, as before features)
                saved[name] = np.concatenate([p.features[name] for p in pieces])
            origins = [p.origin for p in pieces]
            if None not in origins:  # else a bin restored from a version-1 state: origins unknown
                saved[PIECE_ORIGINS] = [list(origin) for origin in origins]
            bins.append(saved)
        return best_fit_state(stream_state, bins, serial)

    def set_state(self, state: dict, path: str = "packer") -> None:
        """``state`` as checked by ``loader.checkpoint.schema``; ``path``: its JSON path, for errors."""
        self.stream.set_state(state[STREAM], path=f"{path}.{STREAM}")
        self.bins = OpenBins(self.seq_len, self.bins.max_open, self.max_images, serial=int(state[SERIAL]))
        self._buffers = {}
        self._pieces = None
        expected = self.stream.feature_names
        for k, saved in enumerate(state[BINS]):
            tokens = np.asarray(saved[TOKENS], dtype=np.int32)
            piece_starts = [int(x) for x in saved[PIECE_STARTS]] + [len(tokens)]
            doc_starts = np.asarray(saved[DOC_STARTS], dtype=np.int64)
            held = in_order(name for name in saved if name in FEATURES)
            if held != expected:  # a state of this source without its features (or with others')
                raise StateError(f"{path}.bins[{k}]: holds per-token features {list(held)}, but this source's "
                                 f"tokens carry {list(expected)}: the checkpoint is not this dataset's (was the "
                                 "loss_mask column added or removed?); restore it with the dataset it was saved with")
            features = {name: np.asarray(saved[name], dtype=FEATURES[name].dtype) for name in held}
            origins = [tuple(int(x) for x in o) for o in saved[PIECE_ORIGINS]] if PIECE_ORIGINS in saved \
                else [None] * (len(piece_starts) - 1)
            serial = int(saved[SERIAL])
            buffer = self._buffers[serial] = self._padded.copy()
            buffer[: len(tokens)] = tokens
            pieces = []
            for lo, hi, origin in zip(piece_starts[:-1], piece_starts[1:], origins):
                inside = doc_starts[(doc_starts >= lo) & (doc_starts < hi)] - lo
                pieces.append(_Piece(buffer[lo:hi], inside,
                                     {n: v[lo:hi] for n, v in features.items()} if features else NO_FEATURES, origin,
                                     _begins(inside)))
            images = sum(map(self.images_in, pieces)) if self.max_images is not None else 0
            self.bins.restore(serial, len(tokens), pieces, images)
        self._check_bound_features(path)

    def _check_bound_features(self, path: str) -> None:
        """Every piece holding a feature that refers into the data (``Feature.bound_to_data``:
        ``image_ref``) must be, tokens and features, the data at its origin: an edited ref would
        otherwise name another image. Reads each origin's block once; a state without origins
        (version 1) cannot be checked."""
        bound = [name for name in self.stream.feature_names if FEATURES[name].bound_to_data]
        if not bound:
            return
        block_at = self.stream.block_at
        blocks: dict = {}
        for k, (_, _, pieces) in enumerate(self.bins.bins()):
            for j, piece in enumerate(pieces):
                if piece.origin is None:
                    continue
                epoch, block_index, offset = piece.origin
                if (epoch, block_index) not in blocks:
                    blocks[(epoch, block_index)] = block_at(epoch, block_index)
                block = blocks[(epoch, block_index)]
                end = offset + len(piece.tokens)
                if block is not None:
                    block.ensure(end - 1)  # a block encoded on first use (text, images) up to the piece's end
                where = f"{path}.bins[{k}] piece {j} (origin epoch {epoch}, block {block_index}, offset {offset})"
                if block is None or end > len(block.tokens) or not np.array_equal(block.tokens[offset:end],
                                                                                    piece.tokens):
                    raise StateError(f"{where}: its tokens are not the data at its origin: the state was edited or "
                                     "comes from other data; restore an unmodified checkpoint of this dataset")
                for name in bound:
                    if not np.array_equal(block.features[name][offset:end], piece.features[name]):
                        raise StateError(f"{path}.bins[{k}].{name}: piece {j} holds {name} values that are not "
                                         f"those of the data at its origin (epoch {epoch}, block {block_index}, offset "
                                         f"{offset}): the state was edited (they would name other data); restore an "
                                         "unmodified checkpoint of this dataset")


def ship_piece(piece: _Piece) -> tuple:
    """A piece of an open bin as a worker sends it (:mod:`loader.workers.state_delta`): its tokens,
    its document starts (``begins`` where they are the shared ``[0]`` or ``[]``), its features
    (None: none) and origin; :func:`received_piece` makes the piece again."""
    return (piece.tokens, piece.doc_starts if piece.begins is None else piece.begins, piece.features or None,
            piece.origin)


def received_piece(tokens: np.ndarray, starts, features, origin) -> _Piece:
    """The piece :func:`ship_piece` sent (its arrays as received: the trainer's own)."""
    if type(starts) is bool:
        return _Piece(tokens, _STARTS_DOCUMENT if starts else _INSIDE_DOCUMENT, NO_FEATURES if features is None
                      else features, origin, starts)
    return _Piece(tokens, starts, NO_FEATURES if features is None else features, origin, _begins(starts))


def ship_pieces(pieces: list) -> tuple:
    """Pieces of open bins as a worker sends them in bulk (:mod:`loader.workers.state_delta`):
    their int32 tokens back to back as bytes, then per piece its length, its document starts
    (``begins`` where they are the shared ``[0]`` or ``[]``) and origin, and the features of
    each (None where no piece has any). Bytes, not arrays: pickling and unpickling a small
    array costs ~9 us, its bytes ~0.6 us; one per shipment, not one per piece (bench/HISTORY.md,
    "Best fit with 2 workers"). A piece's tokens are a view of its bin's int32 buffer (or of a
    restored one)."""
    tokens = b"".join([p.tokens for p in pieces])
    lengths = [len(p.tokens) for p in pieces]
    starts = [p.doc_starts if p.begins is None else p.begins for p in pieces]
    features = [p.features or None for p in pieces] if any(p.features for p in pieces) else None
    return tokens, lengths, starts, [p.origin for p in pieces], features


def received_pieces(data: bytes, lengths: list, starts: list, origins: list, features) -> Iterator[tuple]:
    """The pieces :func:`ship_pieces` sent, each as the arguments of :func:`received_piece_of`
    (tokens as a read-only view of ``data`` then), made without a Python step per piece: the
    trainer makes the pieces only if it saves a state holding them."""
    tokens = np.frombuffer(data, dtype=np.int32)
    offsets = itertools.accumulate(lengths, initial=0)
    return zip(itertools.repeat(tokens), offsets, lengths, starts, origins,
               itertools.repeat(None) if features is None else features)


def received_piece_of(tokens: np.ndarray, offset: int, length: int, starts, origin, features) -> _Piece:
    """One piece of :func:`received_pieces`."""
    piece_features = NO_FEATURES if features is None else features
    tokens = tokens[offset : offset + length]
    if type(starts) is bool:
        return _Piece(tokens, _STARTS_DOCUMENT if starts else _INSIDE_DOCUMENT, piece_features, origin, starts)
    return _Piece(tokens, starts, piece_features, origin, _begins(starts))


def _full_sequence(tokens: np.ndarray, begins: bool) -> PackedSequence:
    """A full piece of a long document as a sequence on its own (``_sequence_from_chunk``'s
    result for it): no padding, one segment, the first label masked if the document starts here."""
    input_ids = tokens.astype(np.int32, copy=True)
    labels = input_ids.copy()
    if begins:
        labels[0] = IGNORE_INDEX
    return PackedSequence(input_ids=input_ids, labels=labels, segment_starts=_SEGMENT_AT_ZERO, padding=0)


_SEGMENT_AT_ZERO = np.zeros(1, dtype=np.int32)
_SEGMENT_AT_ZERO.flags.writeable = False
