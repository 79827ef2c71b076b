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
import time
import weakref
from typing import Any, Optional

import numpy as np

from loader.balanced import make_balancer
from loader.checkpoint.step_states import StepStateHistory
from loader.config import LoaderConfig
from loader.errors import ConfigError, WorkerError
from loader.integrations import framework_paths
from loader.io.manifest import Manifest
from loader.kinds.base import kinds_of
from loader.io.owner import StreamOwner
from loader.metrics import LoaderMetrics, MetricsRecorder
from loader.model_inputs import build_layout
from loader.model_inputs.loss_tokens import GlobalCounter
from loader.order.data_parallel import resolve_data_parallel
from loader.runtime.handover import Run, WorkerHandOver
from loader.runtime.plan import plan_loader
from loader.runtime.session import CheckpointSession
from loader.runtime.steps import StepDelivery
from loader.stages.collate import OUTPUTS, Collator, load_torch, to_torch
from loader.stages.pinned import PinnedBuffers, pinning_available, warn_pinning_unavailable
from loader.stages.producer import Item, fill_sequence
from loader.transforms import resume as transform_resume
from loader.workers.batches import batch_plan, batches_per_message
from loader.workers.pool import WorkerPool

__all__ = ["ZephonLoader", "ranks_have_step", "WorkerError"]  # WorkerError: importable from here as before


