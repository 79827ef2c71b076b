"""Which data-parallel rank a loader serves: explicit arguments, a DeviceMesh, or the environment.

Zephon's ``rank`` / ``world_size`` are the **data-parallel** rank and size: the processes
that must receive *different* micro-batches. Under tensor or pipeline parallelism several
processes share one data-parallel rank (TP peers must get the same batch), so the global
``RANK`` / ``WORLD_SIZE`` of ``torchrun`` are the wrong numbers there. The ways in, first
match wins::

    ZephonLoader(config, dp_rank=r, dp_world_size=W)                # the names torchtitan/Megatron use
    ZephonLoader(config, rank=r, world_size=W)                      # the same thing, older names
    ZephonLoader(config, device_mesh=mesh, dp_mesh_dim="dp")        # a torch DeviceMesh and its DP dim
    ZephonLoader(config)                                            # RANK / WORLD_SIZE (pure data parallel only)

Taking them from the environment is logged once per process (at WARNING when
``WORLD_SIZE > 1``), with the fix for TP/PP.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional
from loader.errors import TopologyError


log = logging.getLogger(__name__)

_logged_env_identity = False


@dataclass(frozen=True)
class DataParallelIdentity:
    """This process's data-parallel rank and size, and where they came from."""

    rank: int
    world_size: int
    source: str  # "arguments", "device_mesh" or "environment"
    group: Any = None  # the DP process group (from a DeviceMesh), or None for the default group


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise TopologyError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_data_parallel(
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    dp_rank: Optional[int] = None,
    dp_world_size: Optional[int] = None,
    device_mesh: Any = None,
    dp_mesh_dim: Optional[str] = None,
) -> DataParallelIdentity:
    """The data-parallel identity from whichever of the ways in was used (mixing them is an error)."""
    for name, value in (("rank", rank), ("world_size", world_size),
                        ("dp_rank", dp_rank), ("dp_world_size", dp_world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TopologyError(f"{name} must be an integer (got {name}={value!r})")
    if (dp_rank is None) != (dp_world_size is None):
        raise TopologyError("pass dp_rank and dp_world_size together (got only one of them)")
    if (rank is None) != (world_size is None) and dp_rank is None and device_mesh is None:
        raise TopologyError("pass rank and world_size together (got only one of them)")
    given = [name for name, used in (("rank/world_size", rank is not None or world_size is not None),
                                     ("dp_rank/dp_world_size", dp_rank is not None),
                                     ("device_mesh", device_mesh is not None)) if used]
    if len(given) > 1:
        raise TopologyError(
            f"give the data-parallel rank one way only (got {' and '.join(given)}); rank/world_size and "
            "dp_rank/dp_world_size mean the same thing, and a device_mesh supplies both"
        )
    if dp_mesh_dim is not None and device_mesh is None:
        raise TopologyError("dp_mesh_dim names a dimension of device_mesh, but no device_mesh was given")
    if dp_rank is not None:
        return DataParallelIdentity(dp_rank, dp_world_size, "arguments")
    if rank is not None:
        return DataParallelIdentity(rank, world_size, "arguments")
    if device_mesh is not None:
        return _from_mesh(device_mesh, dp_mesh_dim)
    identity = DataParallelIdentity(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), "environment")
    global _logged_env_identity
    if not _logged_env_identity:
        _logged_env_identity = True
        level = logging.WARNING if identity.world_size > 1 else logging.INFO
        log.log(
            level,
            "Zephon took its data-parallel rank %d and world size %d from RANK/WORLD_SIZE. That is right "
            "for pure data parallelism only: under tensor or pipeline parallelism pass "
            "ZephonLoader(config, dp_rank=..., dp_world_size=...) or device_mesh=mesh, dp_mesh_dim='dp', "
            "so that peers of one data-parallel rank get the same batches",
            identity.rank, identity.world_size,
        )
    return identity


def _from_mesh(mesh: Any, dim: Optional[str]) -> DataParallelIdentity:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if dim is None:
        if len(names) == 1 or getattr(mesh, "ndim", None) == 1:
            dim = names[0] if names else None
        else:
            raise TopologyError(
                f"device_mesh has dimensions {list(names)}: name the data-parallel one with dp_mesh_dim="
            )
    elif dim not in names:
        raise TopologyError(f"dp_mesh_dim={dim!r} is not a dimension of the device_mesh (dimensions: {list(names)})")
    if dim is None:
        return DataParallelIdentity(mesh.get_local_rank(), mesh.size(), "device_mesh", mesh.get_group())
    # DeviceMesh.size takes the dimension's index (a name raises TypeError); the others take names.
    size = mesh.size(names.index(dim))
    return DataParallelIdentity(mesh.get_local_rank(dim), size, "device_mesh", mesh.get_group(dim))


def initialized_distributed():
    """``torch.distributed`` when a process group is initialised in this process, else None.

    Looked up in ``sys.modules``, never imported: a process group exists only once
    ``torch.distributed`` has been imported, so a trainer without torch (``output="numpy"``)
    does not import it through the loader's end-of-step or checkpoint collectives.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None
