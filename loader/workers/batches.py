"""Whole micro-batches built in the workers: the trainer's side only takes a ready batch.

Where a rank's micro-batches fall on disjoint groups of lanes, each worker owns whole groups
and builds every micro-batch of them itself, with the loader's own
:class:`~loader.stages.collate.Collator`; one message carries one micro-batch::

    rank positions   0..7 | 8..15 | 16..23 | 24..31 | ...   (micro_batch_size 8, 16 lanes, W = 1)
    lanes            0..7 | 8..15 | 0..7   | 8..15  | ...
    group            0    | 1     | 0      | 1      | ...   micro-batch m: group m % G
    worker (K = 2)   0    | 1     | 0      | 1      | ...   group g: worker g % K

The stream does not change: a lane's sequences depend on its state only, not on which process
holds it, so a worker that owns other lanes than ``lanes_of_worker`` gives each index the
same sequence (the golden pins and tests/loader's worker tests hold the streams).

Message format (``write_batch``, the descriptor of a ``("items", run_id, slot, descriptor)``
message, ``kind == "batch"``): ``position`` (the rank position of its first row), ``keys``
(the batch's keys in order), ``values`` (the keys whose values are not arrays: ``step``,
``micro_step``, reject counts), ``layout`` (the arrays in the slot,
:class:`~loader.workers.shm.SlotWriter`), ``lane_states`` (``[lane, shipped state]`` after the
batch, :class:`~loader.workers.state_delta.StateEncoder`), ``source_ids`` and ``padding`` per
row and ``rejects`` (online chat rejects, or None) for the loader's metrics, and ``io``. Every
array of the batch travels the same way, whatever its name: image fields can follow once the
slot is sized for them (today a loader with image sources keeps item messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from loader.metrics import IO, receive_shipped
from loader.order.ordering import rank_period
from loader.stages.collate import Collator
from loader.stages.features import FEATURES
from loader.stages.producer import End, produce_one, take_rows
from loader.workers.shm import SlotWriter, read_arrays


@dataclass(frozen=True)
class BatchPlan:
    """Which worker builds which micro-batch of a rank (picklable: sent with a run's start).

    ``groups``: micro-batch ``m`` uses the lanes of group ``m % groups``; group ``g`` is worker
    ``g % num_workers``'s. ``collator``: the keyword arguments of the loader's :class:`Collator`.
    """

    rank: int
    world_size: int
    num_lanes: int
    micro_batch_size: int
    groups: int
    num_workers: int
    collator: dict

    def worker_of(self, micro_batch: int) -> int:
        return (micro_batch % self.groups) % self.num_workers

    def lanes_of(self, worker_id: int) -> list[int]:
        """The lanes worker ``worker_id`` owns: those of its groups, in position order."""
        mbs = self.micro_batch_size
        return [(self.rank + p * self.world_size) % self.num_lanes
                for g in range(worker_id, self.groups, self.num_workers) for p in range(g * mbs, (g + 1) * mbs)]


def batch_plan(*, rank: int, world_size: int, num_lanes: int, micro_batch_size: int, num_workers: int,
               collator: dict) -> Optional[BatchPlan]:
    """The plan of a loader whose micro-batches fall on disjoint lane groups, at least one per
    worker (``micro_batch_size`` divides the rank's lane period), else None (item messages)."""
    period = rank_period(num_lanes, world_size)
    if period % micro_batch_size or period // micro_batch_size < num_workers:
        return None
    return BatchPlan(rank, world_size, num_lanes, micro_batch_size, period // micro_batch_size, num_workers, collator)


def batch_bytes(collator: Collator) -> int:
    """Room for one micro-batch's arrays in the worst case (a segment at every token)."""
    tokens = collator.micro_batch_size * collator.seq_len
    per_token = 8 * sum(f in collator.fields for f in ("input_ids", "labels", "position_ids")) + 4  # + cu_seqlens
    per_token += sum(FEATURES[n].batch_dtype.itemsize for n in collator.batched)
    return tokens * per_token + 64 * (len(collator.fields) + len(collator.batched) + 8) + 4096


@dataclass
class BuiltBatch:
    """A micro-batch a worker built (NumPy), with what the trainer records for it; on the
    trainer's side (:func:`read_batch`) its arrays are copies out of the slot and
    ``lane_states`` decoded."""

    position: int
    batch: dict
    lane_states: list
    source_ids: list
    padding: list
    rejects: Optional[dict]


class SlotArrays:
    """The worker collator's ``empty``: the large arrays of a micro-batch (input ids, labels,
    position ids) are built in the message's slot, not copied there afterwards."""

    def __init__(self) -> None:
        self.writer: Optional[SlotWriter] = None
        self.made: dict[int, str] = {}  # id of an array built in the slot -> its name in the layout

    def start(self, slot: memoryview) -> SlotWriter:
        self.writer, self.made = SlotWriter(slot), {}
        return self.writer

    def __call__(self, shape, dtype) -> np.ndarray:
        name = f"_{len(self.made)}"
        view = self.writer.allocate(name, dtype, shape)
        self.made[id(view)] = name
        return view


def produce_batches(lanes: dict, plan: BatchPlan, worker_id: int, start_position: int,
                    ship_state) -> Iterator:
    """Worker ``worker_id``'s micro-batches from ``start_position`` (a micro-batch boundary) on,
    endless; ``ship_state(lane_id, lane)``: the state to ship (the run's ``StateEncoder.ship``).
    Yields the descriptor maker of each (``write(slot)``: the batch collated into the slot)."""
    slot_arrays = SlotArrays()
    collator = Collator(**plan.collator, empty=slot_arrays)
    mbs, stride, num_lanes = plan.micro_batch_size, plan.world_size, plan.num_lanes
    source_of = next(iter(lanes.values())).spec.schedule.source_of
    bulk = all(lane.bulk_rows for lane in lanes.values())
    micro_batch = start_position // mbs
    while True:
        if plan.worker_of(micro_batch) == worker_id:
            position = micro_batch * mbs
            first = plan.rank + position * stride
            taken = take_rows(lanes, num_lanes, source_of, first, stride, mbs) if bulk else None
            if taken is not None:
                fills, rows, sources, lane_ids = taken
                padding, rejects = [0] * mbs, None
                collate = lambda: collator.collate_rows(fills, rows, sources, first, stride, position + mbs)  # noqa: E731
            else:
                items = [produce_one(lanes[(first + k * stride) % num_lanes], first + k * stride, False)
                         for k in range(mbs)]
                if any(isinstance(item, End) for item in items):
                    raise RuntimeError("internal error: a lane of an endless run ran out (item messages handle ends)")
                sources = [item.source_id for item in items]
                lane_ids = [item.global_index % num_lanes for item in items]
                padding = [item.sequence.padding for item in items]
                rejects = _merged([item.chat_rejects for item in items])
                collate = lambda: collator.collate(items, position + mbs)  # noqa: E731
            states = [[l, ship_state(l, lanes[l])] for l in lane_ids]

            def write(slot: memoryview) -> dict:
                writer = slot_arrays.start(slot)
                return write_batch(BuiltBatch(position, collate(), states, sources, padding, rejects), writer,
                                   slot_arrays.made)

            yield write
        micro_batch += 1


def _merged(rejects: list) -> Optional[dict]:
    out = None
    for counts in rejects:
        for reason, count in (counts or {}).items():
            out = {} if out is None else out
            out[reason] = out.get(reason, 0) + count
    return out


def write_batch(built: BuiltBatch, writer: SlotWriter, made: Optional[dict[int, str]] = None) -> dict:
    """The descriptor of ``built``, its arrays in ``writer``'s slot (see the module docstring);
    ``made``: the arrays already built there (:class:`SlotArrays`), renamed, not copied."""
    values = {}
    for key, value in built.batch.items():
        if type(value) is not np.ndarray:
            values[key] = value
        elif made and id(value) in made:
            writer.layout[key] = writer.layout.pop(made[id(value)])
        else:
            writer.write(key, value)
    return {"kind": "batch", "position": built.position, "keys": list(built.batch), "values": values,
            "layout": writer.layout, "lane_states": built.lane_states, "source_ids": built.source_ids,
            "padding": built.padding, "rejects": built.rejects, "io": IO.delta_to_ship()}


def read_batch(descriptor: dict, slot: memoryview, give_back, decode_state, empty=np.empty) -> BuiltBatch:
    """The batch of a :func:`write_batch` descriptor, copied out of ``slot`` (one copy per array,
    into ``empty``'s memory: pinned memory too), after which the slot is given back."""
    receive_shipped(descriptor.get("io"))
    arrays = read_arrays(slot, descriptor["layout"])
    values = descriptor["values"]
    batch: dict[str, Any] = {}
    for key in descriptor["keys"]:
        if key in arrays:
            view = arrays[key]
            if empty is np.empty:
                batch[key] = view.copy()
            else:
                batch[key] = out = empty(view.shape, view.dtype)
                np.copyto(out, view)
        else:
            batch[key] = values[key]
    give_back()
    states = [[lane, decode_state(state)] for lane, state in descriptor["lane_states"]]
    return BuiltBatch(descriptor["position"], batch, states, descriptor["source_ids"], descriptor["padding"],
                      descriptor["rejects"])

