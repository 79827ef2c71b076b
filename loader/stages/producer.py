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

from loader.errors import LaneExhausted
from loader.stages.lane import Lane, LaneSpec
from loader.io.manifest import Manifest
from loader.stages.packing import PackedSequence, StateSnapshot


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
    """The lane of ``global_index`` has no data left: the stream ends there."""

    global_index: int


def build_lanes(spec: LaneSpec, lane_ids: list[int], lane_states: dict[int, dict]) -> dict[int, Lane]:
    tokenizer = None
    if spec.tokenizer_json is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    manifests = [Manifest.from_json(s.manifest_json, s.dataset_path) for s in spec.sources]
    lanes = {}
    for lane_id in lane_ids:
        lane = Lane(spec, lane_id, manifests, tokenizer)
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
) -> Iterator[Item | End]:
    position = start_position
    while True:
        global_index = rank + position * world_size
        position += 1
        lane = lanes.get(global_index % num_lanes)
        if lane is None:
            continue
        item = produce_one(lane, global_index, snapshot_state)
        yield item
        if isinstance(item, End):
            return


def produce_one(lane: Lane, global_index: int, snapshot_state: bool) -> Item | End:
    """The item of ``global_index`` from its lane (the caller walks the indices in order)."""
    try:
        source_id, sequence = lane.next_sequence(global_index)
    except LaneExhausted:
        return End(global_index)
    # Positional, and no rejects call for lanes without online chat: this runs per sequence.
    return Item(global_index, source_id, sequence, lane.get_state() if snapshot_state else None, None,
                lane.take_chat_rejects() if lane.has_online_chat else None)
