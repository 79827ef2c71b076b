"""What a worker message holds: a few consecutive items, arrays in a shared-memory slot.

:func:`write_message` puts the per-token arrays of up to ``ITEMS_PER_MESSAGE`` items into a
slot and returns the small descriptor that travels through the pipe (global indices,
source ids, lane states, the arrays' layout). :func:`read_message` turns a descriptor and
its slot back into :class:`~loader.producer.Item` objects whose arrays are views of the
slot; each item holds a :class:`SlotLease`, released by the trainer once the item is
copied into a micro-batch, after which the worker may overwrite the slot.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from loader.features import FEATURES, NO_FEATURES, in_order
from loader.packing import PackedSequence
from loader.producer import End, Item
from loader.workers.shm import read_arrays, write_arrays

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


def write_message(items: list, slot: memoryview) -> dict:
    """The descriptor of ``items`` (an :class:`End` only last), their arrays written to ``slot``."""
    end = items[-1] if items and isinstance(items[-1], End) else None
    items = items[:-1] if end is not None else items
    sequences = [it.sequence for it in items]
    descriptor = {
        "global_index": [it.global_index for it in items],
        "source_id": [it.source_id for it in items],
        "lane_state": [it.lane_state for it in items],
        "segment_counts": [len(s.segment_starts) for s in sequences],
        "feature_rows": {},  # feature name -> which items carry it (every feature, generically)
        "end": end,
        "layout": {},
    }
    if sequences:
        arrays = {
            "input_ids": np.stack([s.input_ids for s in sequences]).astype(np.int32, copy=False),
            "labels": np.stack([s.labels for s in sequences]).astype(np.int32, copy=False),
            "segment_starts": np.concatenate([s.segment_starts for s in sequences]).astype(np.int32),
        }
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
        descriptor["layout"] = write_arrays(slot, arrays)
    return descriptor


def read_message(descriptor: dict, slot: memoryview, lease: Optional[Callable[[], None]]) -> list:
    """The items of a :func:`write_message` descriptor; their arrays are views of ``slot``."""
    items: list = []
    if descriptor["global_index"]:
        arrays = read_arrays(slot, descriptor["layout"])
        input_ids, labels, segment_starts = arrays["input_ids"], arrays["labels"], arrays["segment_starts"]
        feature_rows = descriptor["feature_rows"]
        feature_arrays = {name: arrays[f"feature.{name}"] for name in feature_rows}
        bounds = np.cumsum([0] + descriptor["segment_counts"]).tolist()
        holder = SlotLease(len(descriptor["global_index"]), lease) if lease is not None else None
        for row, (global_index, source_id, lane_state) in enumerate(
            zip(descriptor["global_index"], descriptor["source_id"], descriptor["lane_state"])
        ):
            features = NO_FEATURES if not feature_rows else {
                name: feature_arrays[name][row] for name, rows in feature_rows.items() if rows[row]}
            sequence = PackedSequence(
                input_ids=input_ids[row], labels=labels[row],
                segment_starts=segment_starts[bounds[row] : bounds[row + 1]], features=features,
            )
            items.append(Item(global_index, source_id, sequence, lane_state, holder))
    if descriptor["end"] is not None:
        items.append(descriptor["end"])
    return items
