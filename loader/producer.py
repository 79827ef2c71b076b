"""Producing a rank's sequences in global-index order, in-process or in a worker process.

``produce(...)`` walks the rank's global indices ``r, r+W, r+2W, ...`` from a start position
and yields, for each index whose lane it owns, ``(global_index, source_id, sequence,
lane_state_after)``. The main process runs it directly (``num_workers = 0``) or each worker
process runs it for its subset of lanes and ships the items through a queue; the main
process then merges the workers' items by global index, never by arrival.
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from dataclasses import dataclass
from typing import Iterator, Optional

from loader.lane import Lane, LaneExhausted, LaneSpec
from loader.manifest import Manifest
from loader.packing import PackedSequence

ITEMS_PER_MESSAGE = 8  # sequences per queue message: amortises pickling and queue overhead


@dataclass
class Item:
    global_index: int
    source_id: int
    sequence: PackedSequence
    lane_state: Optional[dict]  # None when the consumer reads lane state directly


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
            lane.set_state(lane_states[lane_id])
        lanes[lane_id] = lane
    return lanes


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
        try:
            source_id, sequence = lane.next_sequence(global_index)
        except LaneExhausted:
            yield End(global_index)
            return
        yield Item(global_index, source_id, sequence, lane.get_state() if snapshot_state else None)


def worker_main(
    spec: LaneSpec,
    lane_ids: list[int],
    lane_states: dict[int, dict],
    *,
    num_lanes: int,
    rank: int,
    world_size: int,
    start_position: int,
    out_queue,
    stop_event,
    parent_pid: int,
) -> None:
    """Entry point of a worker process: produce items until stopped, the parent dies, or an error."""
    # Ctrl-C goes to the whole process group; the main process handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Never block process exit on items the trainer will not read any more.
    out_queue.cancel_join_thread()

    def put(message) -> bool:
        while not stop_event.is_set():
            if os.getppid() != parent_pid:  # orphaned: the trainer is gone
                return False
            try:
                out_queue.put(message, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    try:
        lanes = build_lanes(spec, lane_ids, lane_states)
        batch: list = []
        for item in produce(
            lanes, num_lanes=num_lanes, rank=rank, world_size=world_size,
            start_position=start_position, snapshot_state=True,
        ):
            batch.append(item)
            if isinstance(item, End) or len(batch) >= ITEMS_PER_MESSAGE:
                if not put(("items", batch)):
                    return
                batch = []
                if isinstance(item, End):
                    return
    except BaseException:  # noqa: BLE001 - everything must reach the trainer, with its traceback
        put(("error", traceback.format_exc()))
