"""What a worker message holds: a few consecutive items, arrays in a shared-memory slot.

:func:`write_message` puts the per-token arrays of a few items (:func:`items_per_message`) into
a slot and returns the small descriptor that travels through the pipe (global indices,
source ids, lane states, the arrays' layout). :func:`read_message` turns a descriptor and
its slot back into :class:`~loader.stages.producer.Item` objects whose arrays are views of the
slot; each item holds a :class:`SlotLease`, released by the trainer once the item is
copied into a micro-batch, after which the worker may overwrite the slot.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import numpy as np

from loader.kinds.base import sequence_attachment
from loader.stages.features import FEATURES, NO_FEATURES, in_order
from loader.metrics import IO, IoCounters, receive_shipped
from loader.stages.packing import ConcatRow, PackedSequence
from loader.stages.producer import End, Item
from loader.workers.shm import SlotWriter, read_arrays

# Sequences per message. Each message costs both processes a fixed amount (the descriptor's
# pickling, a pipe write and read, a wake-up, slot bookkeeping) besides its arrays: 8 sequences
# of 2048 tokens per message held pre-tokenized replay with 2 workers to 0.43x of in-process,
# 32 (with the other changes of that session) reached 0.77x; 64 was no better than 32
# (bench/HISTORY.md, "issue 16, the worker transport"). Pre-tokenized sources therefore ship
# ``MESSAGE_TOKENS`` per message (within these bounds); sources that tokenize online or carry
# images keep ``ITEMS_PER_MESSAGE``: a text worker would tokenize 4x as much before its first
# message, and an image slot is sized for a message's worst-case pixels.
ITEMS_PER_MESSAGE = 8
MAX_ITEMS_PER_MESSAGE = 32
MESSAGE_TOKENS = 64 * 1024


def items_per_message(seq_len: int, *, tokenizes: bool, images: bool) -> int:
    """Sequences per worker message for a loader of ``seq_len`` (see ``MESSAGE_TOKENS``):
    32 at seq_len 2048, 16 at 4096, 8 from 8192 on; 8 where sources tokenize or hold images."""
    if tokenizes or images:
        return ITEMS_PER_MESSAGE
    return max(ITEMS_PER_MESSAGE, min(MAX_ITEMS_PER_MESSAGE, MESSAGE_TOKENS // seq_len))


class SlotLease:
    """The trainer's hold on one slot: released after its last item is copied out."""

    __slots__ = ("_remaining", "_release")

    def __init__(self, items: int, release: Callable[[], None]) -> None:
        self._remaining = items
        self._release = release

    def item_done(self) -> None:
        self._remaining -= 1
        if self._remaining == 0:
            self._release()


class MessageRows:
    """The ``_fill`` of a message's concat rows: their document starts back to back, cut out
    for row ``k`` (the message's ``k``-th concat row) only when asked. ``doc_starts`` is None
    when the message was written without segments (``write_message(segments=False)``)."""

    __slots__ = ("doc_starts", "bounds")

    def __init__(self, doc_starts: Optional[np.ndarray], counts: Optional[list[int]]) -> None:
        self.doc_starts = doc_starts
        self.bounds = None if counts is None else list(itertools.accumulate(counts, initial=0))

    def row_doc_starts(self, row: int) -> np.ndarray:
        if self.doc_starts is None:
            raise RuntimeError("internal error: a worker shipped no document starts, but the batch needs them")
        return self.doc_starts[self.bounds[row] : self.bounds[row + 1]]


def _shipped_row(input_ids: np.ndarray, fill: MessageRows, row: int, features) -> ConcatRow:
    """A :class:`~loader.stages.packing.ConcatRow` rebuilt from a message (the batch builder's bulk path)."""
    sequence = ConcatRow.__new__(ConcatRow)
    sequence.input_ids, sequence.features, sequence.majority_source = input_ids, features, -1
    sequence._fill, sequence._row = fill, row
    return sequence


def _concat_into(writer: SlotWriter, name: str, arrays: list, shape: tuple) -> None:
    """``arrays`` back to back as one int32 array of ``shape`` built in the slot (rows of
    ``seq_len`` as ``(rows, seq_len)``, starts flat), cast as ``astype`` would: one
    ``concatenate``, where ``np.stack`` adds a Python step per row."""
    np.concatenate(arrays, out=writer.allocate(name, np.int32, shape).reshape(-1), casting="unsafe")


