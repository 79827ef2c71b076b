"""The loader checkpoint: a versioned, JSON-only schema, and merging rank states.

A state is plain JSON (never pickle)::

    {
      "format": "zephon.loader_state", "version": 3,
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

Nothing in a state is trusted: :mod:`loader.checkpoint.schema` checks every field on load and
names the JSON path of each bad one (``lanes.00017.sources.web.packer.stream.block``). A state
of an older version is upgraded first (:mod:`loader.checkpoint.migrations`: version 2 added the
best-fit bins' ``piece_origins``).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

import numpy as np

from loader.checkpoint.migrations import upgrade
from loader.checkpoint.records import StateSnapshot, lane_key  # noqa: F401  (lane_key: also importable from here)
from loader.checkpoint.schema import parse_header
from loader.checkpoint.version import STATE_FORMAT, STATE_VERSION  # noqa: F401  (also importable from here)
from loader.errors import StateError


def to_jsonable(value: Any) -> Any:
    """Numpy arrays and scalars inside lane states become lists and ints."""
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, StateSnapshot):  # built now, as it was when taken
        return to_jsonable(value.get_state())
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def check_header(state: Any) -> None:
    """Refuse a state whose top level is malformed, naming the JSON path of every bad field
    (:func:`loader.checkpoint.schema.parse_header`; lanes are checked on load)."""
    parse_header(state)


def _describe_transforms(entries: list) -> str:
    if not entries:
        return "none"
    parts = []
    for entry in entries:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted((entry.get("args") or {}).items()))
        version = f" v{entry['version']}" if entry.get("version") is not None else ""
        parts.append(f"{entry.get('function')}({args}){version}")
    return "[" + ", ".join(parts) + "]"


def transform_differences(state: dict, expected: dict) -> dict[str, str]:
    """Per source whose transforms differ between the checkpoint and now: what each has."""
    saved = (state.get("transforms") or {}).get("sources", {})
    now = (expected.get("transforms") or {}).get("sources", {})
    names = [s["name"] for s in expected["sources"]] + sorted(set(saved) | set(now))
    differences = {}
    for name in dict.fromkeys(names):
        if saved.get(name, []) != now.get(name, []):
            differences[name] = (f"transforms of source {name!r}: checkpoint {_describe_transforms(saved.get(name, []))}, "
                                 f"now {_describe_transforms(now.get(name, []))}")
    return differences


def compare_with(state: dict, expected: dict, allow_transform_change: bool = False) -> None:
    """Refuse a resume whose stream-defining settings differ; name every difference by its JSON path.

    Different transforms are a difference unless ``allow_transform_change`` (the config
    declares from which step they take effect: ``transforms_from_step``)."""
    differences = []
    transforms = transform_differences(state, expected)
    if state["num_lanes"] != expected["num_lanes"]:
        differences.append(f"num_lanes (lane count L): checkpoint {state['num_lanes']}, now {expected['num_lanes']}")
    tail = _epoch_tail_difference(state["config"], expected["config"])
    if tail is not None:
        differences.append(tail)
    for key, now in expected["config"].items():
        if key == "epoch_tail":
            continue
        if key not in state["config"]:
            differences.append(f"config.{key}: missing from the checkpoint, now {now!r}")
            continue
        saved = state["config"][key]
        if saved != now or type(saved) is not type(now):  # True == 1, but a bool is not a count
            differences.append(f"config.{key}: checkpoint {saved!r}, now {now!r}")
    for key in state["config"]:
        if key not in expected["config"] and key != "epoch_tail":
            differences.append(f"config.{key}: not a stream setting of this Zephon (checkpoint {state['config'][key]!r})")
    if transforms and not allow_transform_change:
        differences.extend(transforms.values())
    if state.get("config_fingerprint") != expected["config_fingerprint"] and not differences and not transforms:
        differences.append(
            f"config_fingerprint: checkpoint {str(state.get('config_fingerprint'))[:12]}... does not match "
            f"its own config (now {expected['config_fingerprint'][:12]}...)"
        )
    if state.get("tokenizer_fingerprint") != expected["tokenizer_fingerprint"]:
        differences.append(
            "tokenizer_fingerprint, tokenizer: checkpoint fingerprint "
            f"{str(state.get('tokenizer_fingerprint'))[:12]}..., now {expected['tokenizer_fingerprint'][:12]}..."
        )
    saved_sources = [(s["name"], s["dataset_fingerprint"]) for s in state["sources"]]
    now_sources = [(s["name"], s["dataset_fingerprint"]) for s in expected["sources"]]
    if [n for n, _ in saved_sources] != [n for n, _ in now_sources]:
        differences.append(f"sources[].name (datasets): checkpoint {[n for n, _ in saved_sources]}, "
                           f"now {[n for n, _ in now_sources]}")
    else:
        for k, ((name, saved_fp), (_, now_fp)) in enumerate(zip(saved_sources, now_sources)):
            if saved_fp != now_fp:
                differences.append(f"sources[{k}].dataset_fingerprint, dataset {name!r}: checkpoint fingerprint "
                                   f"{saved_fp[:12]}..., now {now_fp[:12]}...")
    if differences:
        raise StateError(
            "cannot resume: the checkpoint was made with a different data configuration; "
            "a resume must keep seed, lanes, seq_len, tokenizer, packing and datasets. Differences:\n  - "
            + "\n  - ".join(differences)
            + ("\n(to change transforms on resume, set transforms_from_step = the resume step in the config: "
               "the new transforms then apply from that step on, recorded in the checkpoint)" if transforms
               and not allow_transform_change else "")
        )


def _epoch_tail_difference(saved: dict, now: dict) -> Optional[str]:
    """How finite data ends differs (``config.epoch_tail``; absent: "drop", the only way a
    Zephon before the option ended it, and the way a "drop" config records it)."""
    saved_tail, now_tail = saved.get("epoch_tail", "drop"), now.get("epoch_tail", "drop")
    if saved_tail == now_tail:
        return None
    return (f"config.epoch_tail: checkpoint {saved_tail!r}, now {now_tail!r} (a checkpoint of finite data "
            "made before epoch_tail existed ends its stream at the first exhausted lane, as \"drop\" does; "
            f"set epoch_tail = {saved_tail!r} in the config to continue its stream exactly; "
            "docs/guides/finite-epochs.md)")


def merge_rank_states(states: Iterable[dict]) -> dict:
    """Merge the rank-local states of one step into one global, topology-free state."""
    states = [upgrade(s) for s in states]
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
        raise StateError(
            f"need one state per rank 0..{world_size - 1} (got ranks {ranks}); gather the states of all "
            "data-parallel ranks. If the processes gathered are one data-parallel group under tensor/pipeline "
            "parallelism, the loaders were built from the global RANK/WORLD_SIZE: construct them with "
            "dp_rank/dp_world_size (or device_mesh=..., dp_mesh_dim=...) so that peers share a rank"
        )
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
    """A state as compact JSON text, keys sorted (``loader.state_to_json``): the form to write
    beside a checkpoint; :func:`loads` reads it back."""
    return json.dumps(to_jsonable(state), sort_keys=True, separators=(",", ":"))


def loads(text: str) -> dict:
    """Parse a state from JSON text (JSON only: never pickle), upgrade it to the current version
    (:mod:`loader.checkpoint.migrations`) and check its top level."""
    try:
        state = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError, bytes that are not UTF-8
        raise StateError(f"a loader state must be JSON text ({exc.__class__.__name__}: {exc})") from None
    state = upgrade(state)
    check_header(state)
    return state
