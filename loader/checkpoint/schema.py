"""The loader checkpoint as typed records, validated on load; every error names its JSON path.

A checkpoint is user input: it may be hand-edited, truncated, from another version or simply
wrong. Nothing in it is trusted. It is checked at two levels, both reporting every bad field
at once (up to :data:`MAX_REPORTED`), each as ``path: what is wrong (got value)``, for example
``lanes.00017.sources.web.packer.stream.block: ...``; list items are ``[k]``:

1. **Shape** (:func:`parse_header` here, :func:`parse_lanes` by the records the stages register,
   :mod:`loader.checkpoint.records`; needs nothing but the JSON): every
   key present, no unknown key, every value of its JSON type (a bool is not an integer),
   integers in their intrinsic range (counters >= 0, ``current`` in ``[-1, sources)``), the
   schedule's weights exact fractions that sum to 1, a best-fit bin's ``piece_starts`` /
   ``doc_starts`` increasing and inside the bin, ``token_sources`` in range, ``serial``
   above every bin's serial. The result is a tree of frozen records mirroring the JSON.
2. **Range** (:func:`check_lanes`; needs the dataset and config, given as
   :class:`StateLimits`): a cursor's block exists in the lane's epoch order, its epoch is
   reachable (within ``max_epochs``, and not more epochs than the lane's output could have
   consumed), ``exhausted`` / ``stopped`` only where the source's exhaustion policy allows
   it, a lane's ``outputs`` match the stream position, at most ``best_fit_open_bins`` bins
   of fewer than ``seq_len`` token ids in ``[0, vocab_size)``, token-mixing counters no larger
   than the lane's output, the mixing window's ``phase_start`` one the lane can be in.

The checks of each value are those of :mod:`loader.validation` (one engine for config and
checkpoint records); the records' parsers live beside their stages (``lane``:
:mod:`loader.stages.lane_record`, the packers: :mod:`loader.stages.packer_records`, the token
mix: :mod:`loader.stages.mixed_record`, the cursor: :mod:`loader.io.cursor_record`).

What needs the data itself (a cursor's ``offset`` inside its block's tokens) is checked by the
lane token stream when it first reads the block (``LaneTokenStream.set_state``), with the
same path. Errors are :class:`~loader.checkpoint.state.StateError`.

State shapes (``L`` lanes, ``S`` sources; see the stage modules for their meaning)::

    header   format, version, num_lanes, config{...}, config_fingerprint, tokenizer_fingerprint,
             sources[{name, dataset_fingerprint, exhaustion, max_epochs}], schedule[{step, weights}],
             next_global_index [, rank, world_size, rank_position] [, transforms{sources{name: [{function,
             args, version, stage}]}, changes[{step, sources}]}], lanes{"00017": lane}
    lane     {outputs, sources: {name: {packer, stopped}}}   or, token mixing, {outputs, mixed: packer}
    packer   concat {stream}   best_fit with packing_window {stream, window{version, index, emitted}}
             (loader.stages.window_packing: the cursor of the window's first document; the record's own
             version, WINDOW_VERSIONS)   best_fit {stream, bins[{serial, tokens, piece_starts, doc_starts
             [, token_sources] [, loss_mask ...] [, piece_origins]}], serial}   (each lane-file feature of
             loader.stages.features, one value per token, in its range; which ones a bin must hold is
             checked on restore; piece_origins, version 2: [epoch, block, offset] per piece, the cursor
             of its first token, before the stream's cursor, absent where unknown)
    stream   cursor {epoch, block, offset, exhausted [, transforms[[dropped, changed] x transforms]]
             [, document{index, token_start, char_start}]} (document, version 3: text lanes, the
             document the cursor is in and where its tokens and text start, so that a restore
             tokenizes from it; checked against the data on restore)
             or, token mixing, {sources[cursor x S],
             tokens[S], current, phase_start}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

import numpy as np

from loader.checkpoint.migrations import MIGRATIONS
from loader.checkpoint.records import MAX_REPORTED, RecordContext, StateProblems, record_type, registered_records
from loader.checkpoint.version import STATE_FORMAT, STATE_VERSION
from loader.errors import StateError
from loader.io.cursor_record import DOCUMENT_KEYS, Cursor
from loader.order.ordering import lane_outputs_before
from loader.stages.features import FEATURES
from loader.stages.lane_record import LANE, MIXED, PACKER, SOURCES, LaneState, SourceLane
from loader.stages.mixed_record import MixedStream
from loader.stages.packer_records import BEST_FIT_WINDOW, BINS, TOKEN_SOURCES, TOKENS, Bin, PackerState, WindowPosition, \
    check_bin_values
from loader.validation import fields_of as _fields, json_int as _int, json_str as _str, show as _show, \
    type_name as _type_name

# The one collector of a checkpoint's bad fields (loader.checkpoint.records), under its old name.
Problems = StateProblems

EXHAUSTION_POLICIES = ("repeat", "stop")
PACKINGS = ("concat", "best_fit")
# Versions of a windowed best-fit packer's ``window`` record this Zephon reads (its record's).
WINDOW_VERSIONS = BEST_FIT_WINDOW.readable
_LANE_KEY = re.compile(r"\d{5,}")
_WEIGHT = re.compile(r"\d+(/\d+)?")

__all__ = [  # the typed records, each defined beside the stage that registers it
    "Bin", "Cursor", "DOCUMENT_KEYS", "Header", "LaneState", "MAX_REPORTED", "MixedStream", "PackerState", "Problems",
    "SchedulePhase", "SourceEntry", "SourceLane", "SourceLimits", "StateLimits", "WindowPosition", "check_format",
    "check_lanes", "parse_header", "parse_lanes", "registered_records", "stage_state",
]


# -- the header ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceEntry:
    name: str
    dataset_fingerprint: str
    exhaustion: str
    max_epochs: Optional[int]


@dataclass(frozen=True)
class SchedulePhase:
    step: int
    weights: dict[str, Fraction]


@dataclass(frozen=True)
class Header:
    """The top level of a state, without its lanes."""

    num_lanes: int
    config: dict[str, Any]
    config_fingerprint: str
    tokenizer_fingerprint: str
    sources: tuple[SourceEntry, ...]
    schedule: tuple[SchedulePhase, ...]
    next_global_index: int
    rank: Optional[int] = None  # rank-local states only (rank, world_size, rank_position)
    world_size: Optional[int] = None
    rank_position: Optional[int] = None

    @property
    def rank_local(self) -> bool:
        return self.rank is not None

    @property
    def packing(self) -> str:
        return self.config["packing"]

    @property
    def token_mixing(self) -> bool:
        return self.config.get("mixing_unit") == "token" and len(self.sources) > 1


# -- level 1: shape ----------------------------------------------------------------------------

_HEADER_KEYS = ("format", "version", "num_lanes", "config", "config_fingerprint", "tokenizer_fingerprint",
                "sources", "schedule", "next_global_index", "lanes")
_RANK_KEYS = ("rank", "world_size", "rank_position")


def check_format(state: Any) -> None:
    """Refuse, alone and first, what is not a Zephon state of this version at all."""
    if not isinstance(state, dict):
        raise StateError(f"a loader state must be a JSON object (got {_type_name(state)})")
    if state.get("format") != STATE_FORMAT:
        raise StateError(f"format: not a Zephon loader state (format={state.get('format')!r}, expected {STATE_FORMAT!r})")
    version = state.get("version")
    if type(version) is not int or version != STATE_VERSION:
        older = f"; versions {sorted(MIGRATIONS)} are upgraded by loader.checkpoint.migrations.upgrade, which " \
            "load_state_dict applies" if type(version) is int and version in MIGRATIONS else ""
        raise StateError(f"version: loader state version {version!r} is not supported by this Zephon "
                         f"(supports {STATE_VERSION}{older})")


def parse_header(state: Any) -> Header:
    """Level 1 of the top level (lanes excepted: :func:`parse_lanes`); raises with every bad field."""
    check_format(state)
    problems = Problems()
    rank_local = "rank" in state
    _fields(state, "", _HEADER_KEYS + (_RANK_KEYS if rank_local else ()), problems, optional=("transforms",))
    value = state.get
    num_lanes = _int(value("num_lanes"), "num_lanes", problems, low=1) if "num_lanes" in state else None
    config = value("config")
    if "config" in state:
        if not isinstance(config, dict):
            problems.at("config", f"must be an object (got {_type_name(config)} {_show(config)})")
        else:
            for name, item in config.items():
                if not isinstance(item, (str, int, type(None))) or isinstance(item, float):
                    problems.at(f"config.{name}", f"must be a string, integer, boolean or null (got {_show(item)})")
            packing = config.get("packing")
            if packing not in PACKINGS:
                problems.at("config.packing", f"must be one of {list(PACKINGS)} (got {_show(packing)})")
    for name in ("config_fingerprint", "tokenizer_fingerprint"):
        if name in state:
            _str(state[name], name, problems)
    sources = _parse_sources(value("sources"), problems) if "sources" in state else None
    names = None if sources is None else [s.name for s in sources]
    schedule = _parse_schedule(value("schedule"), names, problems) if "schedule" in state else None
    if "transforms" in state:
        _parse_transforms_header(state["transforms"], names, problems)
    next_index = _int(value("next_global_index"), "next_global_index", problems) if "next_global_index" in state else None
    rank = world_size = position = None
    if rank_local:
        world_size = _int(value("world_size"), "world_size", problems, low=1) if "world_size" in state else None
        rank = _int(value("rank"), "rank", problems, high=None if world_size is None else world_size - 1)
        position = _int(value("rank_position"), "rank_position", problems) if "rank_position" in state else None
        if None not in (rank, world_size, position, next_index) and next_index != rank + position * world_size:
            problems.at("next_global_index", f"must be rank + rank_position x world_size = "
                         f"{rank + position * world_size} in a rank-local state (got {next_index})")
    if "lanes" in state and not isinstance(state["lanes"], dict):
        problems.at("lanes", f"must be an object keyed by lane (\"00017\") (got {_type_name(state['lanes'])})")
    problems.raise_if_any()
    return Header(
        num_lanes=num_lanes, config=dict(config), config_fingerprint=state["config_fingerprint"],
        tokenizer_fingerprint=state["tokenizer_fingerprint"], sources=sources, schedule=schedule,
        next_global_index=next_index, rank=rank, world_size=world_size, rank_position=position,
    )


def _nonempty_list(value: Any, path: str, what: str, problems: Problems) -> bool:
    if isinstance(value, list) and value:
        return True
    problems.at(path, f"must be a non-empty list of {what} (got {_type_name(value)} {_show(value)})")
    return False


def _parse_sources(value: Any, problems: Problems) -> Optional[tuple[SourceEntry, ...]]:
    if not _nonempty_list(value, "sources", "sources", problems):
        return None
    entries = []
    for k, item in enumerate(value):
        path = f"sources[{k}]"
        entry = _fields(item, path, ("name", "dataset_fingerprint", "exhaustion", "max_epochs"), problems)
        if entry is None:
            continue
        name = _str(entry["name"], f"{path}.name", problems)
        fingerprint = _str(entry["dataset_fingerprint"], f"{path}.dataset_fingerprint", problems)
        exhaustion = _str(entry["exhaustion"], f"{path}.exhaustion", problems, EXHAUSTION_POLICIES)
        max_epochs = entry["max_epochs"]
        if max_epochs is not None:
            max_epochs = _int(max_epochs, f"{path}.max_epochs", problems, low=1)
        entries.append(SourceEntry(name, fingerprint, exhaustion, max_epochs))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        problems.at("sources", f"source names repeat ({names})")
    return tuple(entries) if len(entries) == len(value) else None


def _parse_schedule(value: Any, names: Optional[list[str]], problems: Problems) -> Optional[tuple[SchedulePhase, ...]]:
    if not _nonempty_list(value, "schedule", "{step, weights} phases", problems):
        return None
    phases = []
    for k, item in enumerate(value):
        path = f"schedule[{k}]"
        entry = _fields(item, path, ("step", "weights"), problems)
        if entry is None:
            continue
        step = _int(entry["step"], f"{path}.step", problems)
        if step is not None:
            previous = phases[-1].step if phases else None
            if k == 0 and step != 0:
                problems.at(f"{path}.step", f"the first phase must start at step 0 (got {step})")
            elif previous is not None and step <= previous:
                problems.at(f"{path}.step", f"steps must increase strictly (got {step} after {previous})")
        weights = entry["weights"]
        if not isinstance(weights, dict):
            problems.at(f"{path}.weights", f"must be an object of source -> \"p/q\" (got {_show(weights)})")
            continue
        parsed: dict[str, Fraction] = {}
        for name, text in weights.items():
            if not isinstance(text, str) or not _WEIGHT.fullmatch(text) or text.endswith("/0"):
                problems.at(f"{path}.weights.{name}", f"must be an exact fraction \"p/q\" (got {_show(text)})")
                continue
            parsed[name] = Fraction(text)
        if names is not None:
            known = ", ".join(f"sources[{j}].name={n!r}" for j, n in enumerate(names))
            for name in names:
                if name not in weights:
                    problems.at(f"{path}.weights.{name}", f"missing (every source needs a weight; {known})")
            for name in weights:
                if name not in names:
                    problems.at(f"{path}.weights.{name}", f"not a source of this state ({known})")
        if len(parsed) == len(weights) and parsed and sum(parsed.values()) != 1:
            problems.at(f"{path}.weights", f"must sum to 1 (got {sum(parsed.values())})")
        if step is not None:
            phases.append(SchedulePhase(step, parsed))
    return tuple(phases) if len(phases) == len(value) else None


def _parse_transforms_header(value: Any, names: Optional[list], problems: Problems) -> None:
    """The header's ``transforms``: ``{"sources": {name: [entry]}, "changes": [{"step", "sources"}]}``."""
    entry = _fields(value, "transforms", ("sources", "changes"), problems)
    if entry is None:
        return
    sources = entry["sources"]
    if not isinstance(sources, dict):
        problems.at("transforms.sources", f"must be an object of source name -> transforms (got {_show(sources)})")
    else:
        for name, specs in sources.items():
            path = f"transforms.sources.{name}"
            if names is not None and name not in names:
                problems.at(path, f"names no source of the state (sources: {names})")
            if not isinstance(specs, list):
                problems.at(path, f"must be a list of transforms (got {_type_name(specs)})")
                continue
            for k, spec in enumerate(specs):
                item = _fields(spec, f"{path}[{k}]", ("function", "args", "version", "stage"), problems)
                if item is None:
                    continue
                _str(item["function"], f"{path}[{k}].function", problems)
                if not isinstance(item["args"], dict):
                    problems.at(f"{path}[{k}].args", f"must be an object (got {_show(item['args'])})")
                for field_name in ("version", "stage"):
                    if item[field_name] is not None:
                        _str(item[field_name], f"{path}[{k}].{field_name}", problems)
    changes = entry["changes"]
    if not isinstance(changes, list):
        problems.at("transforms.changes", f"must be a list (got {_type_name(changes)})")
        return
    for k, change in enumerate(changes):
        item = _fields(change, f"transforms.changes[{k}]", ("step", "sources"), problems)
        if item is None:
            continue
        _int(item["step"], f"transforms.changes[{k}].step", problems)
        if not isinstance(item["sources"], list) or not all(isinstance(n, str) for n in item["sources"]):
            problems.at(f"transforms.changes[{k}].sources", f"must be a list of source names (got {_show(item['sources'])})")


