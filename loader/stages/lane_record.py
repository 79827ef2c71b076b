"""The checkpoint record of a lane (:class:`~loader.stages.lane.Lane`): the one form of a lane state.

State keys::

    outputs    sequences the lane has produced
    sources    per source name {packer, stopped}: the source's packer record (loader.stages.packer_records)
               and whether the source has run out in this lane
    mixed      token mixing, instead of ``sources``: the one packer of the lane's mixed stream

Everything that makes a lane state (the lane itself, a worker's shipped cursors, the audit's
seeks and replays) builds it with :func:`lane_state`; the schema reads it with
:func:`parse_lane` into a :class:`LaneState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from loader.checkpoint.records import RecordContext, RecordType, record_type, register_record
from loader.stages.packer_records import PackerState, concat_state  # (and registers the packer records)
from loader.validation import Problems, fields_of, json_bool, json_int

OUTPUTS = "outputs"
SOURCES = "sources"
MIXED = "mixed"
PACKER = "packer"
STOPPED = "stopped"


def lane_state(source_names: Sequence[str], token_mixing: bool, outputs: int, parts: Sequence,
               stopped: Iterable[bool]) -> dict:
    """A lane's state from its output count, its packers' states (one per source; one under
    token mixing) and which sources stopped."""
    if token_mixing:
        return {OUTPUTS: outputs, MIXED: parts[0]}
    return {
        OUTPUTS: outputs,
        SOURCES: {name: {PACKER: part, STOPPED: stop} for name, part, stop in zip(source_names, parts, stopped)},
    }


def cursor_lane_state(source_names: Sequence[str], token_mixing: bool, outputs: int, cursors: list,
                      stopped) -> dict:
    """:func:`lane_state` of a lane whose packers' states are bare cursors (``Lane.cursors``)."""
    return lane_state(source_names, token_mixing, outputs, [concat_state(*cursor) for cursor in cursors], stopped)


@dataclass(frozen=True)
class SourceLane:
    packer: PackerState
    stopped: bool


@dataclass(frozen=True)
class LaneState:
    outputs: int
    sources: Optional[dict[str, SourceLane]] = None  # sequence mixing (and single sources)
    mixed: Optional[PackerState] = None  # token mixing


def parse_lane(raw: Any, path: str, problems: Problems, context: RecordContext) -> Optional[LaneState]:
    names = context.source_names
    packer_record = record_type(context.packer_record)
    entry = LANE.fields(raw, path, problems, required=(OUTPUTS, MIXED if context.token_mixing else SOURCES))
    if entry is None:
        return None
    outputs = json_int(entry[OUTPUTS], f"{path}.{OUTPUTS}", problems)
    if context.token_mixing:
        packer = packer_record(entry[MIXED], f"{path}.{MIXED}", problems, context)
        return None if outputs is None or packer is None else LaneState(outputs, mixed=packer)
    sources = fields_of(entry[SOURCES], f"{path}.{SOURCES}", tuple(names), problems)
    if sources is None:
        return None
    parsed = {}
    for name in names:
        spath = f"{path}.{SOURCES}.{name}"
        source = fields_of(sources[name], spath, (PACKER, STOPPED), problems)
        if source is None:
            continue
        packer = packer_record(source[PACKER], f"{spath}.{PACKER}", problems, context)
        stopped = json_bool(source[STOPPED], f"{spath}.{STOPPED}", problems)
        if packer is not None and stopped is not None:
            parsed[name] = SourceLane(packer, stopped)
    if outputs is None or len(parsed) != len(names):
        return None
    return LaneState(outputs, sources=parsed)


# The keys are those of a sequence-mixing lane; a token-mixing lane's ``mixed`` replaces ``sources``.
LANE = register_record(RecordType(name="lane", version=1, keys=(OUTPUTS, SOURCES), optional=(), parse=parse_lane))
