"""The loader's steps: a micro-batch's items, a step produced ahead (finite data, filled tails, model_inputs' loss tokens) and the end-of-step agreement of the ranks."""

from __future__ import annotations

import collections
import logging
from typing import Optional

from loader.model_inputs.loss_tokens import GlobalCounter, data_parallel_share, sum_over_ranks
from loader.order.data_parallel import initialized_distributed
from loader.stages.producer import FILL_SOURCE, Item

# The loader's one logger, whichever of its modules logs (what users filter on).
log = logging.getLogger("loader.pipeline")


class StepDelivery:
    """A base of :class:`~loader.pipeline.ZephonLoader`: the items of its micro-batches.

    Endless data takes the run's items one index at a time; a loader that looks ahead
    (``finite``, ``model_inputs``) produces the rest of the step first, so that the ranks can
    agree whether it is delivered (one collective also sums the step's loss tokens).
    """

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

    def _next_rows(self) -> Optional[tuple[int, list, list, list]]:
        """The rank's next micro-batch as ``(first global index, fills, rows, source ids)`` of
        bulk concat rows (:meth:`~loader.runtime.handover.Run.take_rows`), or None: then
        :meth:`_next_items` makes it. Endless in-process runs only (no step looked ahead)."""
        if self.looks_ahead:
            return None
        self._start_run()
        run = self._run
        if not run.bulk_rows:
            return None
        first_index = self.next_global_index
        taken = run.take_rows(first_index, self.topology.world_size, self.config.micro_batch_size)
        if taken is None:
            return None
        fills, rows, sources, lane_ids = taken
        self.rank_position += len(rows)
        self._lanes_in_step.update(lane_ids)
        if self.rank_position % self.topology.per_rank_batch == 0:
            self._record_step_boundary()
        return first_index, fills, rows, sources

    def _next_ready_batch(self):
        """The rank's next micro-batch as a worker built it whole
        (:class:`~loader.workers.batches.BuiltBatch`), its lanes' states recorded; None when the
        run's workers send items (then :meth:`_next_items` makes it)."""
        if self.looks_ahead:
            return None
        self._start_run()
        run = self._run
        if run.batch_plan is None or (run.lead is not None and not run.batches_caught_up(self.rank_position)):
            return None  # (the lead makes this micro-batch, item by item)
        ready = run.next_batch(self.rank_position)
        ready.hand_out(run.pool.held, self._collator)  # views of the slot (loader.workers.held), a copy, or collated
        self.rank_position += len(ready.source_ids)
        self.lane_states.update(ready.lane_states)
        self._lanes_in_step.update(ready.lane_states)
        if self.rank_position % self.topology.per_rank_batch == 0:
            self._record_step_boundary()
        return ready

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
        dist = initialized_distributed()
        if self.topology.world_size > 1 and dist is not None:
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
            self._global_counter = GlobalCounter(lambda: type(self)(config, rank=0, world_size=1, output="numpy"),
                                                 world_size=self.topology.world_size)
        return self._global_counter