def record_context(header: Header) -> RecordContext:
    """What the stages' record parsers need of a state's header."""
    return RecordContext(packing=header.packing, packing_window=header.config.get("packing_window"),
                         source_names=tuple(s.name for s in header.sources), token_mixing=header.token_mixing)


def parse_lanes(lanes: dict, header: Header) -> dict[int, LaneState]:
    """Level 1 of every lane of a state whose header parsed, each by the registered ``lane``
    record (which reads its packers and streams by theirs); raises with every bad field."""
    problems = Problems()
    context = record_context(header)
    record_type(context.packer_record)  # a packing no stage registered is refused before any lane
    parsed: dict[int, LaneState] = {}
    for key, raw in lanes.items():
        path = f"lanes.{key}"
        if not isinstance(key, str) or not _LANE_KEY.fullmatch(key) or int(key) >= header.num_lanes \
                or key != f"{int(key):05d}":
            problems.at(path, f"not a lane of this state (lanes are \"00000\" .. \"{header.num_lanes - 1:05d}\")")
            continue
        lane = LANE(raw, path, problems, context)
        if lane is not None:
            parsed[int(key)] = lane
    problems.raise_if_any()
    return parsed


def stage_state(raw: dict, lane: LaneState) -> dict:
    """The lane state to hand to ``Lane.set_state``: the JSON with each bin's id lists replaced
    by the arrays parsed here (int32 tokens, int8 token_sources, as ``get_state`` makes them),
    so a restore converts them once. Saving it again gives the same JSON."""
    if lane.mixed is not None:
        return dict(raw, **{MIXED: _packer_with_arrays(raw[MIXED], lane.mixed)}) if lane.mixed.bins else raw
    if not any(source.packer.bins for source in lane.sources.values()):
        return raw
    sources = {}
    for name, source in lane.sources.items():
        saved = raw[SOURCES][name]
        sources[name] = dict(saved, **{PACKER: _packer_with_arrays(saved[PACKER], source.packer)}) if source.packer.bins \
            else saved
    return dict(raw, **{SOURCES: sources})