class ZephonLoader(CheckpointSession, StepDelivery, WorkerHandOver):
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

    The constructor builds the loader from its config; each other job is a base of its own
    module in :mod:`loader.runtime`, sharing the attributes set here: the checkpoint session
    (:mod:`loader.runtime.session`), the steps (:mod:`loader.runtime.steps`) and the runs with
    the workers' hand-over (:mod:`loader.runtime.handover`).
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
        if output == "torch":
            load_torch()  # torch is imported by its users only, here rather than in the first batch
        # Micro-batches assembled in pinned memory (loader.stages.pinned); without an
        # accelerator there is none: a no-op with one warning, as torch's DataLoader does.
        self._pinned: Optional[PinnedBuffers] = None
        if pin_memory:
            if pinning_available():
                self._pinned = PinnedBuffers()
            else:
                warn_pinning_unavailable()
        self.config = config
        # The threads and I/O counters of this loader's streams (loader.io.owner): joined by close(),
        # also on garbage collection and at exit (the finalizer holds the owner, not the loader).
        self.owner = StreamOwner("zephon-loader")
        self._owner_finalizer = weakref.finalize(self, self.owner.close)
        identity = resolve_data_parallel(rank=rank, world_size=world_size, dp_rank=dp_rank,
                                         dp_world_size=dp_world_size, device_mesh=device_mesh,
                                         dp_mesh_dim=dp_mesh_dim)
        rank, world_size = identity.rank, identity.world_size
        self.dp_group = identity.group  # the DP process group of a DeviceMesh (None: the default group)
        # Sources, manifests, tokenizer, features, topology and the lanes' spec (loader.runtime.plan).
        self.plan = plan = plan_loader(config, rank=rank, world_size=world_size)
        self.manifests: list[Manifest] = list(plan.manifests)
        self.source_names = list(plan.source_names)
        self.num_lanes = plan.num_lanes
        self.topology = plan.topology
        self.tokenizer_fingerprint = plan.tokenizer_fingerprint
        self.phases = list(plan.phases)  # a restore may adopt a recorded schedule (_adopt_schedule)
        self.features = plan.features
        self.image_options = image_options = plan.image_options
        self.source_transforms = list(plan.source_transforms)
        self._transform_changes: list[dict] = []  # changes on resume, as the checkpoint records them
        self.spec = plan.spec  # replaced by a restore that adopts a recorded schedule
        pad_id, token_mixing = plan.pad_id, plan.token_mixing
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
        collator_args = dict(
            seq_len=config.seq_len, global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size, per_rank_batch=self.topology.per_rank_batch,
            batch_fields=tuple(config.batch_fields), features=tuple(self.features),
            chat_reject_reasons=tuple(plan.chat_reject_reasons), fill_rows=self.fills,
        )
        self._collator = Collator(
            **collator_args, empty=np.empty if self._pinned is None else self._pinned.empty,
            image_policy=image_options.policy if image_options is not None else None,
            image_reject_reasons=tuple(dict.fromkeys(r for kind in kinds_of(self.manifests)
                                                     if kind.reject_field == "image_rejects" for r in kind.reject_reasons)),
        )
        self._metrics = MetricsRecorder(
            source_names=self.source_names, seq_len=config.seq_len, per_rank_batch=self.topology.per_rank_batch,
            supervised="loss_mask" in self.features, token_mixing=token_mixing,
            batched_token_sources="token_source_ids" in config.batch_fields,
            log_every_steps=config.metrics_log_every_steps,
            dataset_rejected={n: dict(m.rejected) for n, m in zip(self.source_names, self.manifests)},
            fill_rows=self.fills, io=self.owner.io,
        )
        self._run: Optional[Run] = None
        # A framework path refused at iter(), raised by next() (loader.integrations.framework_paths).
        self._refusal: Optional[Exception] = None
        # Workers that build whole micro-batches (loader.workers.batches): endless data without a
        # balancer, image sources or token sources copied beside the batch, and lane groups per worker.
        self._batch_plan = None
        if config.num_workers > 0 and not self.looks_ahead and not config.balance \
                and image_options is None and not self._metrics.copies_token_sources:
            self._batch_plan = batch_plan(rank=self.topology.rank, world_size=self.topology.world_size,
                                          num_lanes=self.num_lanes, micro_batch_size=config.micro_batch_size,
                                          num_workers=min(config.num_workers, len(self.rank_lanes)),
                                          collator=collator_args, per_message=batches_per_message(
                                              config.micro_batch_size, config.seq_len, plan.spec.tokenizer_json is not None))
        self._pool: Optional[WorkerPool] = None
        self._finalizer = None
        if config.num_workers > 0:
            # Started now, so that the workers import and map their memory while the trainer
            # builds its model; they serve every run (and restore) of this loader.
            self._start_pool()
        # balance = "attention" (loader.balanced): micro-batches chosen from the whole step by cost.
        self._balancer = make_balancer(self)

    def transform_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """What the transforms did in this rank's lanes, as of the batches handed out:
        ``{source: {"position:function": {"dropped": n, "changed": n}}}`` (documents of the row
        groups each lane has taken from; the global figure is the sum over ranks, or this of
        a merged state: :func:`loader.transforms.resume.counts_report`)."""
        states = transform_resume.as_plain(self._current_lane_states())
        return transform_resume.counts_report(self.source_names, self.source_transforms, list(states.values()),
                                              [m.tombstone_transforms if m.has_tombstones else () for m in self.manifests])

    # -- schedule ------------------------------------------------------------------------
    # -- state ---------------------------------------------------------------------------

    def metrics(self) -> LoaderMetrics:
        """Counters since the loader was built and for the last whole step (:mod:`loader.metrics`)."""
        metrics = self._metrics.metrics(self.step)
        if self._balancer is not None:
            metrics.balance = self._balancer.stats()
        return metrics

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> "ZephonLoader":
        # A framework iterating the loader without its integration class: exact, or refused.
        self._refusal = framework_paths.check_iteration(self)
        return self

    def state_dict(self, step: Optional[int] = None) -> dict[str, Any]:
        """:meth:`CheckpointSession.state_dict <loader.runtime.session.CheckpointSession.state_dict>`;
        the current state (no ``step``) is refused to a framework that asks for it while it holds
        prefetched micro-batches (:mod:`loader.integrations.framework_paths`)."""
        if step is None:
            framework_paths.check_state_request()
        return super().state_dict(step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`CheckpointSession.load_state_dict <loader.runtime.session.CheckpointSession.load_state_dict>`;
        refused to a framework restoring a state it saved ahead of its model
        (:mod:`loader.integrations.framework_paths`)."""
        framework_paths.check_state_load()
        super().load_state_dict(state)

    def __next__(self) -> dict[str, Any]:
        if self._refusal is not None:
            raise self._refusal
        if self._balancer is not None:
            return self._balancer.next_batch()
        started = time.perf_counter()  # the trainer's wait (loader.metrics)
        rows = self._next_rows()
        if rows is not None:  # bulk concat rows: no item per sequence (loader.runtime.steps)
            first_index, fills, row_ids, sources = rows
            batch = self._collator.collate_rows(fills, row_ids, sources, first_index, self.topology.world_size,
                                                self.rank_position)
            self._metrics.count_rows(sources, batch, time.perf_counter() - started, self.rank_position)
            return self._handed_out(batch)
        ready = self._next_ready_batch()
        if ready is not None:  # built whole by a worker (loader.workers.batches)
            self._metrics.count_rows(ready.source_ids, ready.batch, time.perf_counter() - started, self.rank_position,
                                     ready.padding, ready.rejects)
            return self._handed_out(ready.batch)
        items = self._next_items()
        batch = self._collate(items)
        self._metrics.count(items, batch, time.perf_counter() - started, self.rank_position)
        return self._handed_out(batch)

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
        """End the run, every worker process and every thread of the loader (also done on garbage
        collection, at exit, and on leaving a ``with`` block, Ctrl-C included). Iterating again
        afterwards starts them anew."""
        try:
            self._end_run()
            self._stop_pool()
            if getattr(self, "_balancer", None) is not None:
                self._balancer.close()
            if self._global_counter is not None:
                self._global_counter.close()
        finally:
            self.owner.close()

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
