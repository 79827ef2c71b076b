"""``ZephonLoader``: one rank's micro-batches of the deterministic global stream.

Guarantee: for a given config and datasets, the global batch at step ``t`` (the union over
ranks of their micro-batches of step ``t``, ordered by global index) is bit-identical for
every world size, worker count, micro-batch size, prefetch depth and resume point.

Lifecycle::

    loader = ZephonLoader(config, dp_rank=r, dp_world_size=W)  # data-parallel rank/size (see below)
    loader.load_state_dict(state)                          # optional, before iterating
    for batch in loader: ...                               # micro-batches, forever (repeat)
    state = loader.state_dict()                            # exactly what was consumed
    state = loader.state_dict(step=t)                      # as of step boundary t (frameworks fetch ahead)
    state = loader.global_state_dict(step=t)               # merged over ranks: any world size resumes
    loader.close()                                         # also on GC, exit and Ctrl-C

Worker processes (``num_workers > 0``) each own ``rank_lanes[w::K]`` and run ahead by up to
``prefetch`` messages; the main process merges their items by global index and records each
lane's state as the item is *handed to the trainer*, so a checkpoint never includes
prefetched work.

``rank`` / ``world_size`` (alias ``dp_rank`` / ``dp_world_size``, or a ``DeviceMesh`` and its
data-parallel dimension) are the *data-parallel* rank and size: tensor- and
pipeline-parallel peers of one data-parallel rank pass the same ``dp_rank`` and get the
same micro-batches. Without any of them ``RANK`` / ``WORLD_SIZE`` are used, which is only
right for pure data parallelism (:mod:`loader.order.data_parallel`).
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from typing import Any, Optional

import numpy as np
import torch

from loader.balanced import make_balancer
from loader.chat.block import chat_overflows, check_chat_sources
from loader.checkpoint import migrations as checkpoint_migrations, schema as checkpoint_schema, state as state_mod
from loader.checkpoint.step_states import StepStateHistory
from loader.config import LoaderConfig
from loader.errors import ConfigError, ManifestError, WorkerError
from loader.io.blocks import TokenFormat
from loader.io.lane_reader import TRANSFORMS_CHANGED
from loader.io.manifest import Manifest, read_manifest
from loader.metrics import LoaderMetrics, MetricsRecorder
from loader.model_inputs import build_layout
from loader.model_inputs.loss_tokens import GlobalCounter, data_parallel_share, sum_over_ranks
from loader.order.data_parallel import resolve_data_parallel
from loader.order.mixing import MixingSchedule, MixturePhase, exact_weights
from loader.order.ordering import Topology, lanes_of_worker
from loader.stages.collate import OUTPUTS, Collator, to_torch
from loader.stages.features import FEATURES
from loader.stages.lane import LaneSpec, SourceSpec
from loader.stages.pinned import PinnedBuffers, pinning_available, warn_pinning_unavailable
from loader.stages.producer import FILL_SOURCE, End, Item, build_lanes, fill_item, fill_sequence, produce_one, start_reading
from loader.stages.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    load_tokenizer,
    resolve_special_token,
    tokenizer_fingerprint,
)
from loader.transforms import resume as transform_resume
from loader.transforms.chain import TransformChain
from loader.transforms.spec import TransformSpec
from loader.transforms.conversations import ChatTransforms
from loader.vision.block import ONLINE_IMAGE_REJECT_REASONS
from loader.vision.loader_options import resolve_image_options
from loader.vision.transfer import image_slot_bytes
from loader.workers.messages import items_per_message
from loader.workers.pool import WorkerPool

log = logging.getLogger(__name__)


class ZephonLoader:
    """An iterator of micro-batches (dicts of torch tensors) for one rank.

    ``ZephonLoader(config, dp_rank=r, dp_world_size=W)`` serves data-parallel rank ``r`` of
    ``W``; tensor- and pipeline-parallel peers of one data-parallel rank pass the same
    ``dp_rank`` (or ``device_mesh=mesh, dp_mesh_dim="dp"``). Left out, the rank and world size
    come from ``RANK`` / ``WORLD_SIZE`` (right for pure data parallelism only). ``rank`` /
    ``world_size`` are the same as ``dp_rank`` / ``dp_world_size``. ``output="numpy"`` hands
    out NumPy arrays instead of torch tensors; ``pin_memory=True`` assembles the batches in
    pinned host memory. Neither changes a batch.

    Each global step is ``micro_steps_per_step`` micro-batches per rank (``self.topology``).
    Checkpoints: :meth:`state_dict` (this rank), :meth:`global_state_dict` (merged over all
    ranks: a collective, call it on every rank) and :meth:`load_state_dict` (a global state
    loads on any topology). :meth:`close` (or leaving a ``with`` block) ends the worker
    processes.
    """

    def __init__(
        self,
        config: LoaderConfig,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        dp_rank: Optional[int] = None,
        dp_world_size: Optional[int] = None,
        device_mesh: Any = None,
        dp_mesh_dim: Optional[str] = None,
        output: str = "torch",
        pin_memory: bool = False,
    ) -> None:
        if output not in OUTPUTS:
            raise ConfigError(f"ZephonLoader(output={output!r}): must be one of {list(OUTPUTS)} (\"torch\": "
                              "dicts of torch tensors; \"numpy\": dicts of NumPy arrays, e.g. for JAX)")
        if pin_memory and output != "torch":
            raise ConfigError(f"ZephonLoader(pin_memory=True, output={output!r}): pinned memory is for torch "
                              "tensors bound for an accelerator; pass output=\"torch\" or pin_memory=False")
        self.output = output
        # Micro-batches assembled in pinned memory (loader.stages.pinned); without an
        # accelerator there is none: a no-op with one warning, as torch's DataLoader does.
        self._pinned: Optional[PinnedBuffers] = None
        if pin_memory:
            if pinning_available():
                self._pinned = PinnedBuffers()
            else:
                warn_pinning_unavailable()
        self.config = config
        identity = resolve_data_parallel(rank=rank, world_size=world_size, dp_rank=dp_rank,
                                         dp_world_size=dp_world_size, device_mesh=device_mesh,
                                         dp_mesh_dim=dp_mesh_dim)
        rank, world_size = identity.rank, identity.world_size
        self.dp_group = identity.group  # the DP process group of a DeviceMesh (None: the default group)
        storage_options = config.storage_options()
        self.manifests: list[Manifest] = [read_manifest(d.path, storage_options) for d in config.datasets]
        self.source_names = [d.name or m.source_name for d, m in zip(config.datasets, self.manifests)]
        if len(set(self.source_names)) != len(self.source_names):
            raise ManifestError(
                f"datasets have duplicate source names {self.source_names}; give each a distinct 'name'"
            )
        lane_counts = {n: m.num_lanes for n, m in zip(self.source_names, self.manifests)}
        if len(set(lane_counts.values())) != 1:
            raise ManifestError(
                f"all datasets of a mix must have the same lane count L (got {lane_counts}); re-shard "
                "the odd ones with `zephon shard ... --num-lanes N` using one N for every source"
            )
        self.num_lanes = next(iter(lane_counts.values()))
        self.topology = Topology(
            num_lanes=self.num_lanes, global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size, world_size=world_size, rank=rank,
        )
        tokenizer = load_tokenizer(config.tokenizer, storage_options)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        for name, manifest in zip(self.source_names, self.manifests):
            if manifest.pretokenized and manifest.tokenizer.get("fingerprint") != self.tokenizer_fingerprint:
                raise ManifestError(
                    f"dataset {name!r} was pre-tokenized with a different tokenizer (fingerprint "
                    f"{manifest.tokenizer.get('fingerprint', '?')[:12]}...) than config 'tokenizer' "
                    f"{config.tokenizer} ({self.tokenizer_fingerprint[:12]}...); use the same tokenizer "
                    "or re-shard without --tokenizer"
                )
        eos_id = resolve_special_token(tokenizer, config.eos_token, EOS_CANDIDATES, "eos_token")
        bos_id = (
            resolve_special_token(tokenizer, config.bos_token, BOS_CANDIDATES, "bos_token") if config.add_bos else None
        )
        pad_id = eos_id if config.pad_token is None else resolve_special_token(tokenizer, config.pad_token, (), "pad_token")
        self.phases = self._initial_phases()
        needs_text = any(not m.pretokenized for m in self.manifests)
        # Per-token features of this loader's sequences (loader.stages.features): a column feature
        # when any pre-tokenized source's lane files hold its column, token_sources under
        # token mixing. Every sequence, and so every micro-batch, holds all of them.
        columns = {c.get("name") for m in self.manifests if m.pretokenized for c in m.schema}
        if any(m.online_chat for m in self.manifests):
            columns.add("loss_mask")  # made online by the chat blocks (loader.chat.block)
        # Image sources (loader.vision): placeholders, loss_mask 0 on them, image_ref per image.
        image_options = resolve_image_options(config, self.manifests, self.source_names, tokenizer)
        if image_options is not None:
            columns.add("loss_mask")
        token_mixing = config.mixing_unit == "token" and len(self.manifests) > 1
        self.features = tuple(name for name, f in FEATURES.items()
                              if (f.column is not None and f.column in columns)
                              or (name == "token_sources" and token_mixing)
                              or (name == "image_ref" and image_options is not None))
        self.image_options = image_options
        token_format = TokenFormat(bos_id=bos_id, eos_id=eos_id if config.add_eos else None)
        chat_reject_reasons = check_chat_sources(self.manifests, self.source_names, tokenizer, seq_len=config.seq_len,
                                                 packing=config.packing, wrap_tokens=token_format.extra,
                                                 overlong=config.overlong)
        self._wrap_tokens = token_format.extra
        # Transforms (loader.transforms): imported and checked here, not first in a worker.
        self.source_transforms = self._resolved_transforms()
        self._transform_changes: list[dict] = []  # changes on resume, as the checkpoint records them
        self.spec = LaneSpec(
            sources=tuple(
                SourceSpec(name, d.path, m.to_json(), d.exhaustion, d.max_epochs, transforms)
                for name, d, m, transforms in zip(self.source_names, config.datasets, self.manifests,
                                                  self.source_transforms)
            ),
            seed=config.seed,
            seq_len=config.seq_len,
            packing=config.packing,
            best_fit_open_bins=config.best_fit_open_bins,
            token_format=token_format,
            pad_id=pad_id,
            tokenizer_json=tokenizer.to_str() if needs_text else None,
            storage_options=storage_options,
            schedule=MixingSchedule(self.phases, config.global_batch_size, config.seed),
            global_batch_size=config.global_batch_size,
            mixing_unit=config.mixing_unit,
            read_ahead=config.read_ahead,
            read_ahead_threads=config.read_ahead_threads,
            features=self.features,
            images=image_options,
            packing_window=config.packing_window,
            fill_tails=config.fills_tails,
            overlong=config.overlong,
        )
        self.rank_lanes = self.topology.rank_lanes()
        self.rank_position = 0  # sequences of this rank handed to the trainer so far
        # With finite data a rank must not start a step that another rank cannot finish, so
        # each step is produced whole before its first micro-batch is handed out.
        self.finite = config.finite
        # epoch_tail "fill": lanes that ran out give fill rows until the last lane is done
        # (docs/guides/finite-epochs.md); the ranks agree that a step is delivered when any of
        # them still has a real row ahead (step_available), not when all can finish it.
        self.fills = config.fills_tails
        self.fill_row = fill_sequence(config.seq_len, pad_id, self.features) if self.fills else None
        # model_inputs (loader.model_inputs): micro-batches laid out for a model family, each with
        # the loss tokens of its whole step, so the step is produced (and counted) ahead as well.
        self.model_inputs = build_layout(config.model_inputs, seq_len=config.seq_len, image_options=image_options)
        self.looks_ahead = self.finite or self.model_inputs is not None
        self._step_loss_tokens = 0
        self._global_counter: Optional[GlobalCounter] = None
        self._step_items: Optional[collections.deque] = None
        self._step_complete = True
        self._ahead: collections.deque = collections.deque()  # items past the current step (fills: look-ahead)
        self._rows_ahead: Optional[bool] = None  # fills: this rank's step_available() answer for the step
        self._agreed_step: Optional[int] = None  # the step the ranks agreed to deliver (ranks_have_step)
        self._end_group = None
        self.lane_states: dict[int, dict] = {}
        self._step_states = StepStateHistory(config.step_states_kept)
        self._step_states.reset(0, {})
        self._lanes_in_step: set[int] = set()  # lanes that produced since the last step boundary
        self._collator = Collator(
            seq_len=config.seq_len, global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size, per_rank_batch=self.topology.per_rank_batch,
            batch_fields=config.batch_fields, features=self.features, chat_reject_reasons=chat_reject_reasons,
            empty=np.empty if self._pinned is None else self._pinned.empty,
            image_policy=image_options.policy if image_options is not None else None,
            image_reject_reasons=ONLINE_IMAGE_REJECT_REASONS if image_options is not None else (),
            fill_rows=self.fills,
        )
        self._metrics = MetricsRecorder(
            source_names=self.source_names, seq_len=config.seq_len, per_rank_batch=self.topology.per_rank_batch,
            supervised="loss_mask" in self.features, token_mixing=token_mixing,
            batched_token_sources="token_source_ids" in config.batch_fields,
            log_every_steps=config.metrics_log_every_steps,
            dataset_rejected={n: dict(m.rejected) for n, m in zip(self.source_names, self.manifests)},
            fill_rows=self.fills,
        )
        self._run: Optional[_Run] = None
        self._pool: Optional[WorkerPool] = None
        self._finalizer = None
        if config.num_workers > 0:
            # Started now, so that the workers import and map their memory while the trainer
            # builds its model; they serve every run (and restore) of this loader.
            self._start_pool()
        # balance = "attention" (loader.balanced): micro-batches chosen from the whole step by cost.
        self._balancer = make_balancer(self)

    def _resolved_transforms(self) -> list[tuple]:
        resolved = []
        for k, (name, manifest) in enumerate(zip(self.source_names, self.manifests)):
            online_chat = manifest.online_chat  # "any" functions take the tokens stage there (after the render)
            specs = tuple(spec.resolved(manifest.pretokenized or online_chat)
                          for spec in self.config.source_transforms(k) + self._overlong_transforms(manifest))
            if specs and online_chat:
                ChatTransforms(specs, seed=self.config.seed, source=name)  # imports each function, checks its stage
            elif specs:
                feature_names = [f for f in self.features if FEATURES[f].column in
                                 {c.get("name") for c in manifest.schema}]
                TransformChain(specs, seed=self.config.seed, source=name, pretokenized=manifest.pretokenized,
                               feature_names=feature_names)  # imports each function, checks its stage
            resolved.append(specs)
        return resolved

    def _overlong_transforms(self, manifest) -> tuple[TransformSpec, ...]:
        """``overlong`` "drop" / "truncate": the transform that makes every conversation of a chat
        source fit one best_fit sequence, after the configured ones (its drops are counted like
        theirs), where the recorded longest may not fit. Offline and online alike: an online
        source is then encoded with the job's bound only (loader.chat.block.effective_max_tokens)."""
        if self.config.overlong == "refuse" or not chat_overflows(
                manifest, seq_len=self.config.seq_len, packing=self.config.packing, wrap_tokens=self._wrap_tokens):
            return ()
        fit = self.config.seq_len - self._wrap_tokens
        if self.config.overlong == "drop":
            return (TransformSpec("length_tokens", {"max": fit}),)
        return (TransformSpec("truncate_turns", {"max_tokens": fit}),)

    def transform_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """What the transforms did in this rank's lanes, as of the batches handed out:
        ``{source: {"position:function": {"dropped": n, "changed": n}}}`` (documents of the row
        groups each lane has taken from; the global figure is the sum over ranks, or this of
        a merged state: :func:`loader.transforms.resume.counts_report`)."""
        states = transform_resume.as_plain(self._current_lane_states())
        return transform_resume.counts_report(self.source_names, self.source_transforms, list(states.values()),
                                              [m.tombstone_transforms if m.has_tombstones else () for m in self.manifests])

    # -- schedule ------------------------------------------------------------------------
    def _initial_phases(self) -> list[MixturePhase]:
        base = MixturePhase(0, exact_weights([d.weight for d in self.config.datasets]))
        phases = [base]
        for entry in self.config.schedule:
            unknown = sorted(set(entry.weights) - set(self.source_names))
            missing = [n for n in self.source_names if n not in entry.weights]
            if unknown or missing:
                raise ManifestError(
                    f"schedule entry at step {entry.step}: weights must name every source exactly "
                    f"(sources: {self.source_names}; unknown {unknown}, missing {missing})"
                )
            weights = exact_weights([entry.weights[n] for n in self.source_names])
            if entry.step == 0:
                phases[0] = MixturePhase(0, weights)
            else:
                phases.append(MixturePhase(entry.step, weights))
        return phases

    # -- state ---------------------------------------------------------------------------
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
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
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

    def metrics(self) -> LoaderMetrics:
        """Counters since the loader was built and for the last whole step (:mod:`loader.metrics`)."""
        metrics = self._metrics.metrics(self.step)
        if self._balancer is not None:
            metrics.balance = self._balancer.stats()
        return metrics

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
        state_mod.compare_with(state, expected, allow_transform_change=change is not None)
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
                problems.add(f"lanes.{state_mod.lane_key(lane_id)}",
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
        vocab_size = getattr(self, "vocab_size", None)
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
            from dataclasses import replace

            self.spec = replace(self.spec, schedule=MixingSchedule(phases, self.config.global_batch_size, self.config.seed))

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> "ZephonLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._balancer is not None:
            return self._balancer.next_batch()
        started = time.perf_counter()  # the trainer's wait (loader.metrics)
        items = self._next_items()
        batch = self._collate(items)
        self._metrics.count(items, batch, time.perf_counter() - started, self.rank_position)
        return self._handed_out(batch)

    def _next_items(self) -> list[Item]:
        """The rank's next micro-batch of items in global index order, their lane states recorded
        (what ``__next__`` collates; a balancer takes a step of them at once)."""
        self._start_run()
        if self.looks_ahead:
            at_boundary = self.rank_position % self.topology.per_rank_batch == 0
            if at_boundary and not self._all_ranks_have_step():
                raise StopIteration
            self._produce_step()  # resumed mid-step: the rest of that step
            if not self.fills and not self._step_complete:  # resumed mid-step past the end of the data
                raise StopIteration
            items = [self._step_items.popleft() for _ in range(self.config.micro_batch_size)]
            self.rank_position += len(items)
            if not self._step_items:
                self._step_items = None
        else:
            items = []
            global_index, stride = self.next_global_index, self.topology.world_size
            for _ in range(self.config.micro_batch_size):
                items.append(self._run.next_item(global_index))
                self.rank_position += 1  # per item: a failing lane leaves the position at it
                global_index += stride
        lane_ids = [item.global_index % self.num_lanes for item in items]
        self._lanes_in_step.update(lane_ids)
        for lane_id, item in zip(lane_ids, items):
            if item.lane_state is not None:
                self.lane_states[lane_id] = item.lane_state
        if self.rank_position % self.topology.per_rank_batch == 0:
            self._record_step_boundary()
        if self._metrics.copies_token_sources:  # not batched: copied before collation frees worker slots
            self._metrics.keep_token_sources(items)
        return items

    def _record_step_boundary(self) -> None:
        """The last micro-batch of a step is being handed out: keep the lanes' states as of now."""
        if self._step_states.capacity == 0:
            return
        if self._run.reads_lanes_directly:
            lanes = self._run.in_process_lanes
            changed = {l: lanes[l].step_snapshot() for l in self._lanes_in_step}
        else:
            changed = {l: self.lane_states[l] for l in self._lanes_in_step}
        self._step_states.record(self.step, changed)
        self._lanes_in_step = set()

    def step_available(self) -> bool:
        """This rank's answer to "is the next step delivered?" (call at a step boundary).

        Always true for endless data (every source ``repeat`` without ``max_epochs``). With
        finite data the step is produced ahead. ``epoch_tail = "drop"``: whether this rank can
        deliver the whole step; the step is delivered when every rank can. ``"fill"``: whether
        this rank has a real (not fill) row among the ``L`` global indices from the step's
        start, looking ahead past the step where its own rows are all fill; the step is
        delivered when any rank has (every lane shows up in ``L`` consecutive indices, so
        none does only once every lane is done). Ranks simulated in one process (as
        ``zephon fingerprints`` does) combine their answers with :func:`ranks_have_step`.
        """
        if not self.looks_ahead:
            return True
        self._produce_step()
        if not self.fills:
            return self._step_complete
        if self._rows_ahead is None:
            self._rows_ahead = self._real_row_ahead()
        return self._rows_ahead

    def _produce_step(self) -> None:
        """The rest of the current step, produced ahead (finite data)."""
        if self._step_items is not None:
            return
        self._start_run()
        items: collections.deque = collections.deque()
        position = self.rank_position
        self._step_complete = True
        try:
            for _ in range(self.topology.per_rank_batch - position % self.topology.per_rank_batch):
                # Looked-ahead items first (filled tails), then the run's.
                items.append(self._ahead.popleft() if self._ahead else
                             self._run.next_item(self.topology.rank + position * self.topology.world_size))
                position += 1
        except StopIteration:
            self._step_complete = False
        self._step_items = items
        self._rows_ahead = None

    def _real_row_ahead(self) -> bool:
        """Filled tails: whether this rank has a real row at a global index in ``[tB, tB + L)``
        (step ``t``): its rows of the step, then its next ones up to that bound, which stay
        looked ahead (``_ahead``; fill rows hold no worker slot, and the look-ahead stops at the
        first real row, so the slots held stay within one step's)."""
        if any(item.source_id != FILL_SOURCE for item in self._step_items) or \
                any(item.source_id != FILL_SOURCE for item in self._ahead):
            return True
        rank, world_size = self.topology.rank, self.topology.world_size
        end = self.step * self.config.global_batch_size + self.num_lanes
        position = self.rank_position + len(self._step_items) + len(self._ahead)
        while rank + position * world_size < end:
            item = self._run.next_item(rank + position * world_size)
            self._ahead.append(item)
            position += 1
            if item.source_id != FILL_SOURCE:
                return True
        return False

    def _all_ranks_have_step(self) -> bool:
        """This rank's answer, agreed with every rank through torch.distributed when it runs (all
        must have the step to deliver it; with filled tails, any); with ``model_inputs``, also the
        step's loss tokens over all ranks (loader.model_inputs.loss_tokens)."""
        agreed = self._agreed_step == self.step  # agreed already (ranks_have_step)
        counts = self.model_inputs is not None
        if agreed and not counts:
            return True
        available = agreed or self.step_available()
        loss_tokens = self._collator.loss_tokens(self._step_items) if counts and available else 0
        import torch.distributed as dist

        if self.topology.world_size > 1 and dist.is_available() and dist.is_initialized():
            if self._end_group is None:  # gloo: CPU ints work whatever the training backend
                self._end_group = dist.new_group(backend="gloo")
            # One collective for both: ranks that cannot finish the step, and the loss tokens.
            missing, loss_tokens = sum_over_ranks([0 if available else 1, loss_tokens], self._end_group)
            available = missing < dist.get_world_size(self._end_group) if self.fills else missing == 0
            if counts:
                loss_tokens = data_parallel_share(loss_tokens, dist.get_world_size(), self.topology.world_size)
        elif self.topology.world_size > 1 and counts and available:
            loss_tokens = self._peer_counter().count_next_step()
            available = loss_tokens is not None
        if counts and available and loss_tokens == 0:
            # HF losses would be 0 / 0 = NaN and poison the weights; 1 gives the step a zero loss.
            log.warning("step %d has no loss tokens on any rank (every label is -100): num_items_in_batch = 1, "
                        "so its loss is 0 instead of NaN", self.step)
            loss_tokens = 1
        self._step_loss_tokens = loss_tokens
        if available:
            self._agreed_step = self.step
        return available

    def _peer_counter(self) -> GlobalCounter:
        """Counts every rank's loss tokens in this process (ranks simulated without a process group)."""
        if self._global_counter is None:
            config = self.config.replace(model_inputs=None, num_workers=0, micro_batch_size=self.config.global_batch_size,
                                         batch_fields=("input_ids", "labels"), metrics_log_every_steps=0)
            self._global_counter = GlobalCounter(lambda: ZephonLoader(config, rank=0, world_size=1, output="numpy"),
                                                 world_size=self.topology.world_size)
        return self._global_counter

    def _start_run(self) -> None:
        """The run that produces the next items: workers, or in-process lanes.

        Warm start: until every worker has started (imports take a few hundred
        milliseconds), the trainer's process produces the items itself, then hands the
        lanes' states to the workers at an item boundary (a step boundary when steps are
        looked ahead). The stream is the same either way; the first batch does not wait.
        Nor does the hand-over: the workers start from the states handed over while the
        trainer's lanes go on producing, until every worker has caught up (``_Run.lead``).
        Except where the sources tokenize online: there the trainer's lanes would take the
        cores the workers tokenize on, so that they caught up only after seconds (text, 2
        workers, busy trainer: 4.5 s at a third of the rate, against one wait of ~0.3 s at
        the hand-over; bench/RESULTS.md, issue 16), and the workers take over at once.
        """
        if self._run is None:
            if self.config.num_workers > 0 and (self._pool is None or not self._pool.healthy()):
                self._stop_pool()
                self._start_pool()
            self._run = _Run(self, self._pool, warm_start=self._pool is not None and not self._pool.all_ready())
        elif self._run.warm_start and self._step_items is None and not self._ahead:
            self._pool.raise_if_dead()  # a worker that died starting up is an error, not a slow start
            self._pool.raise_if_slow_to_start(self.config.worker_timeout_s)
            if self._pool.all_ready():
                warm = self._run
                tokenizes = self.spec.tokenizer_json is not None  # text or chat sources
                self._run = _Run(self, self._pool, lead=None if tokenizes else warm)
                if tokenizes:
                    warm.close_lanes()

    def _start_pool(self) -> None:
        # A loader that looks a step ahead, and balance, hold a whole step of items (a worker must
        # never wait for those slots).
        items_held = self.topology.per_rank_batch if self.looks_ahead or self.config.balance else self.config.micro_batch_size
        per_message = items_per_message(self.config.seq_len, tokenizes=self.spec.tokenizer_json is not None,
                                        images=self.image_options is not None)
        pool = WorkerPool(
            num_workers=min(self.config.num_workers, len(self.rank_lanes)), seq_len=self.config.seq_len,
            prefetch=self.config.prefetch, items_held=items_held, items_per_message=per_message,
            features=self.features,
            extra_slot_bytes=0 if self.image_options is None else image_slot_bytes(
                self.image_options.policy, self.config.seq_len, per_message, self.image_options.wrap_tokens),
        )
        self._pool = pool
        self._finalizer = weakref.finalize(
            self, WorkerPool.shutdown_parts, pool.processes, pool.commands, pool.messages, pool.segments, pool.input_dir
        )

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def _collate(self, items: list[Item], rank_position: Optional[int] = None) -> dict[str, Any]:
        """The micro-batch of ``items`` as NumPy arrays (loader.stages.collate); ``rank_position``:
        sequences handed out with these (default: the rank's)."""
        return self._collator.collate(items, self.rank_position if rank_position is None else rank_position)

    def _handed_out(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A collated micro-batch (NumPy, loader.stages.collate) as the trainer gets it: laid out for
        ``model_inputs`` when set, as torch tensors unless ``output="numpy"``."""
        if self.model_inputs is not None:
            batch = self.model_inputs.lay_out(batch)
            batch["num_items_in_batch"] = np.array(self._step_loss_tokens, dtype=np.int64)
        if self._pinned is not None:
            return self._pinned.to_torch(batch)
        return batch if self.output == "numpy" else to_torch(batch)

    def wait_for_workers(self, timeout_s: Optional[float] = None) -> None:
        """Block until every worker process has started (no-op without workers).

        Until then the trainer's process produces the items itself (warm start); after
        this call the next micro-batch comes from the workers. For tests and
        measurements of the worker path; a trainer never needs it. Raises
        :class:`WorkerError` if a worker died or ``timeout_s`` passed.
        """
        if self._pool is None:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pool.all_ready():
            self._pool.raise_if_dead()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"loader workers did not start within {timeout_s} s")
            time.sleep(0.01)

    def wait_for_read_ahead(self) -> None:
        """Block until the background reads queued by this process's lanes have finished.

        For measurements: CPU spent by the read-ahead threads then falls inside or outside a
        timed window as the caller chooses, whatever the number of sources (each source of
        a lane reads ahead on its own). The stream is unchanged. Lanes in worker processes
        (``num_workers`` > 0) are not waited for.
        """
        if self._run is not None:
            for lane in (self._run.in_process_lanes or {}).values():
                for stream in lane.source_streams():
                    stream.wait_for_read_ahead()

    def close(self) -> None:
        """End the run and every worker process (also done on garbage collection and at exit)."""
        self._end_run()
        self._stop_pool()
        if getattr(self, "_balancer", None) is not None:
            self._balancer.close()
        if self._global_counter is not None:
            self._global_counter.close()

    def _end_run(self) -> None:
        """Drop the current run (in-process lanes, workers' items); worker processes stay."""
        if self._run is not None:
            if self._run.reads_lanes_directly:
                for lane_id, lane in self._run.in_process_lanes.items():
                    self.lane_states[lane_id] = lane.get_state()
            self._run.close()
            self._run = None
        self._step_items = None  # looked-ahead items are re-produced from the lane states
        self._ahead.clear()
        self._agreed_step = None

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Run:
    """One pass of iteration from a fixed start: in-process lanes or the worker pool's processes."""

    def __init__(self, loader: ZephonLoader, pool: Optional[WorkerPool], warm_start: bool = False,
                 lead: Optional["_Run"] = None) -> None:
        cfg = loader.config
        self.warm_start = warm_start  # in-process until the workers are ready
        # The warm start's in-process run, handed over from: it goes on producing while the
        # workers open their lanes and read their first row groups (a few hundred ms, which
        # the trainer waited for at the hand-over: bench/RESULTS.md, issue 16), until every
        # worker has a message at or past the trainer's index; what they made before it is
        # dropped. Both produce the same items from the same lane states.
        self.lead = lead
        # A trainer faster than the workers (replay flat out) would keep the lead forever, so
        # it is given up once every worker is producing and the trainer has taken four times
        # the gap it then had over the slowest worker: workers faster than the trainer (a
        # trainer with other work) have caught up by then (busy trainer: at 1.2-1.5 gaps);
        # if not, the trainer waits for them (replay flat out: they took over after 0.6 s).
        self._lead_until: Optional[int] = None
        self._last_received: dict[int, int] = {}  # worker -> global index of its last item so far
        self.drop_before = 0  # workers' items before this index were made by the lead: dropped
        self.num_lanes = loader.num_lanes
        self.timeout_s = cfg.worker_timeout_s
        self.pool = pool
        self.in_process_lanes = None
        # In-process lanes are read directly by state_dict() unless steps are looked ahead for
        # finite data; then, as with workers, every item carries its lane state. Looking ahead
        # for model_inputs keeps the direct reads: its states are taken at step boundaries only,
        # where the lanes have produced exactly the steps handed out.
        self.reads_lanes_directly = cfg.num_workers == 0 and not loader.finite and not warm_start
        self.pending: dict[int, collections.deque] = {}
        self.worker_of_lane: dict[int, int] = {}
        self.ended_at: Optional[int] = None
        # Filled tails: lanes done (their state at the End), whose indices are fill rows made
        # here, and workers whose every lane is done (they send nothing more).
        self.fills = loader.fills
        self.fill_row = loader.fill_row
        self.exhausted: dict[int, Optional[dict]] = {}
        self._done_workers: set[int] = set()
        if pool is None or warm_start:
            # The trainer's thread calls produce_one for each index in turn: no generator and
            # no position bookkeeping between the loader and its lanes.
            self.in_process_lanes = build_lanes(loader.spec, loader.rank_lanes, loader.lane_states)
            start_reading(self.in_process_lanes, loader.next_global_index, self.num_lanes)
            return
        num_workers = len(pool.processes)
        lanes_per_worker = [lanes_of_worker(loader.rank_lanes, k, num_workers) for k in range(num_workers)]
        self.worker_of_lane = {l: k for k, lane_ids in enumerate(lanes_per_worker) for l in lane_ids}
        self.pending = {k: collections.deque() for k in range(num_workers)}
        pool.start_run(loader.spec, lanes_per_worker, loader.lane_states, num_lanes=self.num_lanes,
                       rank=loader.topology.rank, world_size=loader.topology.world_size,
                       start_position=loader.rank_position, segments=loader._collator.reads_segments)

    @property
    def processes(self) -> list:
        return [] if self.pool is None else self.pool.processes

    def next_item(self, global_index: int) -> Item:
        if self.ended_at is not None and global_index >= self.ended_at:
            raise StopIteration
        if global_index % self.num_lanes in self.exhausted:
            return fill_item(global_index, self.num_lanes, self.exhausted[global_index % self.num_lanes], self.fill_row)
        if self.lead is not None and not self._workers_caught_up(global_index):
            try:
                return self.lead.next_item(global_index)
            except StopIteration:
                self.ended_at = self.lead.ended_at
                raise
        if self.in_process_lanes is not None:
            lane = self.in_process_lanes[global_index % self.num_lanes]
            item = produce_one(lane, global_index, not self.reads_lanes_directly, end_state=self.fills)
        else:
            worker_id = self.worker_of_lane[global_index % self.num_lanes]
            pending = self.pending[worker_id]
            while True:
                while not pending:
                    pending.extend(self.pool.receive(worker_id, self.timeout_s))
                item = pending.popleft()
                if isinstance(item, End):
                    if self.fills and item.global_index < global_index:  # a lane done while the lead led
                        self._lane_done(worker_id, item)
                        continue
                    break
                if item.global_index >= self.drop_before:
                    break
                if item.lease is not None:  # the lead made it: see _workers_caught_up
                    item.lease.item_done()
        if isinstance(item, End):
            if self.fills:
                self._lane_done(self.worker_of_lane.get(global_index % self.num_lanes), item)
                return fill_item(global_index, self.num_lanes, item.lane_state, self.fill_row)
            self.ended_at = item.global_index
            raise StopIteration
        if item.global_index != global_index:
            raise RuntimeError(f"internal ordering error: expected index {global_index}, got {item.global_index}")
        return item

    def _workers_caught_up(self, global_index: int) -> bool:
        """Whether every worker has its next item at or past ``global_index``; once they all
        have, the lead is closed. Items before it (the lead produced them) are dropped, and
        their slots go back, so a worker behind the trainer never waits for slots."""
        caught_up = True
        for worker_id, pending in self.pending.items():
            while True:
                while pending and (self.fills or not isinstance(pending[0], End)) \
                        and pending[0].global_index < global_index:
                    dropped = pending.popleft()
                    if isinstance(dropped, End):  # filled tails: a lane done, as the lead saw it too
                        self._lane_done(worker_id, dropped)
                    elif dropped.lease is not None:
                        dropped.lease.item_done()
                if pending or worker_id in self._done_workers:
                    break
                items = self.pool.try_receive(worker_id)
                if items is None:
                    caught_up = False
                    break
                if items and not isinstance(items[-1], End):
                    self._last_received[worker_id] = items[-1].global_index
                pending.extend(items)
        if not caught_up and self._lead_until is None and len(self._last_received) == len(self.pending):
            gap = global_index - min(self._last_received.values())  # every worker is producing now
            self._lead_until = global_index + 4 * gap
        if caught_up or (self._lead_until is not None and global_index >= self._lead_until):
            self.lead.close_lanes()
            self.lead = None
            self.drop_before = global_index
            return True
        return False

    def _lane_done(self, worker_id: Optional[int], end: End) -> None:
        """Filled tails: the lane of ``end`` is done; its later indices are fill rows."""
        self.exhausted[end.global_index % self.num_lanes] = end.lane_state
        if end.final and worker_id is not None:
            self._done_workers.add(worker_id)

    def close_lanes(self) -> None:
        for lane in (self.in_process_lanes or {}).values():
            lane.close()
        self.in_process_lanes = None

    def close(self) -> None:
        if self.lead is not None:
            self.lead.close_lanes()
            self.lead = None
        self.close_lanes()
        self.pending = {}
        if self.pool is not None:
            self.pool.end_run()


def ranks_have_step(loaders: list[ZephonLoader]) -> bool:
    """Whether the next step is delivered, for ranks simulated in one process (``zephon
    fingerprints``, tests): their :meth:`ZephonLoader.step_available` answers combined as real
    ranks combine them through torch.distributed (all of them; with filled tails, any), and
    the agreement recorded in each loader, whose ``next()`` then delivers the step."""
    answers = [loader.step_available() for loader in loaders]
    agreed = any(answers) if loaders and loaders[0].fills else all(answers)
    if agreed:
        for loader in loaders:
            loader._agreed_step = loader.step
    return agreed
