"""Transforms in the loader's checkpoint: the header entry, a declared change on resume, counters.

A checkpoint records the transforms of every source that has some (resolved: the function's
declared version and stage filled in) and the changes made on resume::

    "transforms": {"sources": {"web": [{"function": "drop_regex", "args": {...}, "version": "1",
                                        "stage": "text"}]},
                   "changes": [{"step": 1200, "sources": ["web"]}]}

The key is absent when no source has transforms and none was ever changed, so states of
configs without transforms are byte-identical to what they were before transforms existed.

A resume with other transforms is refused, naming each source's old and new transforms,
unless the config declares ``transforms_from_step`` at or before the resume step: the new
transforms then apply from the resume step on, and the change is appended to ``changes``.
Each stream of a changed source resumes its row group at the same token offset moved forward
to the next document start (the offset counted tokens of the old transformed block), and its
counters start again from zero (:meth:`loader.io.lane_reader.LaneTokenStream.set_state`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from loader.errors import StateError
from loader.checkpoint.state import transform_differences, to_jsonable
from loader.io.cursor_record import TRANSFORMS
from loader.stages.lane_record import MIXED, PACKER, SOURCES
from loader.stages.mixed_record import SOURCES as MIXED_SOURCES
from loader.stages.packer_records import STREAM
from loader.transforms.chain import TransformCounts
from loader.transforms.spec import TransformSpec


def header_entry(source_names: Sequence[str], source_transforms: Sequence[Sequence[TransformSpec]],
                 changes: list[dict]) -> Optional[dict]:
    sources = {name: [spec.to_entry() for spec in specs] for name, specs in zip(source_names, source_transforms)
               if specs}
    if not sources and not changes:
        return None
    return {"sources": sources, "changes": list(changes)}


def accepted_change(state: dict, expected: dict, *, from_step: Optional[int], resume_step: int,
                    token_mixing: bool) -> Optional[dict]:
    """The change a resume makes (``{"step", "sources"}``), None when the transforms are the same
    or the change is not declared (``compare_with`` then refuses it, naming the differences)."""
    differences = transform_differences(state, expected)
    if not differences or from_step is None:
        return None
    listed = "\n  - ".join(differences.values())
    if from_step > resume_step:
        raise StateError(
            f"cannot resume: transforms_from_step = {from_step} is after the checkpoint's step {resume_step}, and "
            f"the transforms before step {from_step} are not the config's:\n  - {listed}\nResume from a checkpoint "
            f"at step >= {from_step}, or set transforms_from_step = {resume_step} to apply the new transforms from "
            "the resume step on")
    if token_mixing:
        raise StateError(
            "cannot resume: the transforms changed and this loader mixes by token (mixing_unit = \"token\"), "
            f"whose per-source document windows cannot be moved to the new documents:\n  - {listed}\nKeep the "
            "checkpoint's transforms, or start the token mix afresh")
    return {"step": resume_step, "sources": list(differences)}


def marked_lane_state(lane_state: dict, changed_sources: Sequence[str], marker: str) -> dict:
    """A copy of a lane state whose streams of ``changed_sources`` carry ``marker`` (the user's
    state is not touched)."""
    sources = lane_state.get(SOURCES)
    if sources is None:
        return lane_state
    copy = dict(lane_state, **{SOURCES: dict(sources)})
    for name in changed_sources:
        if name in sources:
            saved = sources[name]
            packer = dict(saved[PACKER])
            packer[STREAM] = dict(packer[STREAM], **{marker: True})
            copy[SOURCES][name] = dict(saved, **{PACKER: packer})
    return copy


def counts_report(source_names: Sequence[str], source_transforms: Sequence[Sequence[TransformSpec]],
                  lane_states: Sequence[dict],
                  offline_transforms: Optional[Sequence[Sequence[str]]] = None) -> dict[str, dict[str, dict[str, int]]]:
    """``{source: {"k:function": {"dropped": n, "changed": n}}}`` summed over lane states.

    ``offline_transforms``: per source, the functions of the ``zephon shard --transform`` list
    its tombstones point into (``Manifest.tombstone_transforms``); their skipped tombstones are
    reported as ``"shard:k:function"`` (dropped only), before the config's transforms.
    """
    report: dict[str, dict[str, dict[str, int]]] = {}
    for k, (name, specs) in enumerate(zip(source_names, source_transforms)):
        offline = tuple(offline_transforms[k]) if offline_transforms is not None else ()
        if not specs and not offline:
            continue
        labels = [f"shard:{p}:{function}" for p, function in enumerate(offline)] + \
            [f"{p}:{spec.label}" for p, spec in enumerate(specs)]
        total = TransformCounts.zeros(len(labels))
        for lane in lane_states:
            for stream in _streams_of(lane, name, k):
                saved = stream.get(TRANSFORMS)
                if saved is not None and len(saved) == len(labels):
                    total.add(TransformCounts.from_state(saved))
        report[name] = {label: {"dropped": dropped, "changed": changed}
                        for label, (dropped, changed) in zip(labels, total.counts)}
    return report


def _streams_of(lane: dict, name: str, index: int) -> list[dict]:
    if MIXED in lane:
        sources = lane[MIXED][STREAM].get(MIXED_SOURCES, [])
        return [sources[index]] if index < len(sources) else []
    source = lane.get(SOURCES, {}).get(name)
    return [source[PACKER][STREAM]] if source is not None else []


def as_plain(value: Any) -> Any:
    return to_jsonable(value)