def _packer_with_arrays(raw: dict, packer: PackerState) -> dict:
    bins = []
    for saved, bin_ in zip(raw[BINS], packer.bins):
        arrays = {TOKENS: bin_.tokens.astype(np.int32)}
        if bin_.token_sources is not None:
            arrays[TOKEN_SOURCES] = bin_.token_sources.astype(np.int8)
        for name, values in bin_.features:
            arrays[name] = values.astype(FEATURES[name].dtype)
        bins.append(dict(saved, **arrays))
    return dict(raw, **{BINS: bins})


# -- level 2: ranges against the dataset and config -----------------------------------------------


@dataclass(frozen=True)
class SourceLimits:
    """What the loader knows of one source without reading lane data."""

    name: str
    max_epochs: Optional[int]  # effective: 1 for exhaustion "stop"; None: endless
    exhaustion: str
    blocks: dict[int, int]  # lane -> blocks per epoch (row groups of its non-empty files); absent: unknown
    rows: dict[int, int]  # lane -> documents per epoch


@dataclass(frozen=True)
class StateLimits:
    num_lanes: int
    global_batch_size: int
    seq_len: int
    packing: str
    open_bins: int
    wrap_tokens: int  # tokens every document has at least (BOS/EOS)
    vocab_size: Optional[int]  # None: unknown (ids then only checked >= 0)
    sources: tuple[SourceLimits, ...]


