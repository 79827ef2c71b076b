"""A torchtitan-style data loader: ``Stateful``, data-parallel aware, resharded by lane under DCP.

Mirrors torchtitan's ``ParallelAwareDataloader`` (``torchtitan/components/dataloader.py``):
built with ``dp_rank`` / ``dp_world_size`` (or a DeviceMesh and the name of its
data-parallel dimension), iterated for micro-batches, and saved by the checkpointer
through ``state_dict()`` / ``load_state_dict()``. torchtitan stores one pickled
StatefulDataLoader state per ``dp_rank_<r>`` key and refuses another data-parallel degree;
this loader stores the step-boundary state one key per lane (:class:`LoaderStateful`), so
``dcp.save`` on W ranks and ``dcp.load`` on W' ranks hands every rank its lanes::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    dataloader = ZephonTitanDataLoader(config, device_mesh=mesh, dp_mesh_dim="dp")
    data_iterator = iter(dataloader)
    for step in ...:
        for _ in range(dataloader.micro_steps_per_step):   # = gradient accumulation steps
            batch = next(data_iterator)                     # the same on every TP peer
        optimizer.step()
        dcp.save({"model": ..., "dataloader": dataloader}, checkpoint_id=...)

Tensor/pipeline-parallel peers share a data-parallel rank, so they receive the same
micro-batches and write identical lane entries, which DCP stores once.

The saved state is the boundary of the steps the model's optimizer has finished: the
loader's position when called at a step boundary, and the boundary before the current
step when called mid-step (the micro-batches of an unfinished step were not applied to the
weights, so they are trained again after a resume). A trainer that fetches a whole step
ahead sets ``checkpoint_step`` to the number of optimizer steps it has taken.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

from torch.distributed.checkpoint.stateful import Stateful

from loader.errors import StateError
from loader.config import LoaderConfig
from loader.pipeline import ZephonLoader
from loader.integrations.torch_data import LoaderStateful

log = logging.getLogger(__name__)


class ZephonTitanDataLoader(Stateful):
    """Micro-batches of one data-parallel rank, with a DCP state that reshards by lane.

    Attributes as torchtitan's ``ParallelAwareDataloader``: ``dp_rank``, ``dp_world_size``,
    ``batch_size`` (the micro-batch size). ``micro_steps_per_step`` is the number of
    micro-batches per optimizer step (the gradient accumulation steps to configure).
    ``checkpoint_step``: ``None`` (default) saves the boundary of the optimizer steps
    finished (see the module docstring); an int saves the boundary before that step.
    """

    def __init__(
        self,
        config: LoaderConfig,
        *,
        dp_rank: Optional[int] = None,
        dp_world_size: Optional[int] = None,
        device_mesh: Any = None,
        dp_mesh_dim: Optional[str] = None,
    ) -> None:
        if device_mesh is None and dp_rank is None:
            raise StateError(
                "ZephonTitanDataLoader needs the data-parallel identity: pass dp_rank= and dp_world_size= "
                "(as torchtitan's ParallelAwareDataloader takes them) or device_mesh=mesh, dp_mesh_dim='dp'"
            )
        self.loader = ZephonLoader(config, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   device_mesh=device_mesh, dp_mesh_dim=dp_mesh_dim)
        self.dp_rank = self.loader.topology.rank
        self.dp_world_size = self.loader.topology.world_size
        self.batch_size = config.micro_batch_size
        self.micro_steps_per_step = self.loader.topology.micro_steps_per_step
        self.checkpoint_step: Optional[int] = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def saved_step(self) -> int:
        """The step boundary ``state_dict()`` saves now."""
        if self.checkpoint_step is not None:
            return self.checkpoint_step
        mid_step = self.loader.rank_position % self.loader.topology.per_rank_batch
        if mid_step:
            log.info(
                "ZephonTitanDataLoader.state_dict() mid-step (%d of %d sequences of step %d handed out): "
                "saving the boundary before step %d, the optimizer steps finished",
                mid_step, self.loader.topology.per_rank_batch, self.loader.step, self.loader.step,
            )
        return self.loader.step

    def state_dict(self) -> dict[str, str]:
        return LoaderStateful(self.loader, step=self.saved_step()).state_dict()

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        if not state_dict:
            # torchtitan treats an empty state as "nothing to restore"; for a data loader
            # that would silently retrain from step 0, so it is an error here.
            raise StateError(
                "ZephonTitanDataLoader.load_state_dict() got an empty state: the checkpoint holds no "
                "data loader state; save the data loader with the model (or start without loading it)"
            )
        LoaderStateful(self.loader).load_state_dict(state_dict)
        self.checkpoint_step = None

    def global_state_dict(self, step: Optional[int] = None) -> dict[str, Any]:
        """The merged topology-free state (a collective over the data-parallel group)."""
        return self.loader.global_state_dict(step=self.saved_step() if step is None else step)

    def close(self) -> None:
        self.loader.close()
