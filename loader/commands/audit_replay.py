"""``zephon audit``'s best-fit replay on integers: a lane's state before a step, from lengths alone.

Where no checkpoint can place a best-fit lane, the audit replays it from step 0. Packing only
ever looks at document lengths, so the replay does not need tokens, per-token features or
sequences: :class:`BestFitReplay` runs :class:`~loader.stages.packing.BestFitPacker`'s rule
on plain integers over a :class:`~loader.io.provenance.ProvenanceStream`'s lengths (the
document pieces ``LaneTokenStream.take(seq_len, within_document=True)`` would return: the
cursor, a length, whether it begins a document), and :func:`replayed_lane_state` runs
:class:`~loader.stages.lane.Lane`'s source choice (schedule, fallback once a source stops)
over one packer per source. The result is the lane state the training lane has before the
step, bins as pieces with their origins (``piece_origins``, as a version-2 checkpoint holds
them), which the audit restores like a checkpoint's (``audit._resolved_lane_state``).

The packer's rule itself (:class:`loader.order.best_fit.OpenBins`, one implementation for both)
and the same cursor moves (a block is left as soon as its last token is taken; an epoch past
``max_epochs`` exhausts the stream): ``tests/audit/test_audit_replay.py`` compares the states with those of the per-sequence replay. Token mixing is not replayed here
(its deficit rule runs on the mixer's own counters): the audit uses the lane itself for it.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from loader.errors import LaneExhausted
from loader.io.cursor_record import BLOCK, EPOCH, EXHAUSTED, OFFSET, cursor_state
from loader.stages.lane_record import PACKER, SOURCES, STOPPED, lane_state
from loader.stages.packer_records import (
    BINS, DOC_STARTS, PIECE_ORIGINS, PIECE_STARTS, SERIAL, STREAM, TOKENS, best_fit_state,
)
from loader.order.best_fit import OpenBins


class _Cursor:
    """A stream's position over document lengths, moving as ``LaneTokenStream.take`` does."""

    def __init__(self, stream, state: dict) -> None:
        self.stream = stream
        self.extra = stream.token_format.extra
        self.epoch, self.block, self.offset = state[EPOCH], state[BLOCK], state[OFFSET]
        self.exhausted = state[EXHAUSTED]
        self._key: Optional[tuple[int, int]] = None
        self._ends: list[int] = []  # end of each document of the current block, in replay order
        self._doc = 0  # the document holding ``offset``

    def _load(self) -> None:
        stream = self.stream
        blocks = stream.blocks_of_epoch(self.epoch)
        file_ordinal, row_group = blocks[self.block]
        lengths = stream.lengths(file_ordinal, row_group)
        if self.epoch > 0:
            lengths = lengths[stream.lane_files.row_order(self.epoch, file_ordinal, row_group, len(lengths))]
        lengths = lengths[lengths >= 0]  # tombstones of zephon shard --transform: no document (ProvenanceStream.lengths)
        self._ends = np.cumsum(lengths + self.extra).tolist()
        self._blocks = len(blocks)
        self._key = (self.epoch, self.block)
        self._doc = 0

    def _advance_block(self) -> None:
        self.block += 1
        self.offset = 0
        if self.block >= self._blocks:
            self.epoch += 1
            self.block = 0
            max_epochs = self.stream.max_epochs
            if max_epochs is not None and self.epoch >= max_epochs:
                self.exhausted = True

    def take(self, n: int) -> Optional[tuple[tuple[int, int, int], int, bool]]:
        """``(origin, length, begins a document)`` of the next piece of at most ``n`` tokens
        inside one document, or None when exhausted."""
        while not self.exhausted:
            if self._key != (self.epoch, self.block):
                self._load()
            ends = self._ends
            total = ends[-1] if ends else 0
            if self.offset >= total:
                self._advance_block()
                continue
            doc = self._doc
            while ends[doc] <= self.offset:  # documents already taken (and empty ones)
                doc += 1
            self._doc = doc
            start = ends[doc - 1] if doc else 0
            origin = (self.epoch, self.block, self.offset)
            length = min(n, ends[doc] - self.offset)
            begins = self.offset == start
            self.offset += length
            if self.offset >= total:
                self._advance_block()
            return origin, length, begins
        return None

    def state(self) -> dict:
        return cursor_state(self.epoch, self.block, self.offset, self.exhausted)


