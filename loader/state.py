"""The loader checkpoint: a versioned, JSON-only schema, and merging rank states.

A state is plain JSON (never pickle)::

    {
      "format": "zephon.loader_state", "version": 1,
      "next_global_index": 4096,          # global states: a step boundary (t * B)
      "rank": 0, "world_size": 4,         # rank-local states only
      "rank_position": 1024,              # rank-local: sequences this rank has consumed
      "num_lanes": 64,
      "config": {...},                    # LoaderConfig.stream_fields(): seed, seq_len, B, packing, ...
      "config_fingerprint": "...",
      "tokenizer_fingerprint": "...",
      "sources": [{"name": "web", "dataset_fingerprint": "...", "exhaustion": "repeat", "max_epochs": null}],
      "schedule": [{"step": 0, "weights": {"web": "7/10", "code": "3/10"}}],
      "lanes": {"00003": {"outputs": 17, "sources": {"web": {"packer": {...}, "stopped": false}}}}
    }

A rank-local state holds the rank's own lanes. :func:`merge_rank_states` turns the W rank
states of one step into the global state, which any rank of any topology can load (each
takes its lanes). The size is bounded by ``L x (cursor + packer bound)``; it does not grow
with the step.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import numpy as np

from loader.errors import ZephonError

STATE_FORMAT = "zephon.loader_state"
STATE_VERSION = 1


class StateError(ZephonError, ValueError):
    """A checkpoint that cannot be loaded here; the message names what differs."""


def lane_key(lane_id: int) -> str:
    return f"{lane_id:05d}"


def to_jsonable(value: Any) -> Any:
    """Numpy arrays and scalars inside lane states become lists and ints."""
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def check_header(state: Any) -> None:
    if not isinstance(state, dict):
        raise StateError(f"a loader state must be a JSON object (got {type(state).__name__})")
    if state.get("format") != STATE_FORMAT:
        raise StateError(f"not a Zephon loader state (format={state.get('format')!r}, expected {STATE_FORMAT!r})")
    version = state.get("version")
    if version != STATE_VERSION:
        raise StateError(
            f"loader state version {version!r} is not supported by this Zephon (supports {STATE_VERSION})"
        )
    missing = [k for k in ("num_lanes", "config", "sources", "lanes", "schedule") if k not in state]
    if missing:
        raise StateError(f"loader state is missing field(s) {missing}")


def compare_with(state: dict, expected: dict) -> None:
    """Refuse a resume whose stream-defining settings differ; name every difference."""
    differences = []
    if state["num_lanes"] != expected["num_lanes"]:
        differences.append(f"num_lanes (lane count L): checkpoint {state['num_lanes']}, now {expected['num_lanes']}")
    for key, now in expected["config"].items():
        saved = state["config"].get(key)
        if saved != now:
            differences.append(f"{key}: checkpoint {saved!r}, now {now!r}")
    if state.get("tokenizer_fingerprint") != expected["tokenizer_fingerprint"]:
        differences.append(
            "tokenizer: checkpoint fingerprint "
            f"{str(state.get('tokenizer_fingerprint'))[:12]}..., now {expected['tokenizer_fingerprint'][:12]}..."
        )
    saved_sources = [(s["name"], s["dataset_fingerprint"]) for s in state["sources"]]
    now_sources = [(s["name"], s["dataset_fingerprint"]) for s in expected["sources"]]
    if [n for n, _ in saved_sources] != [n for n, _ in now_sources]:
        differences.append(f"datasets (source names): checkpoint {[n for n, _ in saved_sources]}, now {[n for n, _ in now_sources]}")
    else:
        for (name, saved_fp), (_, now_fp) in zip(saved_sources, now_sources):
            if saved_fp != now_fp:
                differences.append(f"dataset {name!r}: checkpoint fingerprint {saved_fp[:12]}..., now {now_fp[:12]}...")
    if differences:
        raise StateError(
            "cannot resume: the checkpoint was made with a different data configuration; "
            "a resume must keep seed, lanes, seq_len, tokenizer, packing and datasets. Differences:\n  - "
            + "\n  - ".join(differences)
        )


def merge_rank_states(states: Iterable[dict]) -> dict:
    """Merge the rank-local states of one step into one global, topology-free state."""
    states = list(states)
    if not states:
        raise StateError("merge_rank_states needs at least one state")
    for state in states:
        check_header(state)
        if "rank" not in state:
            raise StateError("merge_rank_states takes rank-local states (from ZephonLoader.state_dict())")
    states = _one_per_rank(states)
    world_size = states[0]["world_size"]
    ranks = sorted(s["rank"] for s in states)
    if ranks != list(range(world_size)):
        raise StateError(f"need one state per rank 0..{world_size - 1} (got ranks {ranks})")
    positions = {s["rank_position"] * world_size for s in states}
    if len(positions) != 1:
        raise StateError(
            f"rank states are from different points of the stream (sequences consumed x W: {sorted(positions)}); "
            "save all ranks at the same step"
        )
    next_global_index = positions.pop()
    batch = states[0]["config"]["global_batch_size"]
    if next_global_index % batch:
        raise StateError(
            f"rank states were saved mid-step (next global index {next_global_index} is not a multiple "
            f"of global_batch_size={batch}); save after a whole optimizer step"
        )
    reference = {k: v for k, v in states[0].items() if k not in ("lanes", "rank", "rank_position")}
    lanes: dict[str, Any] = {}
    for state in states:
        compare_with(state, reference)
        overlap = set(lanes) & set(state["lanes"])
        if overlap:
            raise StateError(f"lanes {sorted(overlap)} appear in more than one rank state")
        lanes.update(state["lanes"])
    if len(lanes) != reference["num_lanes"]:
        raise StateError(f"merged states hold {len(lanes)} lanes, expected {reference['num_lanes']}")
    merged = {k: v for k, v in reference.items() if k != "world_size"}
    merged["next_global_index"] = next_global_index
    merged["lanes"] = dict(sorted(lanes.items()))
    return merged


def _one_per_rank(states: list[dict]) -> list[dict]:
    """Identical states of one rank merged once: tensor/pipeline-parallel peers of a data-parallel
    rank hold the same lanes. Different states claiming one rank cannot both be right."""
    by_rank: dict[Any, dict] = {}
    for state in states:
        rank = state["rank"]
        if rank in by_rank and by_rank[rank] != state:
            raise StateError(
                f"two different states claim rank {rank}: processes that share a data-parallel rank must "
                "hold the same lanes. Under tensor/pipeline parallelism construct the loader with "
                "dp_rank/dp_world_size (or device_mesh=..., dp_mesh_dim=...), not the global RANK"
            )
        by_rank.setdefault(rank, state)
    return list(by_rank.values())


def dumps(state: dict) -> str:
    return json.dumps(to_jsonable(state), sort_keys=True, separators=(",", ":"))


def loads(text: str) -> dict:
    state = json.loads(text)
    check_header(state)
    return state
