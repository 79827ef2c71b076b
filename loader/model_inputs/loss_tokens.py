"""``num_items_in_batch``: the loss tokens of a whole optimizer step, on every micro-batch of it.

A causal-LM loss in transformers sums the token losses of a micro-batch and divides by
``num_items_in_batch``: the tokens whose *shifted* label is not ``-100`` (``labels[..., 1:]``;
a row's first label is never a target). With packing and loss masks that count differs from
micro-batch to micro-batch, so the loss of the step is the mean token loss of the global batch
only if every micro-batch divides by the count of the whole step: all its micro-batches on all
data-parallel ranks. Then ``sum over micro-batches and ranks of model(**batch).loss`` is that
mean (a data-parallel gradient *average* over W ranks needs the loss times W: see
docs/guides/model-inputs.md).

How a rank learns the count before the step's first micro-batch (the loader looks one step
ahead on its own lanes, as it does for finite data):

* ``world_size == 1``: its own count;
* ranks of a ``torch.distributed`` run: each rank's count, summed by one ``all_reduce`` of two
  int64 on a gloo group per step, the same collective that agrees on the end of finite data
  (``ZephonLoader._all_ranks_have_step``);
* ranks simulated in one process (``world_size > 1`` without a process group, as
  ``zephon fingerprints`` and tests build them): no communication; the rank counts the whole
  global batch itself with a world-size-1 reader of every lane (:class:`GlobalCounter`),
  which costs W times the reading of one rank and is warned about once.

Under tensor or pipeline parallelism the collective runs over every process, and the peers of
one data-parallel rank hold the same micro-batches: the sum counts each data-parallel rank
once per peer, and :func:`data_parallel_share` divides that out.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import numpy as np

from loader.errors import StateError
from loader.stages.features import IGNORE_INDEX

log = logging.getLogger(__name__)


def shifted_label_count(labels: np.ndarray) -> int:
    """Tokens a causal-LM loss counts in ``labels`` ``[rows, seq_len]``: ``labels[:, 1:] != -100``."""
    return int(np.count_nonzero(np.asarray(labels)[..., 1:] != IGNORE_INDEX))


class GlobalCounter:
    """The loss tokens of every step of the global stream, read by this process alone.

    ``make_reader``: builds a world-size-1 reader whose micro-batch is one whole global batch
    (NumPy ``labels``); built on first use and positioned like the loader (:meth:`load_state`).
    """

    def __init__(self, make_reader: Callable[[], Any], *, world_size: int) -> None:
        self.make_reader = make_reader
        self.world_size = world_size
        self._reader = None
        self._state: Optional[dict] = None

    def load_state(self, state: dict) -> None:
        """Start at the global state ``state`` (a merged state: it holds every lane)."""
        self.close()
        self._state = state

    def count_next_step(self) -> Optional[int]:
        """The next step's count; None when the data ends before it."""
        if self._reader is None:
            log.warning("num_items_in_batch: world_size=%d without torch.distributed: this process counts every "
                     "rank's loss tokens by reading all lanes (%dx the reading of one rank); initialise a process "
                     "group for one all_reduce per step instead", self.world_size, self.world_size)
            if self._state is not None and "rank" in self._state:
                raise StateError(
                    f"ranks simulated without torch.distributed (world_size={self.world_size}) count every rank's "
                    "loss tokens from all lanes, so with model_inputs they resume from a merged state "
                    "(loader.checkpoint.state.merge_rank_states of every rank's state_dict(step=t)), not from "
                    f"rank {self._state['rank']}'s own state")
            self._reader = self.make_reader()
            if self._state is not None:
                self._reader.load_state_dict(self._state)
        try:
            batch = next(self._reader)
        except StopIteration:
            return None
        return shifted_label_count(batch["labels"])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def data_parallel_share(total: int, processes: int, dp_world_size: int) -> int:
    """``total`` summed over ``processes`` that are ``dp_world_size`` data-parallel ranks times
    ``processes // dp_world_size`` peers with identical batches: each rank's count once."""
    peers, rest = divmod(processes, dp_world_size)
    if rest or total % peers:
        raise StateError(
            f"num_items_in_batch: {processes} processes serve {dp_world_size} data-parallel ranks, but the loss "
            f"tokens summed over them ({total}) are not {peers} identical copies per rank: the tensor/pipeline "
            "peers of a data-parallel rank must build the loader with the same dp_rank (or device_mesh)")
    return total // peers


def sum_over_ranks(values: Iterable[int], group: Any) -> list[int]:
    """``values`` summed over the ranks of ``group`` by one ``all_reduce`` (gloo, CPU int64)."""
    import torch  # optional heavy dependency, here only with a real process group (torch is running)
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.tolist()