def check_lanes(header: Header, lanes: dict[int, LaneState], limits: StateLimits,
                next_index: int, problems: Problems) -> None:
    """Level 2 of every parsed lane; adds what is out of range to ``problems``."""
    starts = [p.step for p in header.schedule]
    for lane_id, lane in lanes.items():
        path = f"lanes.{lane_id:05d}"
        expected = lane_outputs_before(next_index, lane_id, limits.num_lanes)
        if lane.outputs != expected:
            problems.at(f"{path}.outputs", f"lane {lane_id} state has produced {lane.outputs} sequences but the "
                         f"stream position (next_global_index {next_index}) implies {expected}: the state is inconsistent")
            continue
        # Tokens a lane can have taken from its streams: what it emitted plus what open bins hold.
        bins_tokens = limits.open_bins * limits.seq_len if limits.packing == "best_fit" else 0
        taken_bound = (lane.outputs + 1) * limits.seq_len + bins_tokens
        if lane.mixed is not None:
            _check_packer(lane.mixed, f"{path}.mixed", lane_id, limits, taken_bound, problems)
            _check_window(lane.mixed.stream, f"{path}.mixed.stream", lane_id, lane.outputs, limits, starts,
                          taken_bound, problems)
            continue
        for k, source in enumerate(limits.sources):
            saved = lane.sources[source.name]
            spath = f"{path}.sources.{source.name}"
            _check_packer(saved.packer, f"{spath}.packer", lane_id, limits, taken_bound, problems, source=k)
            if saved.stopped:
                if source.max_epochs is None:
                    problems.at(f"{spath}.stopped", f"source {source.name!r} is exhaustion={source.exhaustion!r} "
                                 "without max_epochs: it never stops")
                elif not saved.packer.stream.exhausted or saved.packer.bins:
                    problems.at(f"{spath}.stopped", "a source stops only once its stream is exhausted and no bin "
                                 f"is open ({spath}.packer.stream.exhausted is false, or bins remain)")


