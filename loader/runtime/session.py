"""The loader's checkpoint session: this rank's state, the state at a kept step boundary, the state merged over ranks, and a restore."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

from loader.checkpoint import migrations as checkpoint_migrations, schema as checkpoint_schema, state as state_mod
from loader.io.lane_reader import TRANSFORMS_CHANGED
from loader.order.data_parallel import initialized_distributed
from loader.order.mixing import MixingSchedule, MixturePhase
from loader.stages.producer import build_lanes
from loader.transforms import resume as transform_resume

# The loader's one logger, whichever of its modules logs (what users filter on).
log = logging.getLogger("loader.pipeline")


class CheckpointSession:
    """A base of :class:`~loader.pipeline.ZephonLoader`: its checkpoints.

    States are JSON (:mod:`loader.checkpoint.state`), checked field by field by
    :mod:`loader.checkpoint.schema` before anything changes. Works on the loader's ``config``,
    ``topology``, ``manifests``, ``source_names``, ``spec``, ``phases``, ``rank_lanes``,
    ``rank_position``, ``lane_states``, ``_step_states``, ``_run`` and ``model_inputs``.
    """

    # The tokenizer's vocabulary size, a token id's bound in a checked state: from a
    # pre-tokenized manifest, else parsed from the tokenizer on the first restore (_state_limits).
    vocab_size: Optional[int] = None

    @property
    def step(self) -> int:
        """The global step of the next micro-batch."""
        return self.rank_position // self.topology.per_rank_batch

    @property
    def next_global_index(self) -> int:
        return self.topology.rank + self.rank_position * self.topology.world_size

    def _expected_header(self) -> dict[str, Any]:
        return {
            "format": state_mod.STATE_FORMAT,
            "version": state_mod.STATE_VERSION,
            "num_lanes": self.num_lanes,
            "config": self.config.stream_fields(),
            "config_fingerprint": self.config.fingerprint(),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "sources": [
                {"name": n, "dataset_fingerprint": m.dataset_fingerprint or m.compute_fingerprint(),
                 "exhaustion": d.exhaustion, "max_epochs": d.max_epochs}
                for n, m, d in zip(self.source_names, self.manifests, self.config.datasets)
            ],
            "schedule": [p.to_dict(self.source_names) for p in self.phases],
            **self._transforms_header(),
        }

    def _transforms_header(self) -> dict[str, Any]:
        entry = transform_resume.header_entry(self.source_names, self.source_transforms, self._transform_changes)
        return {} if entry is None else {"transforms": entry}

    def state_dict(self, step: Optional[int] = None) -> dict[str, Any]:
        """Rank-local state (this rank's lanes), JSON-serialisable.

        Without ``step``: exactly what was handed out so far, mid-step included. With
        ``step=t``: the state at the boundary before step ``t`` (steps ``0..t-1`` consumed,
        nothing of step ``t``), as a trainer whose framework fetched ahead needs it; the
        newest ``step_states_kept`` boundaries handed out are kept, an older or future
        step is a :class:`~loader.checkpoint.state.StateError`.
        """
        if step is None:
            if self.model_inputs is not None and self.rank_position % self.topology.per_rank_batch:
                raise state_mod.StateError(
                    f"state_dict() mid-step ({self.rank_position % self.topology.per_rank_batch} of "
                    f"{self.topology.per_rank_batch} sequences of step {self.step} handed out): with model_inputs = "
                    f"{self.config.model_inputs!r} a micro-batch carries the loss tokens of its whole step, so "
                    "states are taken at step boundaries; pass step= the number of optimizer steps trained")
            lane_states, position = self._current_lane_states(), self.rank_position
        else:
            lane_states, position = self._boundary_lane_states(step), step * self.topology.per_rank_batch
        fresh = [l for l in self.rank_lanes if l not in lane_states]
        if fresh:  # lanes not reached yet: their state is the fresh lane's
            for lane_id, lane in build_lanes(self.spec, fresh, {}).items():
                lane_states[lane_id] = lane.get_state()
                if step is None:
                    self.lane_states[lane_id] = lane_states[lane_id]
        state = self._expected_header()
        state.update(
            rank=self.topology.rank,
            world_size=self.topology.world_size,
            rank_position=position,
            next_global_index=self.topology.rank + position * self.topology.world_size,
            lanes={state_mod.lane_key(l): lane_states[l] for l in self.rank_lanes},
        )
        return state_mod.to_jsonable(state)

    def _current_lane_states(self) -> dict[int, dict]:
        if self._run is not None and self._run.reads_lanes_directly:
            for lane_id, lane in self._run.in_process_lanes.items():
                self.lane_states[lane_id] = lane.get_state()
        return dict(self.lane_states)

    def _boundary_lane_states(self, step: int) -> dict[int, dict]:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise state_mod.StateError(f"state_dict(step=...) takes a step number >= 0 (got step={step!r})")
        kept = self._step_states.get(step)
        if kept is not None:
            return dict(kept)
        at_boundary = self.rank_position % self.topology.per_rank_batch == 0
        if step == self.step and at_boundary:
            return self._current_lane_states()
        steps = self._step_states.steps()
        raise state_mod.StateError(
            f"no state is kept for the boundary before step {step}: this rank has handed out "
            f"{self.rank_position} sequences (step {self.step}"
            f"{'' if at_boundary else ', mid-step'}) and keeps the boundaries of steps {steps}. "
            + ("A state can only be taken for a step already reached. " if step > self.step else
               "Take the state right after the optimizer step (or raise step_states_kept, "
               f"now {self.config.step_states_kept}). ")
        )

    def global_state_dict(self, step: Optional[int] = None, group: Any = None) -> dict[str, Any]:
        """The global (topology-free) state at step boundary ``step``, merged over all ranks.

        A collective: every data-parallel rank (and every tensor/pipeline peer) calls it with
        the same ``step``; each gets the same merged state, which any rank of any world size
        can load. ``step=None`` means the current step, which must be at a boundary.
        ``group``: the process group of the data-parallel ranks (default: the device mesh's
        data-parallel group, else the default group; peers that share a data-parallel rank
        contribute identical states, which are merged once).
        """
        if step is None:
            if self.rank_position % self.topology.per_rank_batch:
                raise state_mod.StateError(
                    f"global_state_dict() called mid-step ({self.rank_position % self.topology.per_rank_batch} "
                    f"of {self.topology.per_rank_batch} sequences of step {self.step} handed out); pass "
                    "step= the number of optimizer steps trained, or call it after a whole optimizer step"
                )
            step = self.step
        local = self.state_dict(step=step)
        if self.topology.world_size == 1:
            return state_mod.merge_rank_states([local])
        dist = initialized_distributed()
        if dist is None:
            raise state_mod.StateError(
                f"global_state_dict() with world_size={self.topology.world_size} gathers the ranks' states "
                "through torch.distributed, which is not initialised; gather state_dict(step=t) of every "
                "rank yourself and merge them with loader.checkpoint.state.merge_rank_states()"
            )
        group = self.dp_group if group is None else group
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, state_mod.dumps(local), group=group)
        return state_mod.merge_rank_states([state_mod.loads(text) for text in gathered])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a rank-local state of this very rank, or a global (merged) state of any topology.

        Every field is checked first (:meth:`_checked_lane_states`); a bad state changes nothing.
        """
        started = time.perf_counter()
        state = checkpoint_migrations.upgrade(state)  # an older version's state, read as the current one
        position, next_index, lanes = self._checked_lane_states(state)
        if self.model_inputs is not None and position % self.topology.per_rank_batch:
            raise state_mod.StateError(
                f"the state is mid-step ({position % self.topology.per_rank_batch} of {self.topology.per_rank_batch} "
                f"sequences of step {position // self.topology.per_rank_batch} handed out on this rank): with "
                f"model_inputs = {self.config.model_inputs!r} every micro-batch carries the loss tokens of its whole "
                "step, which include the micro-batches already trained; resume from a step boundary "
                "(state_dict(step=t) or global_state_dict(step=t))")
        if self._global_counter is not None or (self.model_inputs is not None and self.topology.world_size > 1):
            self._peer_counter().load_state(state)
        self._adopt_schedule(state["schedule"], next_index // self.config.global_batch_size)
        self._end_run()
        self.lane_states = lanes
        self.rank_position = position
        at_boundary = position % self.topology.per_rank_batch == 0
        self._step_states.reset(position // self.topology.per_rank_batch if at_boundary else None, lanes)
        self._lanes_in_step = set()
        if self._balancer is not None:
            self._balancer.restored(state)
        self._metrics.restored(time.perf_counter() - started)

    def _checked_lane_states(self, state: Any) -> tuple[int, int, dict[int, dict]]:
        """``(rank position, next global index, this rank's lane states)`` of a state whose every
        field passed :mod:`loader.checkpoint.schema`: shape, then the stream settings against
        ours, then ranges against our datasets; a :class:`~loader.checkpoint.state.StateError` names the
        JSON path of each bad field."""
        header = checkpoint_schema.parse_header(state)
        expected = self._expected_header()
        change = transform_resume.accepted_change(
            state, expected, from_step=self.config.transforms_from_step,
            resume_step=header.next_global_index // self.config.global_batch_size,
            token_mixing=self.config.mixing_unit == "token" and len(self.manifests) > 1)
        # A finite checkpoint that ends as "drop" (made before epoch_tail existed) continues the
        # "fill" stream, which it is a prefix of (loader.checkpoint.state.compare_with).
        drop_tail = self.config.replace(epoch_tail="drop").fingerprint() if self.config.fills_tails else None
        state_mod.compare_with(state, expected, allow_transform_change=change is not None,
                               drop_tail_fingerprint=drop_tail)
        if drop_tail is not None and state_mod.tail_migrates(state["config"], expected["config"]):
            log.info("the checkpoint ends finite data at the first exhausted lane (epoch_tail \"drop\", or made "
                     "before the option); it continues with epoch_tail \"fill\", whose stream it is a prefix of: "
                     "every document of the epoch is delivered (set epoch_tail = \"drop\" to end as it would have)")
        if header.rank_local:
            if (header.rank, header.world_size) != (self.topology.rank, self.topology.world_size):
                raise state_mod.StateError(
                    f"rank, world_size: this is rank {header.rank} of {header.world_size}'s own state; to resume on rank "
                    f"{self.topology.rank} of {self.topology.world_size}, merge all ranks' states with "
                    "loader.checkpoint.state.merge_rank_states() (or use torch.distributed.checkpoint) and load that"
                )
            position = header.rank_position
            next_index = self.topology.rank + position * self.topology.world_size
        else:
            next_index = header.next_global_index
            if next_index % self.config.global_batch_size:
                raise state_mod.StateError(
                    f"next_global_index: global state at index {next_index} is not at a step boundary "
                    f"(global_batch_size={self.config.global_batch_size})"
                )
            position = next_index // self.topology.world_size
        parsed = checkpoint_schema.parse_lanes(state["lanes"], header)
        problems = checkpoint_schema.Problems()
        for lane_id in self.rank_lanes:
            if lane_id not in parsed:
                problems.at(f"lanes.{state_mod.lane_key(lane_id)}",
                             f"missing: the state has no entry for lane {lane_id}, which this rank owns")
        checkpoint_schema.check_lanes(header, parsed, self._state_limits(), next_index, problems)
        problems.raise_if_any()
        # Bins arrive as the arrays parsed while checking them: converted once.
        lanes = {l: checkpoint_schema.stage_state(state["lanes"][state_mod.lane_key(l)], parsed[l])
                 for l in self.rank_lanes}
        self._transform_changes = list((state.get("transforms") or {}).get("changes", []))
        if change is not None:  # declared with transforms_from_step: recorded, cursors re-placed

            log.info("transforms change at resume step %d for sources %s", change["step"], change["sources"])
            self._transform_changes.append(change)
            lanes = {l: transform_resume.marked_lane_state(lane, change["sources"], TRANSFORMS_CHANGED)
                     for l, lane in lanes.items()}
        return position, next_index, lanes

    def _state_limits(self) -> "checkpoint_schema.StateLimits":
        """What a checkpoint's ranges are checked against: our config and manifests (no data read)."""
        vocab_size = self.vocab_size
        for manifest in self.manifests:
            if vocab_size is None and manifest.pretokenized and manifest.tokenizer:
                vocab_size = manifest.tokenizer.get("vocab_size")
        if vocab_size is None and self.config.packing == "best_fit" and self.spec.tokenizer_json is not None:
            from tokenizers import Tokenizer  # text sources only: parsed once per loader

            self.vocab_size = vocab_size = Tokenizer.from_str(self.spec.tokenizer_json).get_vocab_size()
        sources = []
        for source, manifest in zip(self.spec.sources, self.manifests):
            blocks: dict[int, int] = {}
            rows: dict[int, int] = {}
            unknown: set[int] = set()
            for entry in manifest.files:
                if entry.rows <= 0:
                    continue
                rows[entry.lane] = rows.get(entry.lane, 0) + entry.rows
                blocks[entry.lane] = blocks.get(entry.lane, 0) + entry.row_groups
                if entry.row_groups <= 0:  # older manifests: the stream checks the block when it reads
                    unknown.add(entry.lane)
            sources.append(checkpoint_schema.SourceLimits(
                name=source.name, exhaustion=source.exhaustion,
                max_epochs=1 if source.exhaustion == "stop" else source.max_epochs,
                blocks={l: n for l, n in blocks.items() if l not in unknown}, rows=rows,
            ))
        return checkpoint_schema.StateLimits(
            num_lanes=self.num_lanes, global_batch_size=self.config.global_batch_size, seq_len=self.config.seq_len,
            packing=self.config.packing, open_bins=self.config.best_fit_open_bins,
            wrap_tokens=self.spec.token_format.extra, vocab_size=vocab_size, sources=tuple(sources),
        )

    def _adopt_schedule(self, saved: list[dict], resume_step: int) -> None:
        """Keep the recorded history before the resume step; the config's schedule applies after."""
        history = [MixturePhase.from_dict(p, self.source_names) for p in saved]
        kept = [p for p in history if p.start_step < resume_step]
        ours = self.phases
        active_now = ours[0]
        for phase in ours:
            if phase.start_step <= resume_step:
                active_now = phase
        later = [p for p in ours if p.start_step > resume_step]
        phases = kept
        if not phases or phases[-1].weights != active_now.weights:
            phases = phases + [MixturePhase(resume_step, active_now.weights)]
        phases = phases + later
        if phases != self.phases:
            if [p for p in history if p.start_step >= resume_step] != [p for p in ours if p.start_step >= resume_step]:
                log.info("mixture schedule changes at resume step %d: %s", resume_step,
                         [p.to_dict(self.source_names) for p in phases])
            self.phases = phases
            self.spec = dataclasses.replace(self.spec, schedule=MixingSchedule(phases, self.config.global_batch_size, self.config.seed))
