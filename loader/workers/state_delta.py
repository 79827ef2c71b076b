"""Lane states shipped from a worker as deltas: a best-fit bin's pieces are sent once.

Every item a worker ships carries its lane's state after it (the trainer records the state of
what it hands out, so a checkpoint never includes prefetched work). A best-fit packer's state
holds its open bins' token arrays: ~8 bins of up to ``seq_len`` tokens. Rebuilding and pickling
them for every item cost more than the packing (468 KB of descriptor per message of 8 items:
bench/HISTORY.md, "worker changes (helper A/B pairs, load 2-16)"); sending only the
bins that changed, whole, still cost a worker about half its CPU per item (bench/HISTORY.md,
"Issue 35: best fit near concat"). Yet between two items of a lane a bin only gains pieces,
and a piece never changes: so a bin with the same serial is the same bin with perhaps more
pieces.

So the worker takes cheap snapshots (:meth:`loader.stages.lane.Lane.snapshot`: each open bin's
pieces) and :class:`StateEncoder` sends, per open bin, its serial, how many of its pieces the
trainer has already, and the new pieces themselves (tokens, document starts, features,
origin); nothing is concatenated or built in the worker. :class:`StateDecoder` on the
trainer's side keeps each bin's pieces and returns a :class:`StateSnapshot` whose
``get_state()`` runs the packer's own state builder on them: exactly the ``get_state()`` the
worker's lane had (same keys, same arrays), built only if the state is saved. Both follow the
message order of one worker's run (the order the items are produced and read). Encoder and
decoder are made anew for every run (a ``start`` resets both sides).

Lanes whose packers are all best-fit packers over lane streams, not mixed per token (the common
case, :func:`plain_packers`), skip the snapshot and its nested dicts: :meth:`StateEncoder.packers`
reads the packers directly and ships, per packer, a tuple of its cursor, the open bins' serials
and piece counts, and the new pieces with their tokens as one bytes string per item
(:func:`~loader.stages.packing.ship_pieces`); the trainer appends the new pieces to their bins'
lists and makes piece objects only when a state is saved. Per item that moved a worker's state
shipping from ~40 to ~10 us and the trainer's decoding from ~25 to ~10 us (pickling a small
array costs ~5 us, its bytes ~0.3 us: bench/HISTORY.md, "Best fit with 2 workers").

A lane whose packers' states are bare stream cursors (concat packing over plain streams) ships
``(outputs, cursors, stopped)`` instead (:meth:`loader.stages.lane.Lane.cursors`: four integers
per source), and the decoder turns it into a :class:`StateSnapshot` of
:func:`loader.stages.lane_record.cursor_lane_state`, whose dicts are built only if the state is saved:
building, pickling and unpickling those dicts for every item cost ~20 us of CPU per 8 items,
timed alone (~5% of a 2-worker replay's CPU: bench/HISTORY.md, "issue 16, the worker
transport"). Such a snapshot is a lane state wherever the trainer keeps
one (``loader.stages.producer.build_lanes`` builds the dicts where a lane is made from them).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence

from loader.checkpoint.records import StateSnapshot
from loader.io.cursor_record import cursor_state
from loader.io.lane_reader import LaneTokenStream
from loader.stages.lane_record import cursor_lane_state, lane_state
from loader.stages.packer_records import BINS, SERIAL, STREAM
from loader.stages.packing import (
    BestFitPacker, received_piece, received_piece_of, received_pieces, ship_piece, ship_pieces,
)

_ENCODED = "__encoded_state__"  # wraps a lane state that holds deltas (the only key of the wrapper)
_DELTA = "__bins_delta__"  # marks an encoded best-fit packer state inside a lane state (its lane)
_PACKERS = "bins"  # the first item of a lane state shipped as its best-fit packers (StateEncoder.packers)


class StateEncoder:
    """The worker's side: per (lane, place in the state) the bins sent, by serial."""

    def __init__(self) -> None:
        self._sent: dict[tuple, dict[int, int]] = {}  # (lane, path) -> {bin serial: pieces sent}
        self._plain: dict[int, bool] = {}  # lane -> whether packers() ships it (plain_packers)

    def ship(self, lane_id: int, lane) -> Any:
        """What a worker sends as ``lane``'s state as of now (a :class:`loader.stages.lane.Lane`):
        best-fit packers as tuples of their parts, other best-fit bins encoded, bare cursors as
        integers, any other state as ``get_state()``."""
        if lane.holds_bins:
            plain = self._plain.get(lane_id)
            if plain is None:
                plain = self._plain[lane_id] = plain_packers(lane)
            return self.packers(lane_id, lane) if plain else self.encode(lane_id, lane.snapshot())
        cursors = lane.cursors()
        return lane.get_state() if cursors is None else cursors

    def packers(self, lane_id: int, lane) -> tuple:
        """A lane of :func:`plain_packers` as ``("bins", lane, outputs, stopped, parts)``, per
        packer ``(stream, serial, bin serials, piece counts, changes, pieces)``: its stream's cursor
        (four integers; the state's dict where it is more), the next bin serial, the open bins'
        serials and how many pieces each holds, ``(serial, pieces sent before, pieces added)`` of
        each bin that gained pieces since the last item, and those pieces, in that order
        (:func:`~loader.stages.packing.ship_pieces`; None: none).

        Straight from the packers, no snapshot or state dicts: walking and pickling the nested
        state of every item cost a worker more than packing it (bench/HISTORY.md, "Best fit
        with 2 workers")."""
        parts = []
        for k, packer in enumerate(lane.packers):
            key = (lane_id, k)
            sent = self._sent.get(key, {})
            open_bins = packer.bins
            serials = tuple(open_bins.serials)
            counts = tuple(map(len, open_bins.pieces))
            changes, added = [], []
            for bin_serial, count, pieces in zip(serials, counts, open_bins.pieces):
                kept = sent.get(bin_serial, 0)
                if kept != count:
                    changes.append((bin_serial, kept, count - kept))
                    added.extend(pieces[kept:])
            self._sent[key] = dict(zip(serials, counts))
            stream = packer.stream
            cursor = (stream.epoch, stream.block_index, stream.offset, stream.exhausted) if stream.state_is_cursor \
                else stream.get_state()
            parts.append((cursor, open_bins.serial, serials, counts, changes, ship_pieces(added) if added else None))
        return (_PACKERS, lane_id, lane.outputs, tuple(lane.stopped), parts)

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
        # (loader.stages.packing.BestFitPacker.snapshot). A bin is its serial when the trainer
        # has all its pieces, else (serial, pieces it has, the pieces it lacks).
        stream_state, serial, open_bins = snapshot._args
        sent = self._sent.get((lane_id, path), {})
        bins = []
        for bin_serial, pieces in open_bins:
            kept = sent.get(bin_serial, 0)
            bins.append(bin_serial if kept == len(pieces) else (bin_serial, kept, [ship_piece(p) for p in pieces[kept:]]))
        self._sent[(lane_id, path)] = {s: len(pieces) for s, pieces in open_bins}
        # The packer record's keys (loader.stages.packer_records); BINS holds the delta of the bins.
        return {_DELTA: lane_id, STREAM: stream_state, SERIAL: serial, BINS: bins}