def _check_packer(packer: PackerState, path: str, lane_id: int, limits: StateLimits, taken_bound: int,
                  problems: Problems, source: int = -1) -> None:
    if isinstance(packer.stream, MixedStream):
        for k, cursor in enumerate(packer.stream.sources):
            _check_cursor(cursor, f"{path}.stream.sources[{k}]", lane_id, limits.sources[k], limits, taken_bound, problems)
    else:
        _check_cursor(packer.stream, f"{path}.stream", lane_id, limits.sources[source], limits, taken_bound, problems)
    if packer.packing != "best_fit":
        return
    if len(packer.bins) > limits.open_bins:
        problems.at(f"{path}.bins", f"holds {len(packer.bins)} open bins; best_fit_open_bins is {limits.open_bins}")
    for k, bin_ in enumerate(packer.bins):
        if len(bin_.tokens) >= limits.seq_len:
            problems.at(f"{path}.bins[{k}].tokens", f"an open bin holds fewer than seq_len={limits.seq_len} tokens "
                         f"(got {len(bin_.tokens)})")
    vocab = limits.vocab_size if limits.vocab_size is not None else np.iinfo(np.int32).max + 1
    check_bin_values(packer.bins, path, "tokens", 0, vocab, "token ids (the tokenizer's vocabulary)", problems)
    _check_origins(packer, path, lane_id, limits, source, problems)


