"""The lane states of the last few step boundaries a rank handed out.

Trainer frameworks fetch ahead: accelerate's ``DataLoaderShard`` and Lightning's fetcher
hold one micro-batch the model has not trained on yet when a checkpoint is taken, so
``loader.state_dict()`` at that moment is one micro-batch ahead of the model. The fix is to
save the state *as of a step boundary*: the state in which steps ``0 .. t-1`` are consumed
and nothing else. A rank records its lanes' states each time it hands out the last
micro-batch of a step (and at the start of a run), keeping the newest ``capacity``
boundaries; ``ZephonLoader.state_dict(step=t)`` reads them.

Cost: at a boundary only the lanes that produced a sequence during the step are
snapshotted (the others keep the entry of the boundary before), so it is one
``get_state()`` per lane touched in the step, which the per-item snapshots of worker
processes already pay anyway.
"""

from __future__ import annotations

import collections
from typing import Optional


class StepStateHistory:
    """``step -> {lane_id: lane state}`` for the newest ``capacity`` step boundaries.

    A lane absent from a recorded entry had not been started (its state is the fresh one).
    States are stored as given and must not be mutated afterwards (lanes return new dicts).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[int, dict[int, dict]] = collections.OrderedDict()

    def record(self, step: int, changed: dict[int, dict]) -> None:
        """Step boundary ``step`` reached: the newest entry updated with ``changed`` lanes."""
        if self.capacity == 0:
            return
        base = next(reversed(self._entries.values())) if self._entries else {}
        entry = dict(base)
        entry.update(changed)
        self._entries[step] = entry
        self._entries.move_to_end(step)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def reset(self, step: Optional[int], lane_states: dict[int, dict]) -> None:
        """Forget everything (a restore); record ``step`` if the restore is at a boundary."""
        self._entries.clear()
        if step is not None:
            self.record(step, dict(lane_states))

    def get(self, step: int) -> Optional[dict[int, dict]]:
        return self._entries.get(step)

    def steps(self) -> list[int]:
        return list(self._entries)
