"""Lane states shipped from a worker as deltas: a best-fit bin already sent is sent again by name.

Every item a worker ships carries its lane's state after it (the trainer records the state of
what it hands out, so a checkpoint never includes prefetched work). A best-fit packer's state
holds its open bins' token arrays: ~8 bins of up to ``seq_len`` tokens, rebuilt and pickled for
every item (bench/RESULTS.md, issue 16: 468 KB of descriptor per message of 8 items, and the
arrays' concatenation more than doubled a worker's CPU per item). Yet between two items of a
lane only the bins that gained a piece changed: bins only gain pieces, so a bin with the same
serial and the same number of pieces is the same bin.

So the worker takes cheap snapshots (:meth:`loader.stages.lane.Lane.snapshot`) and
:class:`StateEncoder` builds only the bins it has not sent for that lane, naming the others;
:class:`StateDecoder` on the trainer's side puts the previous arrays back in. Both follow the
message order of one worker's run (the order the items are produced and read), so a decoded
state is exactly the ``get_state()`` the worker would have sent: same keys, same arrays.
Encoder and decoder are made anew for every run (a ``start`` resets both sides).

A lane whose packers' states are bare stream cursors (concat packing over plain streams) ships
``(outputs, cursors, stopped)`` instead (:meth:`loader.stages.lane.Lane.cursors`: four integers
per source), and the decoder turns it into a :class:`StateSnapshot` of
:func:`loader.stages.lane_record.cursor_lane_state`, whose dicts are built only if the state is saved:
building, pickling and unpickling those dicts for every item cost ~20 us of CPU per 8 items,
timed alone (~5% of a 2-worker replay's CPU: bench/RESULTS.md, issue 16). Such a snapshot is a lane state wherever the trainer keeps
one (``loader.stages.producer.build_lanes`` builds the dicts where a lane is made from them).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from loader.checkpoint.records import StateSnapshot
from loader.stages.lane_record import cursor_lane_state

_ENCODED = "__encoded_state__"  # wraps a lane state that holds deltas (the only key of the wrapper)
_DELTA = "__bins_delta__"  # marks an encoded best-fit packer state inside a lane state (its lane)


class StateEncoder:
    """The worker's side: per (lane, place in the state) the bins sent, by serial."""

    def __init__(self) -> None:
        self._sent: dict[tuple, dict[int, int]] = {}  # (lane, path) -> {bin serial: pieces sent}

    def ship(self, lane_id: int, lane) -> Any:
        """What a worker sends as ``lane``'s state as of now (a :class:`loader.stages.lane.Lane`):
        best-fit bins encoded, bare cursors as integers, any other state as ``get_state()``."""
        if lane.holds_bins:
            return self.encode(lane_id, lane.snapshot())
        cursors = lane.cursors()
        return lane.get_state() if cursors is None else cursors

    def encode(self, lane_id: int, state: Any) -> Any:
        """The state to ship: ``state`` itself when it holds no best-fit snapshot (concat: the
        trainer then does nothing to it), else its encoding, wrapped for the decoder."""
        encoded = self._walk(lane_id, (), state)
        return state if encoded is state else {_ENCODED: encoded}

    def _walk(self, lane_id: int, path: tuple, value: Any) -> Any:
        """``value`` with its snapshots encoded; ``value`` itself if it holds none."""
        if isinstance(value, StateSnapshot):
            return self._bins(lane_id, path, value)
        if isinstance(value, dict):
            walked = {k: self._walk(lane_id, path + (k,), v) for k, v in value.items()}
            return value if all(walked[k] is v for k, v in value.items()) else walked
        return value

    def _bins(self, lane_id: int, path: tuple, snapshot: StateSnapshot) -> dict:
        # A best-fit snapshot's arguments: stream state, serial, [(bin serial, pieces)]
        # (loader.stages.packing.BestFitPacker.snapshot); its builder makes the arrays and the
        # piece_origins (a bin sent before has its origins on the trainer's side too).
        build, (stream_state, serial, open_bins) = snapshot._build, snapshot._args
        sent = self._sent.get((lane_id, path), {})
        new = [(s, pieces) for s, pieces in open_bins if sent.get(s) != len(pieces)]
        built = iter(build(stream_state, serial, new)["bins"])
        bins = [next(built) if sent.get(s) != len(pieces) else s for s, pieces in open_bins]
        self._sent[(lane_id, path)] = {s: len(pieces) for s, pieces in open_bins}
        return {_DELTA: lane_id, "stream": stream_state, "serial": serial, "bins": bins}


class StateDecoder:
    """The trainer's side: per (lane, place in the state) the bins received, by serial; the
    lanes' source names and mixing unit, which cursor states are built with."""

    def __init__(self, source_names: Sequence[str], token_mixing: bool) -> None:
        self._bins: dict[tuple, dict[int, dict]] = {}
        self._cursor_state = functools.partial(cursor_lane_state, tuple(source_names), token_mixing)

    def decode(self, state: Any) -> Any:
        """The shipped state as ``get_state()`` made it (one type test for a plain state), or a
        snapshot that builds it (a cursor state)."""
        if type(state) is tuple:
            return StateSnapshot(self._cursor_state, *state)
        if type(state) is not dict or _ENCODED not in state:
            return state
        return self._walk((), state[_ENCODED])

    def _walk(self, path: tuple, value: Any) -> Any:
        if isinstance(value, dict):
            if _DELTA in value:
                return self._bins_of(path, value)
            return {k: self._walk(path + (k,), v) for k, v in value.items()}
        return value

    def _bins_of(self, path: tuple, delta: dict) -> dict:
        key = (delta[_DELTA], path)  # the lane, and where in its state
        known = self._bins.get(key, {})
        # An int is a bin sent before, unchanged; a dict is a new or grown bin. The decoded
        # states share the unchanged bins' dicts (no one changes a state once made).
        bins = [known[b] if isinstance(b, int) else b for b in delta["bins"]]
        self._bins[key] = {b["serial"]: b for b in bins}
        return {"stream": delta["stream"], "bins": bins, "serial": delta["serial"]}