def _check_origins(packer: PackerState, path: str, lane_id: int, limits: StateLimits, source: int,
                   problems: Problems) -> None:
    """Each piece's origin is a block of its source's lane, at or before that source's cursor
    (a piece was taken before the cursor moved on); ``source`` -1: token mixing (the source is
    the piece's first ``token_sources`` value)."""
    for k, bin_ in enumerate(packer.bins):
        if bin_.piece_origins is None:
            continue
        for j, (origin, start) in enumerate(zip(bin_.piece_origins, bin_.piece_starts)):
            s = int(bin_.token_sources[start]) if source < 0 else source
            cursor = packer.stream.sources[s] if isinstance(packer.stream, MixedStream) else packer.stream
            blocks = limits.sources[s].blocks.get(lane_id)
            where = f"{path}.bins[{k}].piece_origins[{j}]"
            if blocks is not None and origin[1] >= blocks:
                problems.at(where, f"block {origin[1]} is not a block of lane {lane_id} of source "
                             f"{limits.sources[s].name!r} ({blocks} per epoch)")
            elif not cursor.exhausted and origin >= (at := (cursor.epoch, cursor.block, cursor.offset)):
                part = next((i for i in range(3) if origin[i] != at[i]), 2)  # the first component past the cursor's
                problems.at(f"{where}[{part}]", f"a piece comes from before its stream's cursor {list(at)} "
                             f"(got {list(origin)})")


