"""The loader checkpoint as typed records, validated on load; every error names its JSON path.

A checkpoint is user input: it may be hand-edited, truncated, from another version or simply
wrong. Nothing in it is trusted. It is checked at two levels, both reporting every bad field
at once (up to :data:`MAX_REPORTED`), each as ``path: what is wrong (got value)``, for example
``lanes.00017.sources.web.packer.stream.block: ...``; list items are ``[k]``:

1. **Shape** (:func:`parse_header`, :func:`parse_lanes`; needs nothing but the JSON): every
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
from typing import Any, Optional, Union

import numpy as np

from loader.checkpoint.migrations import MIGRATIONS
from loader.checkpoint.version import STATE_FORMAT, STATE_VERSION
from loader.errors import StateError
from loader.order.ordering import lane_outputs_before
from loader.stages.features import BIN_STATE_FEATURES, FEATURES
from loader.stages.window_packing import WINDOW_STATE_VERSION

MAX_REPORTED = 20  # bad fields listed in one error; the count of the rest is given

EXHAUSTION_POLICIES = ("repeat", "stop")
DOCUMENT_KEYS = ("index", "token_start", "char_start")  # a text cursor's document (version 3)
PACKINGS = ("concat", "best_fit")
# Versions of a windowed best-fit packer's ``window`` record this Zephon reads (each version reads as
# the packer's current one; a new version adds its migration here).
WINDOW_VERSIONS = tuple(range(1, WINDOW_STATE_VERSION + 1))
WINDOW_KEYS = ("version", "index", "emitted")
_LANE_KEY = re.compile(r"\d{5,}")
_WEIGHT = re.compile(r"\d+(/\d+)?")


# -- collecting problems -----------------------------------------------------------------------


class Problems:
    """Bad fields found so far, as ``(path, message)``; :meth:`raise_if_any` reports them all."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.count = 0

    def add(self, path: str, message: str) -> None:
        self.count += 1
        if len(self.found) < MAX_REPORTED:
            self.found.append(f"{path or '(the state)'}: {message}")

    def raise_if_any(self, what: str = "the loader state") -> None:
        if not self.count:
            return
        more = f"\n  ... and {self.count - len(self.found)} more" if self.count > len(self.found) else ""
        raise StateError(
            f"{what} is invalid ({self.count} bad field{'s' if self.count > 1 else ''}; a checkpoint "
            "must be loaded as written by Zephon, not edited):\n  - " + "\n  - ".join(self.found) + more
        )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fields(value: Any, path: str, required: tuple[str, ...], problems: Problems,
            optional: tuple[str, ...] = ()) -> Optional[dict]:
    """``value`` as an object with exactly these keys (``optional`` ones may be absent)."""
    if not isinstance(value, dict):
        problems.add(path, f"must be an object with keys {list(required)} (got {_type_name(value)} {_show(value)})")
        return None
    ok = True
    for name in required:
        if name not in value:
            problems.add(_key(path, name), "missing")
            ok = False
    for name in value:
        if name not in required and name not in optional:
            problems.add(_key(path, str(name)), f"unknown key (expected only {list(required + optional)})")
            ok = False
    return value if ok else None


def _int(value: Any, path: str, problems: Problems, low: Optional[int] = 0, high: Optional[int] = None) -> Optional[int]:
    """An integer (not a bool) in ``[low, high]``."""
    if type(value) is not int:
        if isinstance(value, np.integer):  # an in-memory state that was not made JSON
            value = int(value)
        else:
            problems.add(path, f"must be an integer (got {_type_name(value)} {_show(value)})")
            return None
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        problems.add(path, f"must be {bounds} (got {value})")
        return None
    return value


def _bool(value: Any, path: str, problems: Problems) -> Optional[bool]:
    if type(value) is not bool and not isinstance(value, np.bool_):
        problems.add(path, f"must be true or false (got {_type_name(value)} {_show(value)})")
        return None
    return bool(value)


def _str(value: Any, path: str, problems: Problems, choices: Optional[tuple] = None) -> Optional[str]:
    if not isinstance(value, str):
        problems.add(path, f"must be a string (got {_type_name(value)} {_show(value)})")
        return None
    if choices is not None and value not in choices:
        problems.add(path, f"must be one of {list(choices)} (got {value!r})")
        return None
    return value


