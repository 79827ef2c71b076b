"""The loader's runs: in-process lanes or the worker pool, the warm start and its hand-over to the workers."""

from __future__ import annotations

import collections
import time
import weakref
from typing import Optional

from loader.errors import WorkerError
from loader.kinds.base import kinds_of
from loader.order.ordering import lanes_of_worker, rank_period
from loader.stages.producer import End, Item, build_lanes, fill_item, produce_one, start_reading, take_rows
from loader.workers.batches import ROWS_GAP_S, batch_bytes
from loader.workers.messages import items_per_message
from loader.workers.pool import WorkerPool


class WorkerHandOver:
    """A base of :class:`~loader.pipeline.ZephonLoader`: its runs and worker pool.

    ``_run`` is the current :class:`Run`; ``_pool`` the :class:`~loader.workers.pool.WorkerPool`
    (started by the constructor, kept across runs and restores, ended by ``close``).
    """

    def _start_run(self) -> None:
        """The run that produces the next items: workers, or in-process lanes.

        Warm start: until every worker has started (imports take a few hundred
        milliseconds), the trainer's process produces the items itself, then hands the
        lanes' states to the workers at an item boundary (a step boundary when steps are
        looked ahead). The stream is the same either way; the first batch does not wait.
        Nor does the hand-over: the workers start from the states handed over while the
        trainer's lanes go on producing, until every worker has caught up (``Run.lead``).
        Except where the sources tokenize online: there the trainer's lanes would take the
        cores the workers tokenize on, so that they caught up only after seconds (text, 2
        workers, busy trainer: 4.5 s at a third of the rate, against one wait of ~0.3 s at
        the hand-over; bench/HISTORY.md, "issue 16, text with workers"), and the workers take
        over at once.
        """
        if self._run is None:
            if self.config.num_workers > 0 and (self._pool is None or not self._pool.healthy()):
                self._stop_pool()
                self._start_pool()
            self._run = Run(self, self._pool, warm_start=self._pool is not None and not self._pool.all_ready())
        elif self._run.warm_start and self._step_items is None and not self._ahead:
            self._pool.raise_if_dead()  # a worker that died starting up is an error, not a slow start
            self._pool.raise_if_slow_to_start(self.config.worker_timeout_s)
            if self._pool.all_ready():
                warm = self._run
                tokenizes = self.spec.tokenizer_json is not None  # text or chat sources
                self._run = Run(self, self._pool, lead=None if tokenizes else warm)
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
            features=self.features, io=self.owner.io,
            extra_slot_bytes=max(kind.worker_slot_bytes(self.spec, self.config.seq_len, per_message)
                                 for kind in kinds_of(self.manifests)),
            batch_slot_bytes=0 if self._batch_plan is None else batch_bytes(self._collator, self._batch_plan.per_message),
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


