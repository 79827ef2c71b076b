"""A lane across all sources: the unit of state, ownership and work.

``Lane.next_sequence(global_index)`` produces the lane's next output: it asks the mixing
schedule which source the index takes (falling back deterministically when that source
has stopped in this lane), pulls one packed sequence from that source's packer, and counts
the output. The lane's state is the nested state of its packers plus the output count and
which sources have stopped; it does not depend on which rank or worker holds it.

State keys (its record, :mod:`loader.stages.lane_record`): ``outputs`` (sequences produced),
``sources`` (per source name: packer state, ``stopped``), or under token mixing ``mixed`` (the
one packer's state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from loader.checkpoint.records import StateSnapshot, lane_key
from loader.errors import LaneExhausted, StateError
from loader.io.blocks import TokenFormat
from loader.io.lane_reader import LaneTokenStream
from loader.io.owner import PROCESS_OWNER, StreamOwner
from loader.io.read_ahead import read_ahead_depth
from loader.io.storage import StorageOptions
from loader.kinds.base import manifest_kind
from loader.order.mixing import MixingSchedule
from loader.order.ordering import lane_outputs_before
from loader.stages.lane_record import MIXED, OUTPUTS, PACKER, SOURCES, STOPPED, cursor_lane_state, lane_state
from loader.stages.packer_records import STREAM
from loader.stages.packing import BestFitPacker, ConcatPacker, PackedSequence
from loader.stages.token_mixing import MixedTokenStream
from loader.stages.window_packing import WindowedBestFitPacker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceSpec:
    """What a process needs to open one source (picklable; sent to worker processes)."""

    name: str
    dataset_path: str
    manifest_json: str
    exhaustion: str
    max_epochs: Optional[int]
    transforms: tuple = ()  # resolved loader.transforms.TransformSpec, applied by the source's streams


@dataclass(frozen=True)
class LaneSpec:
    """Everything needed to build any lane, identical in every process."""

    sources: tuple[SourceSpec, ...]
    seed: int
    seq_len: int
    packing: str
    best_fit_open_bins: int
    token_format: TokenFormat
    pad_id: int
    tokenizer_json: Optional[str]  # serialised tokenizer, for text sources
    storage_options: StorageOptions
    schedule: MixingSchedule
    global_batch_size: int
    mixing_unit: str = "sequence"
    read_ahead: bool = False
    read_ahead_threads: int = 1
    features: tuple[str, ...] = ()  # per-token features every sequence carries (loader.stages.features)
    images: Optional[object] = None  # loader.vision.block.ImageOptions when some source holds images
    packing_window: Optional[int] = None  # best fit per window of this many documents (loader.stages.window_packing)
    # Finite data with epoch_tail "fill": a lane that runs out is one lane done, not the
    # stream's end (loader.stages.producer.End); its later indices are fill rows.
    fill_tails: bool = False
    overlong: str = "refuse"  # loader config ``overlong``: online chat's bound (loader.chat.block)

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(source.name for source in self.sources)

    @property
    def token_mixing(self) -> bool:
        """Whether a lane mixes its sources token by token (one mixed stream and packer)."""
        return self.mixing_unit == "token" and len(self.sources) > 1


class Lane:
    # The per-source stream type; ``zephon audit`` substitutes one that reads document lengths
    # and records each token's provenance (loader.io.provenance).
    stream_class = LaneTokenStream

    def __init__(self, spec: LaneSpec, lane_id: int, manifests: Sequence, tokenizer,
                 owner: StreamOwner = PROCESS_OWNER) -> None:
        self.spec = spec
        self.lane_id = lane_id
        self.outputs = 0
        self.packers = []
        self.stopped = [False] * len(spec.sources)
        self.num_lanes = manifests[0].num_lanes
        self._warned: set[int] = set()
        self.token_mixing = spec.token_mixing
        self.source_names = spec.source_names
        streams = []
        shares = spec.schedule.peak_shares()
        kinds = [manifest_kind(manifest) for manifest in manifests]
        for source, manifest, share, kind in zip(spec.sources, manifests, shares, kinds):
            max_epochs = 1 if source.exhaustion == "stop" else source.max_epochs
            stream = self.stream_class(
                dataset_path=source.dataset_path,
                manifest=manifest,
                source_name=source.name,
                lane_id=lane_id,
                seed=spec.seed,
                token_format=spec.token_format,
                tokenizer=None if manifest.pretokenized else tokenizer,
                max_epochs=max_epochs,
                storage_options=spec.storage_options,
                read_ahead=spec.read_ahead,
                read_ahead_threads=spec.read_ahead_threads,
                read_ahead_blocks=read_ahead_depth(share, takes_next_block_early=self.token_mixing),
                transforms=source.transforms,
                owner=owner,
                **kind.stream_options(manifest, spec, source.name, tokenizer),
            )
            # Finite data with filled tails: a lane whose documents are all dropped (transforms,
            # overlong) has simply none to deliver; it is done at the end of its epochs.
            stream.ends_when_empty = spec.fill_tails and max_epochs is not None
            streams.append(stream)
        # What completes each sequence of a stream before it is handed out, by its kind (image
        # sources: the pixels of its image refs); None for most kinds.
        self._image_resolvers = [kind.sequence_resolver(stream, spec, manifest)
                                 for stream, manifest, kind in zip(streams, manifests, kinds)]
        # Streams whose blocks reject documents online (chat, images), which each item reports; usually none.
        self._chat_streams = tuple(s for s in streams if s.chat_rejects is not None)
        self.has_online_chat = bool(self._chat_streams)
        # Token mixing: the phase of the last step asked for, (start step, weights, the lane's
        # output count at the phase's end or None), as ``next_sequence`` needs it per sequence.
        self._phase_step = -1
        self._phase: tuple = ()
        caps = [kind.bin_cap(spec) if spec.packing == "best_fit" else None for kind in kinds]
        if self.token_mixing:
            self.mixed_stream = MixedTokenStream(streams)
            self.packers = [self._packer(self.mixed_stream, next((c for c in caps if c is not None), None))]
        else:
            self.packers = [self._packer(stream, cap) for stream, cap in zip(streams, caps)]
        # Whether every packer's state is its stream's bare cursor (ConcatPacker.cursor_snapshot's
        # common case): step_snapshot then reads the cursors directly, once per lane and step.
        self._cursor_only = all(isinstance(p, ConcatPacker) and type(p.stream) is LaneTokenStream
                                and p.stream.state_is_cursor for p in self.packers)
        # Whether snapshot() can hold a best-fit StateSnapshot (worker state deltas encode only those).
        self.holds_bins = any(isinstance(p, BestFitPacker) for p in self.packers)
        # Whether a sequence of this lane is always its source's concat packer's next row and
        # nothing else (no token mix, images or chat rejects to attach): the loader then takes
        # a micro-batch's rows straight from the packers' fills (take_fill_row).
        self.bulk_rows = (not self.token_mixing and not self._chat_streams
                          and all(r is None for r in self._image_resolvers)
                          and all(type(p) is ConcatPacker for p in self.packers))

    def _packer(self, stream, cap: Optional[tuple] = None):
        """The source's packer; ``cap``: its kind's best-fit bin cap (LaneKind.bin_cap), or None."""
        if self.spec.packing == "concat":
            return ConcatPacker(stream, self.spec.seq_len, self.spec.pad_id, features=self.spec.features)
        if self.spec.packing_window is not None:
            return WindowedBestFitPacker(stream, self.spec.seq_len, self.spec.pad_id, self.spec.packing_window,
                                         features=self.spec.features)
        max_images, images_in = cap if cap is not None else (None, None)
        return BestFitPacker(stream, self.spec.seq_len, self.spec.pad_id, self.spec.best_fit_open_bins,
                             features=self.spec.features, max_images=max_images, images_in=images_in)

    def next_sequence(self, global_index: int) -> tuple[int, PackedSequence]:
        """``(source_id, sequence)`` for the lane's next output; raises :class:`LaneExhausted`."""
        schedule = self.spec.schedule
        if self.token_mixing:
            step = global_index // self.spec.global_batch_size
            if step != self._phase_step:  # the phase's lookups once per step, not per sequence
                phase = schedule.phase_at(step)
                end = schedule.phase_end(step)
                outputs_at_end = None if end is None else lane_outputs_before(
                    end * self.spec.global_batch_size, self.lane_id, self.num_lanes)
                self._phase_step, self._phase = step, (phase.start_step, phase.weights, outputs_at_end)
            start_step, weights, outputs_at_end = self._phase
            rows_left = None if outputs_at_end is None else outputs_at_end - self.outputs
            self.mixed_stream.set_phase(start_step, weights, rows_left)
            sequence = self.packers[0].next_sequence()
            if sequence is None:
                raise LaneExhausted(f"lane {self.lane_id}: every source has run out of data")
            self.outputs += 1
            if sequence.majority_source >= 0:  # bulk rows count it for the whole fill
                return sequence.majority_source, sequence
            # Majority source (ties: lowest id); padding is -1, i.e. 255 as uint8, out of range.
            counts = np.bincount(sequence.token_sources.view(np.uint8), minlength=256)[: len(self.stopped)]
            return int(counts.argmax()), sequence
        source_id = schedule.source_of(global_index)
        while True:
            if not self.stopped[source_id]:
                sequence = self.packers[source_id].next_sequence()
                if sequence is not None:
                    if self._image_resolvers[source_id] is not None:
                        self._image_resolvers[source_id].attach(sequence)
                    self.outputs += 1
                    return source_id, sequence
                self.stopped[source_id] = True
                self._warn_stopped(source_id)
            step = global_index // self.spec.global_batch_size
            source_id = schedule.fallback_source(global_index, [not s for s in self.stopped], step)
            if source_id < 0:
                raise LaneExhausted(f"lane {self.lane_id}: every source has run out of data")

    def take_chat_rejects(self) -> Optional[dict]:
        """Online chat rejects of the blocks the lane's streams entered since the last call
        (``{reason: count}``), or None; the producer attaches them to the lane's next item."""
        if not self._chat_streams:
            return None
        rejects = None
        for stream, cursor in self._chat_cursors():
            counts = stream.chat_rejects.take(cursor["epoch"], cursor["block"], cursor["offset"])
            for reason, count in (counts or {}).items():
                rejects = {} if rejects is None else rejects
                rejects[reason] = rejects.get(reason, 0) + count
        return rejects

    def _chat_cursors(self) -> list:
        """``(stream, cursor)`` of each chat stream as the lane's state would save it: which
        blocks were entered must be read off the checkpointed cursor, not off the stream's
        own (a token mix reads whole rows ahead and saves the cursors of the rows handed out)."""
        if not self.token_mixing:
            return [(stream, stream.get_state()) for stream in self._chat_streams]
        packer = self.packers[0]
        # concat: the rewound cursors of the rows handed out; best fit saves the live cursors
        mixed = packer.get_state()[STREAM] if isinstance(packer, ConcatPacker) else packer.stream.get_state()
        return [(stream, cursor) for stream, cursor in zip(self.mixed_stream.streams, mixed["sources"])
                if stream in self._chat_streams]

    def source_streams(self) -> list[LaneTokenStream]:
        """The lane's per-source token streams (under a token-mixing stream too)."""
        return list(self.mixed_stream.streams) if self.token_mixing else [packer.stream for packer in self.packers]

    def start_reading(self) -> None:
        """Start reading every source's current block in the background (see
        :meth:`LaneTokenStream.start_reading`): a run's lanes are read side by side, not on first use."""
        for stream in self.source_streams():
            stream.start_reading()

    def close(self) -> None:
        for stream in self.source_streams():
            stream.close()
        for resolver in self._image_resolvers:
            if resolver is not None:
                resolver.close()

    def _warn_stopped(self, source_id: int) -> None:
        if all(self.stopped):  # the lane is done: finite data's configured end, not a change of mix
            log.debug("lane %d: every source has stopped", self.lane_id)
            return
        if source_id not in self._warned:
            self._warned.add(source_id)
            log.warning(
                "source %r ran out of data in lane %d (exhaustion=%s); its share goes to the other "
                "sources, renormalised by weight",
                self.spec.sources[source_id].name, self.lane_id, self.spec.sources[source_id].exhaustion,
            )

    def get_state(self) -> dict:
        return self._state(lambda packer: packer.get_state())

    def snapshot(self) -> dict:
        """``get_state()`` as of now, where a packer's part may be a ``StateSnapshot`` (best fit:
        its arrays are built only if the snapshot is saved; ``loader.checkpoint.state.to_jsonable`` does it)."""
        return self._state(lambda packer: packer.snapshot())

    def step_snapshot(self) -> StateSnapshot:
        """:meth:`snapshot`, itself built only if it is saved: what the loader keeps of every lane
        at every step boundary (``step_states_kept``), so the common case (never asked for)
        costs a few object creations per lane, not the state's dicts."""
        cursors = self.cursors()
        if cursors is not None:  # concat over plain streams: four integers per source
            return StateSnapshot(self._cursor_state, *cursors)
        parts = [packer.cursor_snapshot() if isinstance(packer, ConcatPacker) else packer.snapshot()
                 for packer in self.packers]
        return StateSnapshot(self._snapshot_state, self.outputs, parts, tuple(self.stopped))

    def cursors(self) -> Optional[tuple[int, list, tuple]]:
        """``get_state()`` as ``(outputs, [cursor per source], stopped)`` where every packer's state
        is its stream's bare cursor (:attr:`_cursor_only`), else None: the arguments of
        :func:`cursor_lane_state`, which a worker ships instead of the dicts."""
        if not self._cursor_only:
            return None
        return self.outputs, [packer.cursor() for packer in self.packers], tuple(self.stopped)

    def _cursor_state(self, outputs: int, cursors: list, stopped: tuple) -> dict:
        return cursor_lane_state(self.source_names, self.token_mixing, outputs, cursors, stopped)

    def _snapshot_state(self, outputs: int, parts: list, stopped: tuple) -> dict:
        return lane_state(self.source_names, self.token_mixing, outputs, parts, stopped)

    def _state(self, packer_state) -> dict:
        return lane_state(self.source_names, self.token_mixing, self.outputs,
                          [packer_state(packer) for packer in self.packers], self.stopped)

    def set_state(self, state: dict, path: Optional[str] = None) -> None:
        """Continue from a lane state checked by ``loader.checkpoint.schema`` (as
        ``ZephonLoader.load_state_dict`` does); ``path`` (default ``lanes.<lane>``) is its JSON
        path, named by the checks that need the data (a cursor's offset inside its block)."""
        path = f"lanes.{lane_key(self.lane_id)}" if path is None else path
        self.outputs = int(state[OUTPUTS])
        if self.token_mixing:
            if MIXED not in state:
                raise StateError(f"{path}.{MIXED}: missing (lane {self.lane_id} state is not a token-mixing state)")
            self.packers[0].set_state(state[MIXED], path=f"{path}.{MIXED}")
            return
        for k, source in enumerate(self.spec.sources):
            saved = state.get(SOURCES, {}).get(source.name)
            if saved is None:
                raise StateError(f"{path}.{SOURCES}.{source.name}: missing (lane {self.lane_id} state has no entry "
                                 f"for source {source.name!r})")
            self.packers[k].set_state(saved[PACKER], path=f"{path}.{SOURCES}.{source.name}.{PACKER}")
            self.stopped[k] = bool(saved[STOPPED])
