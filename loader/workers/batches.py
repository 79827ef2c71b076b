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

Message format (the descriptor of a ``("items", run_id, slot, descriptor)`` message with
``kind == "batch"``): ``batches``, one entry per micro-batch (up to ``per_message`` of the
worker's consecutive ones, :func:`batches_per_message`; :func:`write_batch`): ``position`` (the
rank position of its first row), ``keys`` (the batch's keys in order), ``values`` (the keys
whose values are not arrays: ``step``, ``micro_step``, reject counts), ``layout`` (its arrays
in the slot, :class:`~loader.workers.shm.SlotWriter`), ``lane_states`` (``[lane, shipped
state]`` after it, :class:`~loader.workers.state_delta.StateEncoder`), ``source_ids`` and
``padding`` per row (None: full rows) and ``rejects`` (online chat rejects, or None) for the
loader's metrics; and ``io``. The worker collates the large arrays straight into the slot (:class:`SlotArrays`);
the trainer hands a micro-batch out as views of the slot, no copy (:mod:`loader.workers.held`:
the slot goes back once every micro-batch of its message is freed; beyond
``HELD_BATCHES`` held, or into pinned memory, a micro-batch is copied out). While the trainer
is loader-bound (``BatchPlan.rows``, :data:`ROWS_POLICIES`), a micro-batch travels for the
trainer to collate instead: bulk concat rows as the rows (:func:`write_rows`: ``rows`` its
first global index and stride, ``layout`` its int32 ids and document starts, ``doc_counts``
per row), others as items of one item message in the rest of the slot (the message's
``items`` and ``items_at``, each micro-batch's ``items`` its range: :func:`_items_part`).
Every array of a batch travels the same way, whatever its name: image fields can follow once
the slot is sized for their pixels (today a loader with image sources keeps item messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from loader.metrics import IO, IoCounters, receive_shipped
from loader.order.ordering import rank_period
from loader.stages.collate import Collator
from loader.stages.features import FEATURES
from loader.stages.producer import End, produce_one, take_rows
from loader.workers.held import HeldViews, MessageLease
from loader.workers.messages import MESSAGE_TOKENS, MessageRows, read_message, write_message
from loader.workers.shm import SlotWriter, read_arrays


# When a worker ships a micro-batch for the trainer to collate instead of collating it (bulk
# concat rows as the rows: int32 ids, document starts; others as items): "loader_bound" (the default), while the
# trainer asks for its micro-batches back to back (ROWS_GAP_S: replay, a trainer bound by the
# loader); "always"; "never" (tests of either path). Collated in the workers, replay flat out
# on 2 shared cores ran at 0.70-0.95x of the item messages' rate: the collation moved onto the
# workers, into cold shared memory, and the trainer's loop read the batch from there, at more
# CPU per token in all; a trainer with work of its own gets the batches collated.
ROWS_POLICIES = ("loader_bound", "always", "never")
# A trainer counts as loader-bound while it comes back for the next micro-batch within this many
# seconds of taking one (a moving average): a training step with any device work takes longer.
ROWS_GAP_S = 1e-3


@dataclass(frozen=True)
class BatchPlan:
    """Which worker builds which micro-batch of a rank (picklable: sent with a run's start).

    ``groups``: micro-batch ``m`` uses the lanes of group ``m % groups``; group ``g`` is worker
    ``g % num_workers``'s. ``collator``: the keyword arguments of the loader's :class:`Collator`.
    ``rows``: when micro-batches of bulk concat rows travel as rows, collated by the trainer
    (:data:`ROWS_POLICIES`; the stream is the same either way).
    """

    rank: int
    world_size: int
    num_lanes: int
    micro_batch_size: int
    groups: int
    num_workers: int
    collator: dict
    per_message: int = 1  # micro-batches per message (batches_per_message)
    rows: str = "loader_bound"

    def worker_of(self, micro_batch: int) -> int:
        return (micro_batch % self.groups) % self.num_workers

    def lanes_of(self, worker_id: int) -> list[int]:
        """The lanes worker ``worker_id`` owns: those of its groups, in position order."""
        mbs = self.micro_batch_size
        return [(self.rank + p * self.world_size) % self.num_lanes
                for g in range(worker_id, self.groups, self.num_workers) for p in range(g * mbs, (g + 1) * mbs)]


def batch_plan(*, rank: int, world_size: int, num_lanes: int, micro_batch_size: int, num_workers: int,
               collator: dict, per_message: int = 1) -> Optional[BatchPlan]:
    """The plan of a loader whose micro-batches fall on disjoint lane groups, at least one per
    worker (``micro_batch_size`` divides the rank's lane period), else None (item messages)."""
    period = rank_period(num_lanes, world_size)
    if period % micro_batch_size or period // micro_batch_size < num_workers:
        return None
    return BatchPlan(rank, world_size, num_lanes, micro_batch_size, period // micro_batch_size, num_workers, collator,
                     per_message)


def batch_bytes(collator: Collator, per_message: int = 1) -> int:
    """Room for a message's micro-batches' arrays in the worst case (a segment at every token)."""
    tokens = collator.micro_batch_size * collator.seq_len
    per_token = 8 * sum(f in collator.fields for f in ("input_ids", "labels", "position_ids")) + 4  # + cu_seqlens
    per_token += sum(FEATURES[n].batch_dtype.itemsize for n in collator.batched)
    return per_message * (tokens * per_token + 64 * (len(collator.fields) + len(collator.batched) + 8) + 4096)


@dataclass
class BuiltBatch:
    """A micro-batch a worker built (NumPy), with what the trainer records for it; on the
    trainer's side (:class:`ShippedBatch`) its arrays are views of the slot (or copies) and
    ``lane_states`` decoded."""

    position: int
    batch: dict
    lane_states: list  # [lane, shipped state] in the worker; {lane: state} on the trainer's side
    source_ids: list
    padding: list
    rejects: Optional[dict]


class SlotArrays:
    """The worker collator's ``empty``: the large arrays of a micro-batch (input ids, labels,
    position ids) are built in the message's slot, not copied there afterwards."""

    def __init__(self) -> None:
        self.writer: Optional[SlotWriter] = None
        # id of an array built in the slot for the micro-batch being collated -> (its name in the
        # layout, the array: held, so that its id is not reused); cleared per micro-batch
        self.made: dict[int, tuple[str, np.ndarray]] = {}
        self._count = 0

    def start(self, slot: memoryview) -> SlotWriter:
        self.writer, self.made = SlotWriter(slot), {}
        return self.writer

    def __call__(self, shape, dtype) -> np.ndarray:
        self._count += 1
        name = f"_{self._count}"
        view = self.writer.allocate(name, dtype, shape)
        self.made[id(view)] = (name, view)
        return view

    def written(self, batch: BuiltBatch) -> dict:
        """:func:`write_batch` of ``batch``, collated with this as its ``empty`` just now."""
        part = write_batch(batch, self.writer, self.made)
        self.made = {}
        return part


def batches_per_message(micro_batch_size: int, seq_len: int, tokenizes: bool) -> int:
    """Micro-batches per message: about ``MESSAGE_TOKENS`` (at most 4), so that the pipe, the
    descriptor and the wake-up are paid once for several; one where sources tokenize online (a
    message would wait for all of them to be tokenized)."""
    if tokenizes:
        return 1
    return max(1, min(4, MESSAGE_TOKENS // (micro_batch_size * seq_len)))


def produce_batches(lanes: dict, plan: BatchPlan, worker_id: int, start_position: int, ship_state) -> Iterator:
    """Worker ``worker_id``'s micro-batches from ``start_position`` (a micro-batch boundary) on,
    endless, ``plan.per_message`` at a time; ``ship_state(lane_id, lane)``: the state to ship (the
    run's ``StateEncoder.ship``). Yields the descriptor maker of each message (``write(slot,
    rows_wanted)``: its micro-batches collated into the slot, or shipped for the trainer to
    collate, as rows (bulk concat rows, :func:`write_rows`) or items (:func:`_items_part`), where
    ``plan.rows`` says so: ``"loader_bound"``, while the trainer asks for them, ``rows_wanted``)."""
    if plan.rows not in ROWS_POLICIES:
        raise ValueError(f"BatchPlan(rows={plan.rows!r}): must be one of {list(ROWS_POLICIES)}")
    slot_arrays = SlotArrays()
    collator = Collator(**plan.collator, empty=slot_arrays)
    mbs, stride, num_lanes = plan.micro_batch_size, plan.world_size, plan.num_lanes
    source_of = next(iter(lanes.values())).spec.schedule.source_of
    bulk = all(lane.bulk_rows for lane in lanes.values())
    # Shipped for the trainer to collate: bulk rows as rows, other micro-batches as items; bulk rows
    # whose features a batch reads are collated here (their features would have to travel too).
    as_rows = plan.rows != "never" and (not bulk or not collator.needed_features)
    always = plan.rows == "always"
    micro_batch = start_position // mbs
    while True:
        pending = []  # (position, collate, taken rows or None, states, sources, padding, rejects) per micro-batch
        while len(pending) < plan.per_message:
            if plan.worker_of(micro_batch) == worker_id:
                pending.append(_cut(lanes, collator, plan, micro_batch, source_of, bulk, ship_state))
            micro_batch += 1

        def write(slot: memoryview, rows_wanted: bool = False, pending=pending) -> dict:
            writer = slot_arrays.start(slot)
            rows = as_rows and (rows_wanted or always)
            batches, items = [], []  # items: those of every micro-batch shipped as items, in order
            for position, collate, taken, *rest in pending:
                if rows and type(taken) is tuple:
                    batches.append(write_rows(BuiltBatch(position, {}, *rest), taken, writer, collator.reads_segments))
                elif rows and type(taken) is list:
                    batches.append(_items_part(BuiltBatch(position, {}, *rest), len(items), len(taken)))
                    items += taken
                else:
                    batches.append(slot_arrays.written(BuiltBatch(position, collate(), *rest)))
            message = {"kind": "batch", "batches": batches}
            if items:  # one item message for all of them, in the rest of the slot (written last)
                message["items_at"] = writer.offset
                message["items"] = write_message(items, writer.slot[writer.offset:], collator.reads_segments)
            message["io"] = IO.delta_to_ship()
            return message

        yield write


def _cut(lanes: dict, collator: Collator, plan: BatchPlan, micro_batch: int, source_of, bulk: bool, ship_state):
    """One micro-batch's sequences taken from the lanes now (their states after it), collated later."""
    mbs, stride, num_lanes = plan.micro_batch_size, plan.world_size, plan.num_lanes
    position = micro_batch * mbs
    first = plan.rank + position * stride
    taken = take_rows(lanes, num_lanes, source_of, first, stride, mbs) if bulk else None
    if taken is not None:
        fills, rows, sources, lane_ids = taken
        padding, rejects = None, None  # full rows
        collate = lambda: collator.collate_rows(fills, rows, sources, first, stride, position + mbs)  # noqa: E731
        taken = (fills, rows, first, stride)
    else:
        items = [produce_one(lanes[(first + k * stride) % num_lanes], first + k * stride, False) for k in range(mbs)]
        if any(isinstance(item, End) for item in items):
            raise RuntimeError("internal error: a lane of an endless run ran out (item messages handle ends)")
        sources = [item.source_id for item in items]
        lane_ids = [item.global_index % num_lanes for item in items]
        padding = [item.sequence.padding for item in items]
        padding = padding if any(padding) else None  # None: full rows (MetricsRecorder.count_rows)
        rejects = _merged([item.chat_rejects for item in items])
        collate = lambda: collator.collate(items, position + mbs)  # noqa: E731
        taken = items
    # taken: (fills, rows, first index, stride) of bulk rows, or the items (write_rows, _items_part)
    return position, collate, taken, [[l, ship_state(l, lanes[l])] for l in lane_ids], sources, padding, rejects


def _merged(rejects: list) -> Optional[dict]:
    out = None
    for counts in rejects:
        for reason, count in (counts or {}).items():
            out = {} if out is None else out
            out[reason] = out.get(reason, 0) + count
    return out


def write_batch(built: BuiltBatch, writer: SlotWriter, made: Optional[dict[int, tuple]] = None) -> dict:
    """One micro-batch's part of a message's descriptor, its arrays in ``writer``'s slot (see the
    module docstring); ``made``: the arrays already built there (:class:`SlotArrays`), not copied."""
    values, layout = {}, {}
    for key, value in built.batch.items():
        if type(value) is not np.ndarray:
            values[key] = value
        elif made and id(value) in made:
            layout[key] = writer.layout[made[id(value)][0]]
        else:
            name = f"{built.position}.{key}"
            writer.write(name, value)
            layout[key] = writer.layout[name]
    return _part(built, keys=list(built.batch), values=values, layout=layout)


def _part(built: BuiltBatch, **fields) -> dict:
    """A micro-batch's part of a message's descriptor: what every form of it carries (its
    position, lane states, sources, padding and rejects, read by :class:`ShippedBatch`) and
    ``fields``, those of its form (collated arrays, rows or items)."""
    return {"position": built.position, **fields, "lane_states": built.lane_states, "source_ids": built.source_ids,
            "padding": built.padding, "rejects": built.rejects}


def write_rows(built: BuiltBatch, taken: tuple, writer: SlotWriter, segments: bool) -> dict:
    """A micro-batch of bulk concat rows as the rows themselves: their token ids as they are
    (int32) and, with ``segments``, their document starts (``doc_counts`` per row), which the
    trainer collates (:meth:`ShippedBatch.collated`)."""
    fills, rows, first, stride = taken
    ids = [fill.input_ids[row] for fill, row in zip(fills, rows)]
    name = f"{built.position}.rows"
    np.concatenate(ids, out=writer.allocate(name, ids[0].dtype, (len(ids) * len(ids[0]),)))
    layout = {"input_ids": writer.layout[name]}
    part = _part(built, rows=(first, stride), layout=layout)
    if segments:
        starts = [fill.row_doc_starts(row) for fill, row in zip(fills, rows)]
        writer.write(f"{built.position}.doc_starts", np.concatenate(starts))
        layout["doc_starts"] = writer.layout[f"{built.position}.doc_starts"]
        part["doc_counts"] = [len(s) for s in starts]
    return part


def _items_part(built: BuiltBatch, start: int, count: int) -> dict:
    """A micro-batch of other sequences (best fit, a block's last rows), shipped as items
    ``start .. start + count`` of its message's one item message (``items``, at ``items_at`` in
    the slot: :func:`~loader.workers.messages.write_message`), which the trainer collates
    (:meth:`ShippedBatch.collated`); its lanes' states travel with the batch, not per item."""
    return _part(built, items=(start, start + count))


class _ShippedRows(MessageRows):
    """The ``fill`` of :meth:`Collator.collate_rows` for shipped rows: row ``k`` of ``input_ids``."""

    __slots__ = ("input_ids",)

    def __init__(self, input_ids: np.ndarray, doc_starts: Optional[np.ndarray], counts: Optional[list[int]]) -> None:
        super().__init__(doc_starts, counts)
        self.input_ids = input_ids


class ShippedBatch(BuiltBatch):
    """A micro-batch of a received message, in its slot until it is handed out (:meth:`views` or
    :meth:`copy_out`) or dropped (:meth:`drop`: the lead made it); the slot goes back once every
    micro-batch of the message is settled (:class:`~loader.workers.held.MessageLease`)."""

    def __init__(self, part: dict, slot: memoryview, lease: MessageLease, decode_state,
                 items: Optional[list] = None) -> None:
        # lane_states: a dict here, which the loader's own merges in one call
        super().__init__(part["position"], {}, {lane: decode_state(state) for lane, state in part["lane_states"]},
                         part["source_ids"], part["padding"], part["rejects"])
        self._part, self._slot, self._lease = part, slot, lease
        self._items = items  # shipped as items: this micro-batch's, views of the slot

    def hand_out(self, held: HeldViews, collator: Collator) -> dict:
        """The batch as views of the slot (:meth:`views`), or copied out where the trainer holds
        ``held.limit`` batches already or ``collator`` allocates elsewhere (pinned memory), or
        collated here from shipped rows (:meth:`collated`)."""
        if "rows" in self._part or "items" in self._part:
            return self.collated(collator)
        if collator.empty is np.empty and not held.full():
            return self.views(held)
        return self.copy_out(collator.empty)

    def collated(self, collator: Collator) -> dict:
        """The batch of shipped rows (:func:`write_rows`) or items (:func:`_items_part`), collated
        by the loader's ``collator`` (the one copy out of the slot, which is settled at once)."""
        part = self._part
        if self._items is not None:
            self.batch = collator.collate(self._items, self.position + len(self._items))
            self._items = None
        else:
            arrays = read_arrays(self._slot, part["layout"])
            count = len(self.source_ids)
            fill = _ShippedRows(arrays["input_ids"].reshape(count, -1), arrays.get("doc_starts"),
                                part.get("doc_counts"))
            first, stride = part["rows"]
            self.batch = collator.collate_rows([fill] * count, list(range(count)), self.source_ids, first, stride,
                                               self.position + count)
        self.drop()
        return self.batch

    def views(self, held: HeldViews) -> dict:
        """The batch, every array a view of the slot, all of one owner array whose release
        settles this micro-batch's share of the slot (:meth:`HeldViews.take`)."""
        part = self._part
        owner = np.frombuffer(self._slot, dtype=np.uint8)
        layout, values, ndarray = part["layout"], part["values"], np.ndarray
        batch: dict[str, Any] = {}
        for key in part["keys"]:
            spec = layout.get(key)
            if spec is None:
                batch[key] = values[key]
            else:
                dtype, shape, offset = spec
                batch[key] = ndarray(shape, _DTYPES.get(dtype) or _dtype(dtype), owner, offset)  # its base: owner
        held.take(owner, self._lease)
        self.batch, self._slot = batch, None
        return batch

    def copy_out(self, empty=np.empty) -> dict:
        """The batch, every array copied out of the slot (into ``empty``'s memory: pinned memory too)."""
        part = self._part
        arrays = read_arrays(self._slot, part["layout"])
        values = part["values"]
        batch: dict[str, Any] = {}
        for key in part["keys"]:
            if key in arrays:
                view = arrays[key]
                if empty is np.empty:
                    batch[key] = view.copy()
                else:
                    batch[key] = out = empty(view.shape, view.dtype)
                    np.copyto(out, view)
            else:
                batch[key] = values[key]
        self.batch = batch
        self.drop()
        return batch

    def drop(self) -> None:
        self._slot = None
        self._lease.settle()


_DTYPES: dict[str, np.dtype] = {}  # a layout's dtype strings, parsed once


def _dtype(name: str) -> np.dtype:
    _DTYPES[name] = dtype = np.dtype(name)
    return dtype


def read_batches(descriptor: dict, slot: memoryview, lease_of, decode_state, io: IoCounters = IO) -> list[ShippedBatch]:
    """The micro-batches of a message of :func:`produce_batches`, in position order (in ``slot``,
    under the lease ``lease_of(count)`` makes); the worker's reads it reports are added to ``io``
    (the pool's loader's counters)."""
    receive_shipped(descriptor.get("io"), io)
    lease = lease_of(len(descriptor["batches"]))
    items = None
    if "items" in descriptor:  # micro-batches shipped as items (_items_part); no lease per item
        receive_shipped(descriptor["items"].pop("io", None), io)  # the worker's reads before it
        items = read_message(descriptor["items"], slot[descriptor["items_at"]:], None)
    return [ShippedBatch(part, slot, lease, decode_state, None if "items" not in part else
                         items[part["items"][0] : part["items"][1]]) for part in descriptor["batches"]]