def write_message(items: list, slot: memoryview, segments: bool = True) -> dict:
    """The descriptor of ``items`` (an :class:`End` only last), their arrays written to ``slot``.

    ``segments``: ship each sequence's labels and segment (document) starts. The trainer's
    batch builder reads them only for ``labels``, ``position_ids`` or ``cu_seqlens``
    (``Collator.reads_segments``); without, a concat row's document starts are never worked
    out, as in-process (where they are derived on first request)."""
    end = items[-1] if items and isinstance(items[-1], End) else None
    items = items[:-1] if end is not None else items
    sequences = [it.sequence for it in items]
    # Full concat rows travel as ids + where their documents start, and stay concat rows on
    # the trainer's side, whose batch builder derives their labels and segments in bulk (as
    # in-process); building per-row labels here would be work the trainer skips anyway.
    is_row = [type(s) is ConcatRow for s in sequences]
    descriptor = {
        "global_index": [it.global_index for it in items],
        "source_id": [it.source_id for it in items],
        "lane_state": [it.lane_state for it in items],
        "chat_rejects": [it.chat_rejects for it in items],  # online chat rejects (None: none)
        "is_row": is_row,
        "padding": [s.padding for s in sequences],  # pad tokens per sequence (loader.metrics)
        "io": IO.delta_to_ship(),  # this worker's reads since its last message (loader.metrics)
        "start_counts": None,  # per sequence, its doc_starts (rows) or segment_starts (others); None: not shipped
        "feature_rows": {},  # feature name -> which items carry it (every feature, generically)
        "end": end,
        "layout": {},
    }
    if not sequences:
        return descriptor
    writer = SlotWriter(slot)
    seq_len = len(sequences[0].input_ids)
    _concat_into(writer, "input_ids", [s.input_ids for s in sequences], (len(sequences), seq_len))
    if segments:
        # Worked out once per row: a concat row derives its document starts on each access.
        starts = [s.doc_starts if r else s.segment_starts for s, r in zip(sequences, is_row)]
        descriptor["start_counts"] = [len(st) for st in starts]
        row_starts = [st for st, r in zip(starts, is_row) if r]
        if row_starts:
            _concat_into(writer, "doc_starts", row_starts, (sum(map(len, row_starts)),))
        if not all(is_row):
            labels = [s.labels for s, r in zip(sequences, is_row) if not r]
            _concat_into(writer, "labels", labels, (len(labels), seq_len))
            other_starts = [st for st, r in zip(starts, is_row) if not r]
            _concat_into(writer, "segment_starts", other_starts, (sum(map(len, other_starts)),))
    for name in in_order(name for s in sequences for name in s.features):
        feature = FEATURES[name]
        has = [name in s.features for s in sequences]
        values = writer.allocate(f"feature.{name}", feature.dtype, (len(sequences), seq_len))
        for row, (sequence, present) in enumerate(zip(sequences, has)):
            values[row] = sequence.features[name] if present else feature.pad
        descriptor["feature_rows"][name] = has
    if any(s.images is not None for s in sequences):  # image sources: pixels beside the features
        pixels: dict = {}
        descriptor["images"] = sequence_attachment("images").pack(sequences, pixels)
        for name, array in pixels.items():
            writer.write(name, np.ascontiguousarray(array))
    descriptor["layout"] = writer.layout
    return descriptor


def read_message(descriptor: dict, slot: memoryview, lease: Optional[Callable[[], None]],
                 decode_state: Optional[Callable[[Any], Any]] = None, io: IoCounters = IO) -> list:
    """The items of a :func:`write_message` descriptor; their arrays are views of ``slot``; the
    worker's reads it reports are added to ``io`` (the counters of the pool's loader).
    ``decode_state``: the run's :meth:`loader.workers.state_delta.StateDecoder.decode`, called
    on every item's lane state in message order. Written without segments, other rows have
    ``labels`` and ``segment_starts`` None (the batch does not read them)."""
    items: list = []
    receive_shipped(descriptor.get("io"), io)
    if descriptor["global_index"]:
        arrays = read_arrays(slot, descriptor["layout"])
        input_ids = arrays["input_ids"]
        labels, segment_starts = arrays.get("labels"), arrays.get("segment_starts")
        counts = descriptor["start_counts"]
        is_rows = descriptor["is_row"]
        row_fill = MessageRows(arrays.get("doc_starts"),
                                None if counts is None else [c for c, r in zip(counts, is_rows) if r])
        feature_rows = descriptor["feature_rows"]
        feature_arrays = {name: arrays[f"feature.{name}"] for name in feature_rows}
        holder = SlotLease(len(descriptor["global_index"]), lease) if lease is not None else None
        at_row = at_starts = at_other = 0  # concat rows so far; offset into segment_starts; other rows so far
        images = descriptor.get("images")
        unpack_images = None if images is None else sequence_attachment("images").unpack
        for row, (global_index, source_id, lane_state, is_row) in enumerate(zip(
            descriptor["global_index"], descriptor["source_id"], descriptor["lane_state"], is_rows,
        )):
            features = NO_FEATURES if not feature_rows else {
                name: feature_arrays[name][row] for name, rows in feature_rows.items() if rows[row]}
            if is_row:
                sequence = _shipped_row(input_ids[row], row_fill, at_row, features)
                at_row += 1
            else:
                sequence = PackedSequence(input_ids=input_ids[row], labels=None, segment_starts=None,
                                          features=features, padding=descriptor["padding"][row])
                if counts is not None:
                    sequence.labels = labels[at_other]
                    sequence.segment_starts = segment_starts[at_starts : at_starts + counts[row]]
                    at_starts += counts[row]
                at_other += 1
            if images is not None:
                sequence.images = unpack_images(images[row], arrays, row)
            if decode_state is not None and lane_state is not None:
                lane_state = decode_state(lane_state)
            items.append(Item(global_index, source_id, sequence, lane_state, holder,
                              descriptor["chat_rejects"][row]))
    if descriptor["end"] is not None:
        items.append(descriptor["end"])
    return items
