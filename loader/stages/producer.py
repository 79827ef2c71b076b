"""Producing a rank's sequences in global-index order, in-process or in a worker process.

``produce(...)`` walks the rank's global indices ``r, r+W, r+2W, ...`` from a start position
and yields, for each index whose lane it owns, ``(global_index, source_id, sequence,
lane_state_after)``. The main process runs it directly (``num_workers = 0``) or each worker
process runs it for its subset of lanes and hands the items over in shared memory
(:mod:`loader.workers`); the main process then merges the workers' items by global index,
never by arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from loader.errors import LaneExhausted
from loader.stages.features import FEATURES, IGNORE_INDEX
from loader.stages.lane import Lane, LaneSpec
from loader.io.manifest import Manifest
from loader.checkpoint.records import StateSnapshot
from loader.io.owner import PROCESS_OWNER, StreamOwner
from loader.stages.packing import PackedSequence


@dataclass
class Item:
    global_index: int
    source_id: int
    sequence: PackedSequence
    lane_state: Optional[dict]  # None when the consumer reads lane state directly
    lease: Any = None  # a worker's shared-memory slot held by ``sequence`` (loader.workers.messages)
    chat_rejects: Optional[dict] = None  # online chat rejects reported with this item (loader.chat.block)


@dataclass(frozen=True)
class End:
    """The lane of ``global_index`` has no data left from that index on.

    Where finite data ends at the first exhausted lane (``epoch_tail = "drop"``) the stream
    ends there. Where tails are filled (``"fill"``) only that lane is done: ``lane_state`` is
    its state then (every source stopped), and the consumer gives the lane's later indices
    fill rows (:func:`fill_item`); ``final`` says that every lane of the producer is done,
    so that it produces nothing more."""

    global_index: int
    lane_state: Optional[dict] = None
    final: bool = True


FILL_SOURCE = -1  # the source id of a fill row (loader.metrics, batch["source_ids"])


def fill_sequence(seq_len: int, pad_id: int, features: tuple[str, ...]) -> PackedSequence:
    """A fill row: all padding, no supervised token (labels -100, every feature at its pad value:
    ``loss_mask`` 0). Shared by every fill of a loader: collation copies it."""
    return PackedSequence(
        input_ids=np.full(seq_len, pad_id, dtype=np.int32),
        labels=np.full(seq_len, IGNORE_INDEX, dtype=np.int32),
        segment_starts=np.zeros(1, dtype=np.int32),
        features={name: np.full(seq_len, FEATURES[name].pad, dtype=FEATURES[name].dtype) for name in features},
        padding=seq_len,
    )


def fill_item(global_index: int, num_lanes: int, exhausted_state: Optional[dict], sequence: PackedSequence) -> Item:
    """The fill row at ``global_index`` of a lane that ran out: its state is the lane's state at
    exhaustion with ``outputs`` counting the fill (a fill is the lane's output at that index,
    so a checkpoint's output counts match the stream position on every lane)."""
    state = None if exhausted_state is None else dict(exhausted_state, outputs=global_index // num_lanes + 1)
    return Item(global_index, FILL_SOURCE, sequence, state)


def build_lanes(spec: LaneSpec, lane_ids: list[int], lane_states: dict[int, dict],
                owner: StreamOwner = PROCESS_OWNER) -> dict[int, Lane]:
    """The lanes ``lane_ids`` of ``spec`` at ``lane_states``; their streams' threads and I/O
    counters are ``owner``'s (the loader's: :mod:`loader.io.owner`)."""
    tokenizer = None
    if spec.tokenizer_json is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    manifests = [Manifest.from_json(s.manifest_json, s.dataset_path) for s in spec.sources]
    lanes = {}
    for lane_id in lane_ids:
        lane = Lane(spec, lane_id, manifests, tokenizer, owner=owner)
        if lane_id in lane_states:
            state = lane_states[lane_id]
            # A snapshot (a worker's cursor state, loader.workers.state_delta) is built now.
            lane.set_state(state.get_state() if isinstance(state, StateSnapshot) else state)
        lanes[lane_id] = lane
    return lanes


def start_reading(lanes: dict[int, Lane], first_index: int, num_lanes: int) -> None:
    """Start the background reads of every lane's current block, in the order the lanes'
    next sequences are asked for from global index ``first_index`` on."""
    for lane_id in sorted(lanes, key=lambda lane_id: (lane_id - first_index) % num_lanes):
        lanes[lane_id].start_reading()


def produce(
    lanes: dict[int, Lane],
    *,
    num_lanes: int,
    rank: int,
    world_size: int,
    start_position: int,
    snapshot_state: bool,
    fill_tails: bool = False,
) -> Iterator[Item | End]:
    """The items of ``lanes`` from ``start_position`` on. Without ``fill_tails`` the first
    :class:`End` is the last item; with it, each lane's End says that lane is done (its later
    indices are skipped: the consumer fills them) and the End of the last lane is ``final``."""
    position = start_position
    done: set[int] = set()
    while True:
        global_index = rank + position * world_size
        position += 1
        lane_id = global_index % num_lanes
        lane = lanes.get(lane_id)
        if lane is None or lane_id in done:
            continue
        item = produce_one(lane, global_index, snapshot_state, end_state=fill_tails)
        if isinstance(item, End) and fill_tails:
            done.add(lane_id)
            item = End(global_index, item.lane_state, final=len(done) == len(lanes))
        yield item
        if isinstance(item, End) and item.final:
            return


def produce_one(lane: Lane, global_index: int, snapshot_state: bool, end_state: bool = False) -> Item | End:
    """The item of ``global_index`` from its lane (the caller walks the indices in order);
    ``end_state``: an :class:`End` carries the lane's state (filled tails need it)."""
    try:
        source_id, sequence = lane.next_sequence(global_index)
    except LaneExhausted:
        return End(global_index, lane.get_state() if snapshot_state or end_state else None)
    # Positional, and no rejects call for lanes without online chat: this runs per sequence.
    return Item(global_index, source_id, sequence, lane.get_state() if snapshot_state else None, None,
                lane.take_chat_rejects() if lane.has_online_chat else None)


def take_rows(lanes: dict[int, Lane], num_lanes: int, source_of, first_index: int, stride: int,
              count: int) -> Optional[tuple[list, list, list, list]]:
    """The ``count`` sequences at ``first_index, first_index + stride, ...`` (on distinct lanes
    of ``lanes``, all :attr:`~loader.stages.lane.Lane.bulk_rows`) as ``(fills, rows, source ids,
    lane ids)``, each row of a concat packer's fill
    (:meth:`~loader.stages.packing.ConcatPacker.take_fill_row`), when every one of them is a bulk
    row; else None, having taken none (the caller makes them one by one with
    :func:`produce_one`: a block's last row, a stopped source, the end). ``source_of``: the
    mixing schedule's.

    What :func:`produce_one` would make, without an item or a row object per sequence: the
    per-sequence Python was most of the trainer's time in pre-tokenized replay
    (bench/HISTORY.md, "Issue 35: in-process replay in bulk").
    """
    packers, sources, lane_ids = [], [], []
    global_index = first_index
    for _ in range(count):
        lane_id = global_index % num_lanes
        lane = lanes[lane_id]
        source_id = source_of(global_index)
        packer = lane.packers[source_id]
        if lane.stopped[source_id] or (packer._next_row >= packer._fill_rows and not packer.rows_waiting()):
            return None
        packers.append(packer)
        sources.append(source_id)
        lane_ids.append(lane_id)
        global_index += stride
    fills, rows = [], []
    for packer, lane_id in zip(packers, lane_ids):
        fill, row = packer.take_fill_row()
        lanes[lane_id].outputs += 1
        fills.append(fill)
        rows.append(row)
    return fills, rows, sources, lane_ids