class StateDecoder:
    """The trainer's side: per (lane, place in the state) each open bin's pieces, by serial; the
    lanes' source names and mixing unit, which cursor states are built with."""

    def __init__(self, source_names: Sequence[str], token_mixing: bool) -> None:
        self._bins: dict[tuple, dict[int, tuple]] = {}
        # (lane, packer) -> {bin serial: its pieces so far, as received_pieces' tuples}, for
        # StateEncoder.packers: a bin's list only grows (pieces never change), so an item's snapshot
        # holds the map and each open bin's piece count.
        self._held: dict[tuple, dict[int, list]] = {}
        self._source_names = tuple(source_names)
        self._cursor_state = functools.partial(cursor_lane_state, self._source_names, token_mixing)

    def decode(self, state: Any) -> Any:
        """The shipped state as ``get_state()`` made it (one type test for a plain state), or a
        snapshot that builds it (a cursor state, or one holding best-fit bins)."""
        if type(state) is tuple:
            if state[0] == _PACKERS:
                return self._packers_of(state)
            return StateSnapshot(self._cursor_state, *state)
        if type(state) is not dict or _ENCODED not in state:
            return state
        return StateSnapshot(built_state, self._walk((), state[_ENCODED]))

    def _packers_of(self, shipped: tuple) -> StateSnapshot:
        """:meth:`StateEncoder.packers`' tuple as a snapshot of the lane's state (built if saved).

        Per item only the bins that gained pieces are touched: the snapshot holds the open bins'
        serials and piece counts as shipped and the map of each bin's pieces so far, whose lists
        only grow (a pruned map is a new dict: older snapshots keep theirs)."""
        _, lane_id, outputs, stopped, parts = shipped
        packers = []
        for k, (cursor, serial, serials, counts, changes, added) in enumerate(parts):
            held = self._held.get((lane_id, k))
            if held is None:
                held = self._held[(lane_id, k)] = {}
            if changes:
                pieces = received_pieces(*added)
                for bin_serial, kept, count in changes:
                    known = held.get(bin_serial, [] if kept == 0 else None)
                    if known is None or len(known) != kept:
                        # a message lost or out of order: never record a state with pieces missing
                        raise RuntimeError(f"internal error: lane {lane_id} bin {bin_serial}: the worker sent its "
                                           f"pieces from {kept} on, the trainer holds "
                                           f"{0 if known is None else len(known)}")
                    held[bin_serial] = known
                    known.extend(itertools.islice(pieces, count))
            if len(held) > 2 * len(serials) + 8:  # emitted bins: their serials never come back
                held = self._held[(lane_id, k)] = {s: held[s] for s in serials if s in held}
            packers.append((cursor, serial, serials, counts, held))
        return StateSnapshot(self._packers_state, lane_id, outputs, packers, stopped)

    def _packers_state(self, lane_id: int, outputs: int, packers: list, stopped: tuple) -> dict:
        parts = []
        for cursor, serial, serials, counts, held in packers:
            open_bins = []
            for bin_serial, count in zip(serials, counts):
                known = held.get(bin_serial, ())
                if len(known) < count:
                    raise RuntimeError(f"internal error: lane {lane_id} bin {bin_serial}: the worker named "
                                       f"{count} pieces, the trainer holds {len(known)}")
                open_bins.append((bin_serial, [received_piece_of(*piece) for piece in known[:count]]))
            parts.append(BestFitPacker.state_of(cursor_state(*cursor) if type(cursor) is tuple else cursor, serial,
                                                open_bins))
        return lane_state(self._source_names, False, outputs, parts, stopped)

    def _walk(self, path: tuple, value: Any) -> Any:
        if isinstance(value, dict):
            if _DELTA in value:
                return self._bins_of(path, value)
            return {k: self._walk(path + (k,), v) for k, v in value.items()}
        return value

    def _bins_of(self, path: tuple, delta: dict) -> StateSnapshot:
        key = (delta[_DELTA], path)  # the lane, and where in its state
        known = self._bins.get(key, {})
        bins = {}
        for entry in delta[BINS]:
            if type(entry) is int:  # every piece known: the same (immutable) tuple
                bins[entry] = known[entry]
            else:
                serial, kept, new = entry
                bins[serial] = known.get(serial, ())[:kept] + tuple(received_piece(*p) for p in new)
        self._bins[key] = bins
        return StateSnapshot(BestFitPacker.state_of, delta[STREAM], delta[SERIAL], list(bins.items()))


def plain_packers(lane) -> bool:
    """Whether ``lane``'s state is its best-fit packers' parts alone (:meth:`StateEncoder.packers`):
    sources not mixed per token, every packer a :class:`BestFitPacker` over a lane stream."""
    return not lane.token_mixing and all(type(p) is BestFitPacker and type(p.stream) is LaneTokenStream
                                         for p in lane.packers)


def built_state(value: Any) -> Any:
    """``value`` with every :class:`StateSnapshot` in it built (a decoded lane state's bins)."""
    if isinstance(value, StateSnapshot):
        return value.get_state()
    if isinstance(value, dict):
        return {k: built_state(v) for k, v in value.items()}
    return value