class Run:
    """One pass of iteration from a fixed start: in-process lanes or the worker pool's processes."""

    def __init__(self, loader, pool: Optional[WorkerPool], warm_start: bool = False,
                 lead: Optional["Run"] = None) -> None:
        cfg = loader.config
        self.warm_start = warm_start  # in-process until the workers are ready
        # The warm start's in-process run, handed over from: it goes on producing while the
        # workers open their lanes and read their first row groups (a few hundred ms, which
        # the trainer waited for at the hand-over: bench/HISTORY.md, "worker changes (helper A/B
        # pairs, load 2-16)"), until every worker has a message at or past the trainer's index;
        # what they made before it is dropped. Both produce the same items from the same lane
        # states.
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
        # Whether micro-batches may be taken as rows of the packers' fills (take_rows), or come
        # whole from the workers (next_batch): set below.
        self.bulk_rows = False
        self.batch_plan = None
        if pool is None or warm_start:
            # The trainer's thread calls produce_one for each index in turn: no generator and
            # no position bookkeeping between the loader and its lanes.
            self.in_process_lanes = build_lanes(loader.spec, loader.rank_lanes, loader.lane_states, loader.owner)
            start_reading(self.in_process_lanes, loader.next_global_index, self.num_lanes)
            self.bulk_rows = (self.reads_lanes_directly and not self.fills
                              and cfg.micro_batch_size <= rank_period(self.num_lanes, loader.topology.world_size)
                              and all(lane.bulk_rows for lane in self.in_process_lanes.values()))
            self._source_of = loader.spec.schedule.source_of
            return
        num_workers = len(pool.processes)
        # Whole micro-batches from the workers (loader.workers.batches) from a micro-batch boundary on.
        plan = loader._batch_plan if loader.rank_position % cfg.micro_batch_size == 0 else None
        self.batch_plan = plan
        # Whether the trainer is loader-bound (ROWS_GAP_S): the moving average of its time between
        # two micro-batches, and when it last took one.
        self._gap_s, self._taken_at, self._rows_wanted = ROWS_GAP_S, None, False
        pool.want_rows(False)
        if plan is not None:
            lanes_per_worker = [plan.lanes_of(k) for k in range(num_workers)]
        else:
            lanes_per_worker = [lanes_of_worker(loader.rank_lanes, k, num_workers) for k in range(num_workers)]
        self.worker_of_lane = {l: k for k, lane_ids in enumerate(lanes_per_worker) for l in lane_ids}
        self.pending = {k: collections.deque() for k in range(num_workers)}
        pool.start_run(loader.spec, lanes_per_worker, loader.lane_states, num_lanes=self.num_lanes,
                       rank=loader.topology.rank, world_size=loader.topology.world_size,
                       start_position=loader.rank_position, segments=loader._collator.reads_segments, plan=plan)

    @property
    def processes(self) -> list:
        return [] if self.pool is None else self.pool.processes

    def next_item(self, global_index: int) -> Item:
        if self.ended_at is not None and global_index >= self.ended_at:
            raise StopIteration
        if global_index % self.num_lanes in self.exhausted:
            return fill_item(global_index, self.num_lanes, self.exhausted[global_index % self.num_lanes], self.fill_row)
        if self.lead is not None and (self.batch_plan is not None or not self._workers_caught_up(global_index)):
            # (With whole micro-batches from the workers, only the lead's items come here:
            # StepDelivery._next_ready_batch decided so at the micro-batch boundary.)
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

    def next_batch(self, position: int):
        """The micro-batch starting at rank position ``position``, built whole by the worker the
        :attr:`batch_plan` names (a :class:`~loader.workers.batches.BuiltBatch`)."""
        if self.batch_plan.rows == "loader_bound":
            self._ask_for_rows()
        worker_id = self.batch_plan.worker_of(position // self.batch_plan.micro_batch_size)
        pending = self.pending[worker_id]
        while True:
            while not pending:
                pending.extend(self.pool.receive(worker_id, self.timeout_s))
            ready = pending.popleft()
            if ready.position >= position:
                break
            ready.drop()  # the lead made it (batches_caught_up gave up on a slow worker)
        if ready.position != position:
            raise RuntimeError(f"internal ordering error: expected the micro-batch at rank position {position}, "
                               f"got {ready.position}")
        self._taken_at = time.perf_counter()
        return ready

    def _ask_for_rows(self) -> None:
        """Tell the workers to ship bulk rows while the trainer is loader-bound (it comes back
        within ``ROWS_GAP_S`` on average: it would wait for collated batches, and its own
        collation costs less CPU in all), collated batches otherwise."""
        if self._taken_at is None:
            return
        self._gap_s += (time.perf_counter() - self._taken_at - self._gap_s) * 0.125
        wanted = self._gap_s < ROWS_GAP_S
        if wanted != self._rows_wanted:
            self._rows_wanted = wanted
            self.pool.want_rows(wanted)

    def batches_caught_up(self, position: int) -> bool:
        """:meth:`_workers_caught_up` for workers that build whole micro-batches, asked at the
        micro-batch boundary ``position`` (a rank position): whether every worker has a batch at or
        past it; the lead makes the micro-batch until then (or until it has led four times the
        gap it had over the slowest worker once every worker was producing)."""
        caught_up = True
        for worker_id, pending in self.pending.items():
            while True:
                while pending and pending[0].position < position:  # the lead made it
                    pending.popleft().drop()
                if pending:
                    break
                batches = self.pool.try_receive(worker_id)
                if batches is None:
                    caught_up = False
                    break
                self._last_received[worker_id] = batches[-1].position
                pending.extend(batches)
        if not caught_up and self._lead_until is None and len(self._last_received) == len(self.pending):
            self._lead_until = position + 4 * (position - min(self._last_received.values()))
        if caught_up or (self._lead_until is not None and position >= self._lead_until):
            self.lead.close_lanes()
            self.lead = None
            return True
        return False

    def take_rows(self, first_index: int, stride: int, count: int) -> Optional[tuple[list, list, list, list]]:
        """:func:`~loader.stages.producer.take_rows` of the in-process lanes (only where
        :attr:`bulk_rows`: in-process lanes read directly, every lane
        :attr:`~loader.stages.lane.Lane.bulk_rows`, distinct lanes per micro-batch)."""
        return take_rows(self.in_process_lanes, self.num_lanes, self._source_of, first_index, stride, count)

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