class BestFitReplay:
    """:class:`~loader.stages.packing.BestFitPacker` on lengths: the same rule
    (:class:`loader.order.best_fit.OpenBins`), pieces ``(origin, length, begins a document)``."""

    def __init__(self, stream, seq_len: int, open_bins: int, state: Optional[dict] = None) -> None:
        state = state or best_fit_state(cursor_state(0, 0, 0, False), [], 0)
        self.cursor = _Cursor(stream, state[STREAM])
        self.seq_len = seq_len
        self.bins = OpenBins(seq_len, open_bins, serial=int(state[SERIAL]))
        # A compact state's bins (a seek point: compact()); a packer state's bins are never given here.
        for used, serial, pieces in state[BINS]:
            self.bins.restore(serial, used, [((e, b, o), length, begins) for e, b, o, length, begins in pieces])

    @property
    def serial(self) -> int:
        return self.bins.serial

    def compact(self) -> dict:
        """The replay's own state, JSON-ready: cursor, bins as ``[used, serial, [[epoch, block,
        offset, length, begins], ...]]`` and serial (what :mod:`loader.commands.seek_index` keeps)."""
        return {STREAM: self.cursor.state(), SERIAL: self.serial,
                BINS: [[used, serial, [[*origin, length, begins] for origin, length, begins in pieces]]
                       for serial, used, pieces in self.bins.bins()]}

    def next_sequence(self) -> bool:
        """Emit the next sequence (True), or False when the stream and the bins are empty."""
        seq_len, bins, take = self.seq_len, self.bins, self.cursor.take
        while True:
            piece = take(seq_len)
            if piece is None:
                return bins.flush() is not None
            if bins.place(piece[1], piece) is not None:
                return True

    def state(self) -> dict:
        """The packer's state, bins as a version-2 checkpoint holds them (tokens: zeros)."""
        saved = []
        for serial, used, pieces in self.bins.bins():
            starts = np.cumsum([0] + [p[1] for p in pieces[:-1]]).tolist()
            saved.append({SERIAL: serial, TOKENS: np.zeros(used, dtype=np.int32), PIECE_STARTS: starts,
                          DOC_STARTS: [s for s, p in zip(starts, pieces) if p[2]],
                          PIECE_ORIGINS: [list(p[0]) for p in pieces]})
        return best_fit_state(self.cursor.state(), saved, self.serial)


def replayed_lane_state(lane, first_output: int, end_output: int, *, start: Optional[dict] = None,
                        point_every: int = 0, on_point: Optional[Callable[[int, dict], None]] = None) -> Optional[dict]:
    """The state of ``lane`` (an audit lane, fresh: no output yet) after its outputs
    ``first_output .. end_output - 1``, or None if it has no best-fit packer per source
    (token mixing). Raises ``LaneExhausted`` as the lane would.

    ``start``: the :func:`compact_lane_state` the lane had after ``first_output`` outputs (a seek
    point); without it ``first_output`` must be 0. ``on_point(k, compact)`` is called whenever the
    lane has made ``k`` outputs, ``k`` a multiple of ``point_every``, with its compact state then."""
    spec = lane.spec
    if lane.token_mixing or spec.packing != "best_fit" or spec.packing_window is not None \
            or (first_output != 0 and start is None):
        return None
    streams = lane.source_streams()
    if start is None:
        packers = [BestFitReplay(stream, spec.seq_len, spec.best_fit_open_bins) for stream in streams]
        stopped = [False] * len(packers)
    else:
        packers = [BestFitReplay(stream, spec.seq_len, spec.best_fit_open_bins, source[PACKER])
                   for stream, source in zip(streams, start[SOURCES])]
        stopped = [bool(source[STOPPED]) for source in start[SOURCES]]
    schedule, B, L = spec.schedule, spec.global_batch_size, lane.num_lanes
    for k in range(first_output, end_output):
        global_index = k * L + lane.lane_id
        source_id = schedule.source_of(global_index)
        while True:
            if not stopped[source_id]:
                if packers[source_id].next_sequence():
                    break
                stopped[source_id] = True
            source_id = schedule.fallback_source(global_index, [not s for s in stopped], global_index // B)
            if source_id < 0:
                raise LaneExhausted(f"lane {lane.lane_id}: every source has run out of data")
        if on_point is not None and point_every and (k + 1) % point_every == 0:
            on_point(k + 1, compact_lane_state(packers, stopped))
    return lane_state(spec.source_names, False, end_output, [packer.state() for packer in packers], stopped)


def compact_lane_state(packers: list, stopped: list) -> dict:
    """A replayed lane as a seek point: each source's :meth:`BestFitReplay.compact` and whether
    it stopped, in the config's source order."""
    return {SOURCES: [{PACKER: packer.compact(), STOPPED: stop} for packer, stop in zip(packers, stopped)]}
