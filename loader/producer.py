"""Producing a rank's sequences in global-index order, in-process or in a worker process.

``produce(...)`` walks the rank's global indices ``r, r+W, r+2W, ...`` from a start position
and yields, for each index whose lane it owns, ``(global_index, source_id, sequence,
lane_state_after)``. The main process runs it directly (``num_workers = 0``) or each worker
process runs it for its subset of lanes and ships the items through a queue; the main
process then merges the workers' items by global index, never by arrival.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

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


def pack_items(items: list) -> dict:
    """One queue message for a worker's consecutive items (an :class:`End` only last).

    The sequences travel as one ``[k, seq_len]`` array per field rather than ``3k`` small
    arrays: pickling and unpickling cost per object, not per byte, at these sizes (about
    half the per-sequence transfer cost). :func:`unpack_items` restores the items.
    """
    end = items[-1] if items and isinstance(items[-1], End) else None
    items = items[:-1] if end is not None else items
    sequences = [it.sequence for it in items]
    message = {
        "global_index": [it.global_index for it in items],
        "source_id": [it.source_id for it in items],
        "lane_state": [it.lane_state for it in items],
        "segment_counts": [len(s.segment_starts) for s in sequences],
        "end": end,
    }
    if sequences:
        message["input_ids"] = np.stack([s.input_ids for s in sequences])
        message["labels"] = np.stack([s.labels for s in sequences])
        message["segment_starts"] = np.concatenate([s.segment_starts for s in sequences])
        token_sources = [s.token_sources for s in sequences]
        if all(t is not None for t in token_sources):
            token_sources = np.stack(token_sources)
        elif all(t is None for t in token_sources):
            token_sources = None
        message["token_sources"] = token_sources  # else: the list as it is
    return message


def unpack_items(message: dict) -> list:
    """The items of a :func:`pack_items` message; their arrays are views of the message's."""
    items: list = []
    if message["global_index"]:
        input_ids, labels, token_sources = message["input_ids"], message["labels"], message["token_sources"]
        segment_starts = message["segment_starts"]
        bounds = np.cumsum([0] + message["segment_counts"]).tolist()
        for row, (global_index, source_id, lane_state) in enumerate(
            zip(message["global_index"], message["source_id"], message["lane_state"])
        ):
            sequence = PackedSequence(
                input_ids=input_ids[row], labels=labels[row],
                segment_starts=segment_starts[bounds[row] : bounds[row + 1]],
                token_sources=None if token_sources is None else token_sources[row],
            )
            items.append(Item(global_index, source_id, sequence, lane_state))
    if message["end"] is not None:
        items.append(message["end"])
    return items


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
    return Item(global_index, source_id, sequence, lane.get_state() if snapshot_state else None)


def write_worker_input(directory: str, worker_id: int, spec: LaneSpec, lane_ids: list[int],
                       lane_states: dict[int, dict]) -> str:
    """Hand a worker its (large) inputs through a private file rather than the spawn pipe.

    Through the pipe, ``Process.start()`` blocks for good when the child dies before reading
    (for example a script without the ``if __name__ == "__main__":`` guard); with a file the
    parent just sees the worker die and raises. The file is ours, made by this process with
    mode 0600, and removed when the run closes: nothing a user hands us is unpickled.
    """
    path = os.path.join(directory, f"worker-{worker_id}.pickle")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
        pickle.dump((spec, lane_ids, lane_states), fh, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def worker_main(
    input_path: str,
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

    def put(message) -> bool:
        while not stop_event.is_set():
            if os.getppid() != parent_pid:  # orphaned: the trainer is gone
                break
            try:
                out_queue.put(message, timeout=0.5)
                return True
            except queue.Full:
                continue
        # Never block process exit on items the trainer will not read any more.
        out_queue.cancel_join_thread()
        return False

    def deliver() -> None:
        """Exit only once the queue's feeder thread has written the last message (End or error).

        Exiting with it still buffered loses it: the trainer would see a silent exit instead
        of the end of the data or the traceback. Gives up when stopped or orphaned.
        """
        out_queue.close()
        flusher = threading.Thread(target=out_queue.join_thread, daemon=True)
        flusher.start()
        while flusher.is_alive() and not stop_event.is_set() and os.getppid() == parent_pid:
            flusher.join(0.2)
        if flusher.is_alive():
            out_queue.cancel_join_thread()

    try:
        with open(input_path, "rb") as fh:
            spec, lane_ids, lane_states = pickle.load(fh)
        lanes = build_lanes(spec, lane_ids, lane_states)
        batch: list = []
        for item in produce(
            lanes, num_lanes=num_lanes, rank=rank, world_size=world_size,
            start_position=start_position, snapshot_state=True,
        ):
            batch.append(item)
            if isinstance(item, End) or len(batch) >= ITEMS_PER_MESSAGE:
                if not put(("items", pack_items(batch))):
                    return
                batch = []
                if isinstance(item, End):
                    deliver()
                    return
    except BaseException:  # noqa: BLE001 - everything must reach the trainer, with its traceback
        if put(("error", traceback.format_exc())):
            deliver()
