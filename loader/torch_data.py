"""PyTorch integration: an ``IterableDataset`` adapter and ``torch.distributed.checkpoint`` state.

``ZephonIterableDataset`` wraps a :class:`~loader.pipeline.ZephonLoader` so it can sit in a
``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0, pin_memory=True)``;
Zephon runs its own worker processes (``num_workers`` in the Zephon config), so the torch
DataLoader must keep ``num_workers=0`` — it only adds pinning.

``LoaderStateful`` makes the loader's state reshard under ``torch.distributed.checkpoint``:
its ``state_dict()`` has one JSON string per owned lane (``lane_00017``) plus a
rank-independent ``zephon_meta`` entry, so ``dcp.save`` from W ranks and ``dcp.load`` from
W' ranks hands every new rank the lanes it now owns, whichever rank wrote them::

    state = {"model": model_sd, "optim": optim_sd, "data": LoaderStateful(loader)}
    dcp.save(state, checkpoint_id=path)      # after an optimizer step, on every rank
    dcp.load(state, checkpoint_id=path)      # on any world size; loader resumes exactly
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset

from loader.pipeline import ZephonLoader
from loader.state import StateError, lane_key


class ZephonIterableDataset(IterableDataset):
    """Micro-batches of a ZephonLoader as an IterableDataset (use ``batch_size=None``)."""

    def __init__(self, loader: ZephonLoader) -> None:
        super().__init__()
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 0:
            raise RuntimeError(
                "wrap ZephonIterableDataset in a DataLoader with num_workers=0: Zephon runs its own "
                "worker processes (set num_workers in the Zephon config instead)"
            )
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


_META = "zephon_meta"


class LoaderStateful:
    """``torch.distributed.checkpoint.stateful.Stateful`` view of a loader, resharded by lane."""

    def __init__(self, loader: ZephonLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, str]:
        local = self.loader.state_dict()
        # Every rank writes the same meta entry (DCP keeps one), so only step boundaries work.
        if local["rank_position"] % self.loader.topology.per_rank_batch:
            raise StateError(
                "LoaderStateful.state_dict() called mid-step; save checkpoints after a whole optimizer step"
            )
        meta = {k: v for k, v in local.items() if k not in ("lanes", "rank", "world_size", "rank_position")}
        meta["next_global_index"] = self.loader.step * self.loader.config.global_batch_size
        out = {_META: json.dumps(meta, sort_keys=True)}
        for key, lane_state in local["lanes"].items():
            out[f"lane_{key}"] = json.dumps(lane_state, sort_keys=True)
        return out

    def load_state_dict(self, state: dict[str, str]) -> None:
        meta = json.loads(state[_META])
        meta["lanes"] = {
            lane_key(l): json.loads(state[f"lane_{lane_key(l)}"]) for l in self.loader.rank_lanes
        }
        self.loader.load_state_dict(meta)
