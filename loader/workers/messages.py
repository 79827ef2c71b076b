"""What a worker message holds: a few consecutive items, arrays in a shared-memory slot.

:func:`write_message` puts the per-token arrays of up to ``ITEMS_PER_MESSAGE`` items into a
slot and returns the small descriptor that travels through the pipe (global indices,
source ids, lane states, the arrays' layout). :func:`read_message` turns a descriptor and
its slot back into :class:`~loader.stages.producer.Item` objects whose arrays are views of the
slot; each item holds a :class:`SlotLease`, released by the trainer once the item is
copied into a micro-batch, after which the worker may overwrite the slot.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from loader.stages.features import FEATURES, NO_FEATURES, in_order
from loader.metrics import IO, receive_shipped
from loader.stages.packing import ConcatRow, PackedSequence
from loader.stages.producer import End, Item
from loader.workers.shm import read_arrays, write_arrays
from loader.vision.transfer import pack_images, unpack_images

ITEMS_PER_MESSAGE = 8  # sequences per message: amortises the descriptor's pickling and the pipe


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


class _OneRowFill:
    """The ``_fill`` of a shipped concat row: its document starts, already cut out."""

    __slots__ = ("doc_starts",)

    def __init__(self, doc_starts: np.ndarray) -> None:
        self.doc_starts = doc_starts

    def row_doc_starts(self, row: int) -> np.ndarray:
        return self.doc_starts


def _shipped_row(input_ids: np.ndarray, doc_starts: np.ndarray, features) -> ConcatRow:
    """A :class:`~loader.stages.packing.ConcatRow` rebuilt from a message (the batch builder's bulk path)."""
    row = ConcatRow.__new__(ConcatRow)
    row.input_ids, row.features, row.majority_source = input_ids, features, -1
    row._fill, row._row = _OneRowFill(doc_starts), 0
    return row


def write_message(items: list, slot: memoryview) -> dict:
    """The descriptor of ``items`` (an :class:`End` only last), their arrays written to ``slot``."""
    end = items[-1] if items and isinstance(items[-1], End) else None
    items = items[:-1] if end is not None else items
    sequences = [it.sequence for it in items]
    # Full concat rows travel as ids + where their documents start, and stay concat rows on
    # the trainer's side, whose batch builder derives their labels and segments in bulk (as
    # in-process); building per-row labels here would be work the trainer skips anyway.
    is_row = [type(s) is ConcatRow for s in sequences]
    rows = [s for s, r in zip(sequences, is_row) if r]
    others = [s for s, r in zip(sequences, is_row) if not r]
    descriptor = {
        "global_index": [it.global_index for it in items],
        "source_id": [it.source_id for it in items],
        "lane_state": [it.lane_state for it in items],
        "chat_rejects": [it.chat_rejects for it in items],  # online chat rejects (None: none)
        "is_row": is_row,
        "padding": [s.padding for s in sequences],  # pad tokens per sequence (loader.metrics)
        "io": IO.delta_to_ship(),  # this worker's reads since its last message (loader.metrics)
        "start_counts": [len(s.doc_starts) if r else len(s.segment_starts) for s, r in zip(sequences, is_row)],
        "feature_rows": {},  # feature name -> which items carry it (every feature, generically)
        "end": end,
        "layout": {},
    }
    if sequences:
        arrays = {"input_ids": np.stack([s.input_ids for s in sequences]).astype(np.int32, copy=False)}
        if rows:
            arrays["doc_starts"] = np.concatenate([s.doc_starts for s in rows]).astype(np.int32, copy=False)
        if others:
            arrays["labels"] = np.stack([s.labels for s in others]).astype(np.int32, copy=False)
            arrays["segment_starts"] = np.concatenate([s.segment_starts for s in others]).astype(np.int32)
        names = in_order(name for s in sequences for name in s.features)
        if names:
            seq_len = len(sequences[0].input_ids)
            for name in names:
                feature = FEATURES[name]
                rows = [name in s.features for s in sequences]
                arrays[f"feature.{name}"] = np.stack([
                    s.features[name] if has else np.full(seq_len, feature.pad, feature.dtype)
                    for s, has in zip(sequences, rows)
                ]).astype(feature.dtype, copy=False)
                descriptor["feature_rows"][name] = rows
        if any(s.images is not None for s in sequences):  # image sources: pixels beside the features
            descriptor["images"] = pack_images(sequences, arrays)
        descriptor["layout"] = write_arrays(slot, arrays)
    return descriptor


def read_message(descriptor: dict, slot: memoryview, lease: Optional[Callable[[], None]],
                 decode_state: Optional[Callable[[Any], Any]] = None) -> list:
    """The items of a :func:`write_message` descriptor; their arrays are views of ``slot``.
    ``decode_state``: the run's :meth:`loader.workers.state_delta.StateDecoder.decode`, called
    on every item's lane state in message order."""
    items: list = []
    receive_shipped(descriptor.get("io"))
    if descriptor["global_index"]:
        arrays = read_arrays(slot, descriptor["layout"])
        input_ids = arrays["input_ids"]
        doc_starts, labels, segment_starts = arrays.get("doc_starts"), arrays.get("labels"), arrays.get("segment_starts")
        feature_rows = descriptor["feature_rows"]
        feature_arrays = {name: arrays[f"feature.{name}"] for name in feature_rows}
        holder = SlotLease(len(descriptor["global_index"]), lease) if lease is not None else None
        at_row = at_starts = at_other = 0  # offsets into doc_starts / segment_starts; other rows so far
        images = descriptor.get("images")
        for row, (global_index, source_id, lane_state, is_row, count) in enumerate(zip(
            descriptor["global_index"], descriptor["source_id"], descriptor["lane_state"],
            descriptor["is_row"], descriptor["start_counts"],
        )):
            features = NO_FEATURES if not feature_rows else {
                name: feature_arrays[name][row] for name, rows in feature_rows.items() if rows[row]}
            if is_row:
                sequence = _shipped_row(input_ids[row], doc_starts[at_row : at_row + count], features)
                at_row += count
            else:
                sequence = PackedSequence(
                    input_ids=input_ids[row], labels=labels[at_other],
                    segment_starts=segment_starts[at_starts : at_starts + count], features=features,
                    padding=descriptor["padding"][row],
                )
                at_other += 1
                at_starts += count
            if images is not None:
                sequence.images = unpack_images(images[row], arrays, row)
            if decode_state is not None and lane_state is not None:
                lane_state = decode_state(lane_state)
            items.append(Item(global_index, source_id, sequence, lane_state, holder,
                              descriptor["chat_rejects"][row]))
    if descriptor["end"] is not None:
        items.append(descriptor["end"])
    return items
