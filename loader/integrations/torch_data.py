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
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import IterableDataset

from loader.errors import ConfigError, StateError
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import lane_key


class ZephonIterableDataset(IterableDataset):
    """Micro-batches of a ZephonLoader as an IterableDataset (use ``batch_size=None``)."""

    def __init__(self, loader: ZephonLoader) -> None:
        super().__init__()
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 0:
            raise ConfigError(
                f"torch DataLoader num_workers={info.num_workers}: wrap ZephonIterableDataset in a DataLoader "
                "with num_workers=0, since each torch worker would replay the rank's whole stream; Zephon runs its own "
                "worker processes (set num_workers in the Zephon config instead)"
            )
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


_META = "zephon_meta"


class LoaderStateful:
    """``torch.distributed.checkpoint.stateful.Stateful`` view of a loader, resharded by lane.

    ``step``: save the state at the boundary before that step (``loader.state_dict(step=...)``:
    steps ``0..step-1`` consumed), for a framework that fetched micro-batches ahead of the
    model. ``None`` saves the loader's current position, which must be a step boundary.
    Tensor/pipeline-parallel peers of one data-parallel rank write identical entries, which
    DCP stores once.
    """

    def __init__(self, loader: ZephonLoader, step: Optional[int] = None) -> None:
        self.loader = loader
        self.step = step

    def state_dict(self) -> dict[str, str]:
        if self.step is None:
            local = self.loader.state_dict()
            # Every rank writes the same meta entry (DCP keeps one), so only step boundaries work.
            if local["rank_position"] % self.loader.topology.per_rank_batch:
                raise StateError(
                    "LoaderStateful.state_dict() called mid-step; save checkpoints after a whole optimizer "
                    "step, or pass LoaderStateful(loader, step=<optimizer steps trained>)"
                )
            step = self.loader.step
        else:
            local, step = self.loader.state_dict(step=self.step), self.step
        meta = {k: v for k, v in local.items() if k not in ("lanes", "rank", "world_size", "rank_position")}
        meta["next_global_index"] = step * self.loader.config.global_batch_size
        out = {_META: json.dumps(meta, sort_keys=True)}
        for key, lane_state in local["lanes"].items():
            out[f"lane_{key}"] = json.dumps(lane_state, sort_keys=True)
        return out

    def load_state_dict(self, state: dict[str, str]) -> None:
        """Load the entries DCP handed this rank: ``zephon_meta`` and one ``lane_XXXXX`` per owned
        lane, each a JSON string (parsed as JSON only, never unpickled). A missing or malformed
        entry is a :class:`StateError` naming its key; the assembled state is then checked
        field by field by ``ZephonLoader.load_state_dict`` (paths ``lanes.00017...``)."""
        if not isinstance(state, dict):
            raise StateError(f"LoaderStateful.load_state_dict takes the dict DCP loaded (got {type(state).__name__})")
        meta = _json_entry(state, _META)
        if not isinstance(meta, dict):
            raise StateError(f"DCP entry {_META!r}: must hold a JSON object (got {type(meta).__name__})")
        if "lanes" in meta:
            raise StateError(f"DCP entry {_META!r}: unknown key 'lanes' (lane states are entries 'lane_XXXXX')")
        meta["lanes"] = {lane_key(l): _json_entry(state, f"lane_{lane_key(l)}") for l in self.loader.rank_lanes}
        self.loader.load_state_dict(meta)


def _json_entry(state: dict, key: str) -> Any:
    """The JSON value of DCP entry ``key``; a StateError names the key when it is not there or not JSON."""
    if key not in state:
        what = "the loader's header" if key == _META else "a lane this rank owns"
        raise StateError(f"DCP entry {key!r} ({what}) is missing from the checkpoint; was it saved with "
                         "LoaderStateful under the same key?")
    text = state[key]
    if not isinstance(text, str):
        raise StateError(f"DCP entry {key!r}: must be a JSON string (got {type(text).__name__})")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise StateError(f"DCP entry {key!r}: not valid JSON ({exc})") from None