def _check_cursor(cursor: Cursor, path: str, lane_id: int, source: SourceLimits, limits: StateLimits,
                  taken_bound: int, problems: Problems) -> None:
    max_epochs = source.max_epochs
    if cursor.exhausted:
        if max_epochs is None:
            problems.at(f"{path}.exhausted", f"source {source.name!r} is exhaustion={source.exhaustion!r} without "
                         "max_epochs: its stream never ends")
        else:
            for name, value, end in (("epoch", cursor.epoch, max_epochs), ("block", cursor.block, 0),
                                     ("offset", cursor.offset, 0)):
                if value != end:
                    problems.at(f"{path}.{name}", f"must be {end}: an exhausted stream ({path}.exhausted is true) "
                                 f"stands at epoch max_epochs={max_epochs}, block 0, offset 0 (got {value})")
        return
    if max_epochs is not None and cursor.epoch >= max_epochs:
        problems.at(f"{path}.epoch", f"must be < max_epochs={max_epochs} of source {source.name!r} for a stream "
                     f"that is not exhausted ({path}.exhausted is false) (got {cursor.epoch})")
        return
    rows = source.rows.get(lane_id, 0)
    if cursor.epoch and rows and limits.wrap_tokens and cursor.epoch * rows * limits.wrap_tokens > taken_bound:
        problems.at(f"{path}.epoch", f"epoch {cursor.epoch} is unreachable: {cursor.epoch} epochs of the lane's "
                     f"{rows} documents are more tokens than the lane's output could have consumed ({taken_bound})")
    blocks = source.blocks.get(lane_id)
    if blocks is not None and cursor.block >= blocks:
        problems.at(f"{path}.block", f"lane {lane_id} of source {source.name!r} has {blocks} blocks (row groups) "
                     f"per epoch, so block must be in [0, {blocks - 1}] (got {cursor.block})")


def _check_window(stream: MixedStream, path: str, lane_id: int, outputs: int, limits: StateLimits,
                  starts: list[int], taken_bound: int, problems: Problems) -> None:
    """The token-mixing window: counters, the open document and the phase the lane is in."""
    if sum(stream.tokens) > taken_bound:
        k = stream.tokens.index(max(stream.tokens))
        problems.at(f"{path}.tokens[{k}]", f"the window counts {sum(stream.tokens)} tokens; the lane's {outputs} "
                     f"outputs can hold at most {taken_bound}")
    if stream.current >= 0 and stream.sources[stream.current].exhausted:
        problems.at(f"{path}.current", f"source {stream.current} is exhausted: it has no open document")

    def phase_of(global_index: int) -> int:
        step = global_index // limits.global_batch_size
        return max(s for s in starts if s <= step)

    # The window of the last output, or of the next one (a bulk cut rewound to its first row).
    allowed = {phase_of(lane_id + outputs * limits.num_lanes)}
    allowed.add(0 if outputs == 0 else phase_of(lane_id + (outputs - 1) * limits.num_lanes))
    if stream.phase_start not in allowed:
        problems.at(f"{path}.phase_start", f"must be the schedule phase of the lane's last or next output "
                     f"(one of {sorted(allowed)}; got {stream.phase_start})")