def _int_list(value: Any, path: str, problems: Problems) -> Optional[list]:
    """A list of integers (not bools); the first few bad items are named."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
        return value  # an in-memory state (get_state keeps bins as arrays)
    if not isinstance(value, list):
        problems.add(path, f"must be a list of integers (got {_type_name(value)} {_show(value)})")
        return None
    if value and set(map(type, value)) != {int}:  # a C-speed type scan: bools and floats are out
        bad = 0
        for k, item in enumerate(value):
            if type(item) is not int:
                problems.add(f"{path}[{k}]", f"must be an integer (got {_type_name(item)} {_show(item)})")
                bad += 1
                if bad == 3:
                    break
        return None
    return value


def _id_array(value: Any, path: str, problems: Problems) -> Optional[np.ndarray]:
    """A list of integers (not bools) as an int64 array: token ids and their sources.

    One inferred conversion does the type check (floats, strings, nulls or nested lists do
    not make an integer array) except for bools, which numpy turns into 0 and 1 among
    integers: only the items that came out 0 or 1 are looked at. A type scan of every item
    cost more than the conversion itself (tens of ms for a restore's bins)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
        return value.astype(np.int64, copy=False)  # an in-memory state (get_state keeps bins as arrays)
    if not isinstance(value, list):
        problems.add(path, f"must be a list of integers (got {_type_name(value)} {_show(value)})")
        return None
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.array(value)
    except (ValueError, OverflowError):  # ragged nesting
        array = None
    if array is not None and array.dtype.kind == "i" and array.ndim == 1:
        zero_or_one = np.flatnonzero((array == 0) | (array == 1)).tolist()
        if not any(type(value[k]) is bool for k in zero_or_one):
            return array.astype(np.int64, copy=False)
    if _int_list(value, path, problems) is None:  # names the first bad items
        return None
    k = next(k for k, v in enumerate(value) if not -(1 << 63) <= v < (1 << 63))
    problems.add(f"{path}[{k}]", f"is beyond the int64 range (got {_show(value[k])})")
    return None


# -- records -----------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Cursor:
    """A :class:`~loader.io.lane_reader.LaneTokenStream` position."""

    epoch: int
    block: int
    offset: int
    exhausted: bool
    transforms: tuple[tuple[int, int], ...] = ()  # per transform (dropped, changed): counters only
    document: Optional[tuple[int, int, int]] = None  # text lanes, version 3: (index, token_start, char_start)


@dataclass(frozen=True)
class MixedStream:
    """A :class:`~loader.stages.token_mixing.MixedTokenStream`: one cursor per source plus its window."""

    sources: tuple[Cursor, ...]
    tokens: tuple[int, ...]
    current: int
    phase_start: int


@dataclass(frozen=True)
class Bin:
    """An open best-fit bin: ``tokens`` (and ``token_sources``) as int64 arrays, starts as lists."""

    serial: int
    tokens: np.ndarray
    piece_starts: list
    doc_starts: list
    token_sources: Optional[np.ndarray]
    features: tuple = ()  # (name, int64 array) of the column features it holds (loader.stages.features), registry order
    piece_origins: Optional[tuple] = None  # per piece (epoch, block, offset); None: unknown (a version-1 bin)


@dataclass(frozen=True)
class WindowPosition:
    """Where a windowed best-fit packer stands (loader.stages.window_packing): windows done, bins
    of the current one handed out."""

    version: int
    index: int
    emitted: int


@dataclass(frozen=True)
class PackerState:
    packing: str
    stream: Union[Cursor, MixedStream]
    bins: tuple[Bin, ...] = ()  # best_fit only
    serial: int = 0  # best_fit only
    window: Optional[WindowPosition] = None  # best_fit with packing_window only (then no bins)


@dataclass(frozen=True)
class SourceLane:
    packer: PackerState
    stopped: bool


@dataclass(frozen=True)
class LaneState:
    outputs: int
    sources: Optional[dict[str, SourceLane]] = None  # sequence mixing (and single sources)
    mixed: Optional[PackerState] = None  # token mixing


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
            problems.add("config", f"must be an object (got {_type_name(config)} {_show(config)})")
        else:
            for name, item in config.items():
                if not isinstance(item, (str, int, type(None))) or isinstance(item, float):
                    problems.add(f"config.{name}", f"must be a string, integer, boolean or null (got {_show(item)})")
            packing = config.get("packing")
            if packing not in PACKINGS:
                problems.add("config.packing", f"must be one of {list(PACKINGS)} (got {_show(packing)})")
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
            problems.add("next_global_index", f"must be rank + rank_position x world_size = "
                         f"{rank + position * world_size} in a rank-local state (got {next_index})")
    if "lanes" in state and not isinstance(state["lanes"], dict):
        problems.add("lanes", f"must be an object keyed by lane (\"00017\") (got {_type_name(state['lanes'])})")
    problems.raise_if_any()
    return Header(
        num_lanes=num_lanes, config=dict(config), config_fingerprint=state["config_fingerprint"],
        tokenizer_fingerprint=state["tokenizer_fingerprint"], sources=sources, schedule=schedule,
        next_global_index=next_index, rank=rank, world_size=world_size, rank_position=position,
    )


def _nonempty_list(value: Any, path: str, what: str, problems: Problems) -> bool:
    if isinstance(value, list) and value:
        return True
    problems.add(path, f"must be a non-empty list of {what} (got {_type_name(value)} {_show(value)})")
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
        problems.add("sources", f"source names repeat ({names})")
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
                problems.add(f"{path}.step", f"the first phase must start at step 0 (got {step})")
            elif previous is not None and step <= previous:
                problems.add(f"{path}.step", f"steps must increase strictly (got {step} after {previous})")
        weights = entry["weights"]
        if not isinstance(weights, dict):
            problems.add(f"{path}.weights", f"must be an object of source -> \"p/q\" (got {_show(weights)})")
            continue
        parsed: dict[str, Fraction] = {}
        for name, text in weights.items():
            if not isinstance(text, str) or not _WEIGHT.fullmatch(text) or text.endswith("/0"):
                problems.add(f"{path}.weights.{name}", f"must be an exact fraction \"p/q\" (got {_show(text)})")
                continue
            parsed[name] = Fraction(text)
        if names is not None:
            known = ", ".join(f"sources[{j}].name={n!r}" for j, n in enumerate(names))
            for name in names:
                if name not in weights:
                    problems.add(f"{path}.weights.{name}", f"missing (every source needs a weight; {known})")
            for name in weights:
                if name not in names:
                    problems.add(f"{path}.weights.{name}", f"not a source of this state ({known})")
        if len(parsed) == len(weights) and parsed and sum(parsed.values()) != 1:
            problems.add(f"{path}.weights", f"must sum to 1 (got {sum(parsed.values())})")
        if step is not None:
            phases.append(SchedulePhase(step, parsed))
    return tuple(phases) if len(phases) == len(value) else None


def parse_lanes(lanes: dict, header: Header) -> dict[int, LaneState]:
    """Level 1 of every lane of a state whose header parsed; raises with every bad field."""
    problems = Problems()
    names = [s.name for s in header.sources]
    parsed: dict[int, LaneState] = {}
    for key, raw in lanes.items():
        path = f"lanes.{key}"
        if not isinstance(key, str) or not _LANE_KEY.fullmatch(key) or int(key) >= header.num_lanes \
                or key != f"{int(key):05d}":
            problems.add(path, f"not a lane of this state (lanes are \"00000\" .. \"{header.num_lanes - 1:05d}\")")
            continue
        lane = _parse_lane(raw, path, header, names, problems)
        if lane is not None:
            parsed[int(key)] = lane
    problems.raise_if_any()
    return parsed


def _parse_lane(raw: Any, path: str, header: Header, names: list[str], problems: Problems) -> Optional[LaneState]:
    mixing = header.token_mixing
    entry = _fields(raw, path, ("outputs", "mixed" if mixing else "sources"), problems)
    if entry is None:
        return None
    outputs = _int(entry["outputs"], f"{path}.outputs", problems)
    if mixing:
        packer = _parse_packer(entry["mixed"], f"{path}.mixed", header, len(names), problems)
        return None if outputs is None or packer is None else LaneState(outputs, mixed=packer)
    sources = _fields(entry["sources"], f"{path}.sources", tuple(names), problems)
    if sources is None:
        return None
    parsed = {}
    for name in names:
        spath = f"{path}.sources.{name}"
        source = _fields(sources[name], spath, ("packer", "stopped"), problems)
        if source is None:
            continue
        packer = _parse_packer(source["packer"], f"{spath}.packer", header, 0, problems)
        stopped = _bool(source["stopped"], f"{spath}.stopped", problems)
        if packer is not None and stopped is not None:
            parsed[name] = SourceLane(packer, stopped)
    if outputs is None or len(parsed) != len(names):
        return None
    return LaneState(outputs, sources=parsed)


def _parse_packer(raw: Any, path: str, header: Header, mixed_sources: int, problems: Problems) -> Optional[PackerState]:
    """``mixed_sources``: the source count of a token-mixing packer (its stream and bins differ), else 0."""
    packing = header.packing
    if header.config.get("packing_window") is not None:
        return _parse_window_packer(raw, path, packing, problems)
    keys = ("stream",) if packing == "concat" else ("stream", "bins", "serial")
    entry = _fields(raw, path, keys, problems)
    if entry is None:
        return None
    if mixed_sources:
        stream = _parse_mixed_stream(entry["stream"], f"{path}.stream", mixed_sources, problems)
    else:
        stream = _parse_cursor(entry["stream"], f"{path}.stream", problems)
    if packing == "concat":
        return None if stream is None else PackerState(packing, stream)
    serial = _int(entry["serial"], f"{path}.serial", problems)
    bins_raw = entry["bins"]
    if not isinstance(bins_raw, list):
        problems.add(f"{path}.bins", f"must be a list of bins (got {_type_name(bins_raw)} {_show(bins_raw)})")
        return None
    bins = []
    for k, item in enumerate(bins_raw):
        parsed = _parse_bin(item, f"{path}.bins[{k}]", mixed_sources, problems)
        if parsed is not None:
            bins.append(parsed)
    if len(bins) != len(bins_raw) or serial is None or stream is None:
        return None
    serials = [b.serial for b in bins]
    if len(set(serials)) != len(serials):
        problems.add(f"{path}.bins", f"bin serials repeat ({serials})")
        return None
    if bins and serial <= max(serials):
        k = serials.index(max(serials))
        problems.add(f"{path}.serial", f"must be greater than every bin's serial (got {serial}; "
                     f"{path}.bins[{k}].serial is {serials[k]})")
        return None
    if mixed_sources:
        before = problems.count
        _check_bin_values(tuple(bins), path, "token_sources", 0, mixed_sources, "source ids", problems)
        if problems.count > before:
            return None
    return PackerState(packing, stream, tuple(bins), serial)


def _parse_window_packer(raw: Any, path: str, packing: str, problems: Problems) -> Optional[PackerState]:
    """A windowed best-fit packer: ``{stream, window: {version, index, emitted}}``; ``emitted`` is
    checked against the window's outputs when the restore reads it (it needs the data)."""
    entry = _fields(raw, path, ("stream", "window"), problems)
    if entry is None:
        return None
    stream = _parse_cursor(entry["stream"], f"{path}.stream", problems)
    window = _fields(entry["window"], f"{path}.window", WINDOW_KEYS, problems)
    if window is None:
        return None
    version = _int(window["version"], f"{path}.window.version", problems)
    if version is not None and version not in WINDOW_VERSIONS:
        problems.add(f"{path}.window.version", f"must be one of {list(WINDOW_VERSIONS)}, the window record versions "
                     f"this Zephon reads (got {version}): the checkpoint is from a newer Zephon")
        return None
    index = _int(window["index"], f"{path}.window.index", problems)
    emitted = _int(window["emitted"], f"{path}.window.emitted", problems)
    if stream is None or None in (version, index, emitted):
        return None
    return PackerState(packing, stream, window=WindowPosition(version, index, emitted))


def _parse_cursor(raw: Any, path: str, problems: Problems) -> Optional[Cursor]:
    entry = _fields(raw, path, ("epoch", "block", "offset", "exhausted"), problems,
                    optional=("transforms", "document"))
    if entry is None:
        return None
    values = (
        _int(entry["epoch"], f"{path}.epoch", problems),
        _int(entry["block"], f"{path}.block", problems),
        _int(entry["offset"], f"{path}.offset", problems),
        _bool(entry["exhausted"], f"{path}.exhausted", problems),
    )
    counts = _parse_transform_counts(entry["transforms"], f"{path}.transforms", problems) \
        if "transforms" in entry else ()
    document = _parse_document(entry["document"], f"{path}.document", values[2], values[3], problems) \
        if "document" in entry else ()
    if None in values or counts is None or document is None:
        return None
    return Cursor(*values, transforms=counts, document=document or None)


def _parse_document(value: Any, path: str, offset: Optional[int], exhausted: Optional[bool],
                    problems: Problems) -> Optional[tuple]:
    """A text cursor's document: ``{index, token_start, char_start}``, starting at or before ``offset``."""
    entry = _fields(value, path, DOCUMENT_KEYS, problems)
    if entry is None:
        return None
    before = problems.count
    index, token_start, char_start = (_int(entry[k], f"{path}.{k}", problems) for k in DOCUMENT_KEYS)
    if problems.count > before:
        return None
    if exhausted:
        stream = path.rsplit(".", 1)[0]
        problems.add(path, f"must be absent: an exhausted stream has no document ({stream}.exhausted is true)")
    elif offset is not None and token_start > offset:
        problems.add(f"{path}.token_start", f"must be at or before the cursor's offset {offset} (got {token_start})")
    elif index == 0 and (token_start, char_start) != (0, 0):
        problems.add(path, f"document 0 starts at token 0 and character 0 (got {value})")
    elif index > 0 and token_start == 0 and char_start == 0:
        problems.add(path, f"only document 0 starts at token 0 and character 0 (got {value})")
    else:
        return index, token_start, char_start
    return None


def _parse_transform_counts(value: Any, path: str, problems: Problems) -> Optional[tuple]:
    """A stream's transform counters: a list of ``[dropped, changed]`` pairs of integers >= 0."""
    if not isinstance(value, list):
        problems.add(path, f"must be a list of [dropped, changed] pairs (got {_type_name(value)} {_show(value)})")
        return None
    pairs = []
    for k, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            problems.add(f"{path}[{k}]", f"must be a [dropped, changed] pair of counts (got {_show(pair)})")
            return None
        counts = (_int(pair[0], f"{path}[{k}][0]", problems), _int(pair[1], f"{path}[{k}][1]", problems))
        if None in counts:
            return None
        pairs.append(counts)
    return tuple(pairs)


def _parse_transforms_header(value: Any, names: Optional[list], problems: Problems) -> None:
    """The header's ``transforms``: ``{"sources": {name: [entry]}, "changes": [{"step", "sources"}]}``."""
    entry = _fields(value, "transforms", ("sources", "changes"), problems)
    if entry is None:
        return
    sources = entry["sources"]
    if not isinstance(sources, dict):
        problems.add("transforms.sources", f"must be an object of source name -> transforms (got {_show(sources)})")
    else:
        for name, specs in sources.items():
            path = f"transforms.sources.{name}"
            if names is not None and name not in names:
                problems.add(path, f"names no source of the state (sources: {names})")
            if not isinstance(specs, list):
                problems.add(path, f"must be a list of transforms (got {_type_name(specs)})")
                continue
            for k, spec in enumerate(specs):
                item = _fields(spec, f"{path}[{k}]", ("function", "args", "version", "stage"), problems)
                if item is None:
                    continue
                _str(item["function"], f"{path}[{k}].function", problems)
                if not isinstance(item["args"], dict):
                    problems.add(f"{path}[{k}].args", f"must be an object (got {_show(item['args'])})")
                for field_name in ("version", "stage"):
                    if item[field_name] is not None:
                        _str(item[field_name], f"{path}[{k}].{field_name}", problems)
    changes = entry["changes"]
    if not isinstance(changes, list):
        problems.add("transforms.changes", f"must be a list (got {_type_name(changes)})")
        return
    for k, change in enumerate(changes):
        item = _fields(change, f"transforms.changes[{k}]", ("step", "sources"), problems)
        if item is None:
            continue
        _int(item["step"], f"transforms.changes[{k}].step", problems)
        if not isinstance(item["sources"], list) or not all(isinstance(n, str) for n in item["sources"]):
            problems.add(f"transforms.changes[{k}].sources", f"must be a list of source names (got {_show(item['sources'])})")


def _parse_mixed_stream(raw: Any, path: str, count: int, problems: Problems) -> Optional[MixedStream]:
    entry = _fields(raw, path, ("sources", "tokens", "current", "phase_start"), problems)
    if entry is None:
        return None
    cursors: list = []
    for name, kind in (("sources", "cursors"), ("tokens", "token counts")):
        if not isinstance(entry[name], list) or len(entry[name]) != count:
            problems.add(f"{path}.{name}", f"must be a list of {count} {kind}, one per source (got {_show(entry[name])})")
            return None
    cursors = [_parse_cursor(item, f"{path}.sources[{k}]", problems) for k, item in enumerate(entry["sources"])]
    tokens = [_int(item, f"{path}.tokens[{k}]", problems) for k, item in enumerate(entry["tokens"])]
    current = _int(entry["current"], f"{path}.current", problems, low=-1, high=count - 1)
    phase_start = _int(entry["phase_start"], f"{path}.phase_start", problems)
    if None in cursors or None in tokens or current is None or phase_start is None:
        return None
    return MixedStream(tuple(cursors), tuple(tokens), current, phase_start)


def _parse_bin(raw: Any, path: str, mixed_sources: int, problems: Problems) -> Optional[Bin]:
    """Per-bin work is a few Python operations and one array conversion per id list: a
    restore holds up to ``L x best_fit_open_bins`` bins, and value ranges are checked for
    all bins of a packer at once (:func:`_check_bin_values`)."""
    keys = ("serial", "tokens", "piece_starts", "doc_starts") + (("token_sources",) if mixed_sources else ())
    entry = _fields(raw, path, keys, problems, optional=_BIN_FEATURES + ("piece_origins",))
    if entry is None:
        return None
    serial = _int(entry["serial"], f"{path}.serial", problems)
    tokens = _id_array(entry["tokens"], f"{path}.tokens", problems)
    sources = _id_array(entry["token_sources"], f"{path}.token_sources", problems) if mixed_sources else None
    starts = {name: _int_list(entry[name], f"{path}.{name}", problems) for name in ("piece_starts", "doc_starts")}
    if serial is None or tokens is None or (mixed_sources and sources is None) or None in starts.values():
        return None
    pieces, docs = [int(p) for p in starts["piece_starts"]], [int(d) for d in starts["doc_starts"]]
    size = len(tokens)
    ok = True
    if size == 0:
        problems.add(f"{path}.tokens", "an open bin holds at least one token (got an empty list)")
        return None
    # Each rule names the first item that breaks it.
    if not pieces:
        problems.add(f"{path}.piece_starts", "must list where each piece starts, from 0 (got an empty list)")
        ok = False
    for k, start in enumerate(pieces):
        if not 0 <= start < size or (k == 0 and start != 0) or (k and start <= pieces[k - 1]):
            problems.add(f"{path}.piece_starts[{k}]", f"piece starts must begin at 0 and increase strictly inside "
                         f"the bin's {size} tokens (got {start})")
            ok = False
            break
    if ok:
        piece_set = set(pieces)
        for k, start in enumerate(docs):
            if start not in piece_set or (k and start < docs[k - 1]):
                problems.add(f"{path}.doc_starts[{k}]", "document starts must be piece starts (a document begins "
                             f"a piece), in increasing order (got {start}; piece starts {_show(pieces)})")
                ok = False
                break
    if sources is not None and len(sources) != size:
        problems.add(f"{path}.token_sources", f"must have one entry per token ({size}; got {len(sources)})")
        ok = False
    features = []
    for name in _BIN_FEATURES:
        if name not in entry:
            continue
        values = _id_array(entry[name], f"{path}.{name}", problems)
        if values is None:
            ok = False
        elif len(values) != size:
            problems.add(f"{path}.{name}", f"must have one entry per token ({size}; got {len(values)})")
            ok = False
        else:
            low, high = FEATURES[name].value_range or (values.min(), values.max())
            bad = np.flatnonzero((values < low) | (values > high))
            if len(bad):
                problems.add(f"{path}.{name}[{int(bad[0])}]", f"must be in [{low}, {high}] (got {int(values[bad[0]])})")
                ok = False
            features.append((name, values))
    origins = _parse_origins(entry["piece_origins"], f"{path}.piece_origins", len(pieces), problems) \
        if "piece_origins" in entry else None
    if "piece_origins" in entry and origins is None:
        ok = False
    return Bin(serial, tokens, pieces, docs, sources, tuple(features), origins) if ok else None


def _parse_origins(value: Any, path: str, pieces: int, problems: Problems) -> Optional[tuple]:
    """A bin's ``piece_origins``: one ``[epoch, block, offset]`` of integers >= 0 per piece."""
    if not isinstance(value, list) or len(value) != pieces:
        problems.add(path, f"must be a list of {pieces} [epoch, block, offset] cursors, one per piece "
                     f"(got {_show(value)})")
        return None
    origins = []
    for k, item in enumerate(value):
        if isinstance(item, np.ndarray):
            item = item.tolist()
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            problems.add(f"{path}[{k}]", f"must be [epoch, block, offset] (got {_show(item)})")
            return None
        values = [_int(x, f"{path}[{k}][{j}]", problems) for j, x in enumerate(item)]
        if None in values:
            return None
        origins.append(tuple(values))
    return tuple(origins)


# Per-token features a best-fit bin may hold besides token_sources: those read from lane files
# (loader.stages.features); which of them a packer's bins must hold is checked on restore, against
# the source's lane files (BestFitPacker.set_state).
_BIN_FEATURES = BIN_STATE_FEATURES  # + stage-made ones saved in bins (image_ref)


def _check_bin_values(bins: tuple, path: str, name: str, low: int, high: int, what: str, problems: Problems) -> None:
    """Every bin's ``name`` array (tokens or token_sources) in ``[low, high)``: one pass over
    all bins of a packer; the first bad item of the first bad bin is named."""
    arrays = [getattr(b, name) for b in bins]
    if not arrays:
        return
    joined = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    if not len(joined) or (int(joined.min()) >= low and int(joined.max()) < high):
        return
    for k, array in enumerate(arrays):
        bad = np.flatnonzero((array < low) | (array >= high))
        if len(bad):
            problems.add(f"{path}.bins[{k}].{name}[{int(bad[0])}]",
                         f"{what} must be in [{low}, {high - 1}] (got {int(array[bad[0]])})")
            return


def stage_state(raw: dict, lane: LaneState) -> dict:
    """The lane state to hand to ``Lane.set_state``: the JSON with each bin's id lists replaced
    by the arrays parsed here (int32 tokens, int8 token_sources, as ``get_state`` makes them),
    so a restore converts them once. Saving it again gives the same JSON."""
    if lane.mixed is not None:
        return dict(raw, mixed=_packer_with_arrays(raw["mixed"], lane.mixed)) if lane.mixed.bins else raw
    if not any(source.packer.bins for source in lane.sources.values()):
        return raw
    sources = {}
    for name, source in lane.sources.items():
        saved = raw["sources"][name]
        sources[name] = dict(saved, packer=_packer_with_arrays(saved["packer"], source.packer)) if source.packer.bins \
            else saved
    return dict(raw, sources=sources)


def _packer_with_arrays(raw: dict, packer: PackerState) -> dict:
    bins = []
    for saved, bin_ in zip(raw["bins"], packer.bins):
        arrays = {"tokens": bin_.tokens.astype(np.int32)}
        if bin_.token_sources is not None:
            arrays["token_sources"] = bin_.token_sources.astype(np.int8)
        for name, values in bin_.features:
            arrays[name] = values.astype(FEATURES[name].dtype)
        bins.append(dict(saved, **arrays))
    return dict(raw, bins=bins)


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
            problems.add(f"{path}.outputs", f"lane {lane_id} state has produced {lane.outputs} sequences but the "
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
                    problems.add(f"{spath}.stopped", f"source {source.name!r} is exhaustion={source.exhaustion!r} "
                                 "without max_epochs: it never stops")
                elif not saved.packer.stream.exhausted or saved.packer.bins:
                    problems.add(f"{spath}.stopped", "a source stops only once its stream is exhausted and no bin "
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
        problems.add(f"{path}.bins", f"holds {len(packer.bins)} open bins; best_fit_open_bins is {limits.open_bins}")
    for k, bin_ in enumerate(packer.bins):
        if len(bin_.tokens) >= limits.seq_len:
            problems.add(f"{path}.bins[{k}].tokens", f"an open bin holds fewer than seq_len={limits.seq_len} tokens "
                         f"(got {len(bin_.tokens)})")
    vocab = limits.vocab_size if limits.vocab_size is not None else np.iinfo(np.int32).max + 1
    _check_bin_values(packer.bins, path, "tokens", 0, vocab, "token ids (the tokenizer's vocabulary)", problems)
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
                problems.add(where, f"block {origin[1]} is not a block of lane {lane_id} of source "
                             f"{limits.sources[s].name!r} ({blocks} per epoch)")
            elif not cursor.exhausted and origin >= (at := (cursor.epoch, cursor.block, cursor.offset)):
                part = next((i for i in range(3) if origin[i] != at[i]), 2)  # the first component past the cursor's
                problems.add(f"{where}[{part}]", f"a piece comes from before its stream's cursor {list(at)} "
                             f"(got {list(origin)})")


def _check_cursor(cursor: Cursor, path: str, lane_id: int, source: SourceLimits, limits: StateLimits,
                  taken_bound: int, problems: Problems) -> None:
    max_epochs = source.max_epochs
    if cursor.exhausted:
        if max_epochs is None:
            problems.add(f"{path}.exhausted", f"source {source.name!r} is exhaustion={source.exhaustion!r} without "
                         "max_epochs: its stream never ends")
        else:
            for name, value, end in (("epoch", cursor.epoch, max_epochs), ("block", cursor.block, 0),
                                     ("offset", cursor.offset, 0)):
                if value != end:
                    problems.add(f"{path}.{name}", f"must be {end}: an exhausted stream ({path}.exhausted is true) "
                                 f"stands at epoch max_epochs={max_epochs}, block 0, offset 0 (got {value})")
        return
    if max_epochs is not None and cursor.epoch >= max_epochs:
        problems.add(f"{path}.epoch", f"must be < max_epochs={max_epochs} of source {source.name!r} for a stream "
                     f"that is not exhausted ({path}.exhausted is false) (got {cursor.epoch})")
        return
    rows = source.rows.get(lane_id, 0)
    if cursor.epoch and rows and limits.wrap_tokens and cursor.epoch * rows * limits.wrap_tokens > taken_bound:
        problems.add(f"{path}.epoch", f"epoch {cursor.epoch} is unreachable: {cursor.epoch} epochs of the lane's "
                     f"{rows} documents are more tokens than the lane's output could have consumed ({taken_bound})")
    blocks = source.blocks.get(lane_id)
    if blocks is not None and cursor.block >= blocks:
        problems.add(f"{path}.block", f"lane {lane_id} of source {source.name!r} has {blocks} blocks (row groups) "
                     f"per epoch, so block must be in [0, {blocks - 1}] (got {cursor.block})")


def _check_window(stream: MixedStream, path: str, lane_id: int, outputs: int, limits: StateLimits,
                  starts: list[int], taken_bound: int, problems: Problems) -> None:
    """The token-mixing window: counters, the open document and the phase the lane is in."""
    if sum(stream.tokens) > taken_bound:
        k = stream.tokens.index(max(stream.tokens))
        problems.add(f"{path}.tokens[{k}]", f"the window counts {sum(stream.tokens)} tokens; the lane's {outputs} "
                     f"outputs can hold at most {taken_bound}")
    if stream.current >= 0 and stream.sources[stream.current].exhausted:
        problems.add(f"{path}.current", f"source {stream.current} is exhausted: it has no open document")

    def phase_of(global_index: int) -> int:
        step = global_index // limits.global_batch_size
        return max(s for s in starts if s <= step)

    # The window of the last output, or of the next one (a bulk cut rewound to its first row).
    allowed = {phase_of(lane_id + outputs * limits.num_lanes)}
    allowed.add(0 if outputs == 0 else phase_of(lane_id + (outputs - 1) * limits.num_lanes))
    if stream.phase_start not in allowed:
        problems.add(f"{path}.phase_start", f"must be the schedule phase of the lane's last or next output "
                     f"(one of {sorted(allowed)}; got {stream.phase_start})")
