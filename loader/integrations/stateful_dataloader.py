"""torchdata ``StatefulDataLoader`` over a ZephonLoader, and merging its per-rank states.

``StatefulDataLoader(ZephonIterableDataset(loader), batch_size=None, num_workers=0)`` resumes
exactly on the same topology, mid-step included: its ``state_dict()`` holds the loader's own
state. That state is rank-local, so a resume on another world size needs the W per-rank
states merged into one topology-free state; :func:`merge_dataloader_states` does it and
returns a ``StatefulDataLoader`` state that every rank of any world size loads::

    dataloader = zephon_stateful_dataloader(ZephonLoader(config, dp_rank=r, dp_world_size=W))
    ...                                         # after optimizer step t, on every rank:
    per_rank = dataloader.state_dict()          # gather the W of them (or save them per rank)
    merged = merge_dataloader_states(states)    # one state, any world size
    dataloader.load_state_dict(merged)          # on each of the W' new ranks

Where the Zephon state sits in a single-process ``StatefulDataLoader`` state (torchdata 0.11,
``stateful_dataloader.py``): the dataset is Stateful, so ``"dataset_state"`` holds
``ZephonIterableDataset.state_dict()``; its iterator (the ZephonLoader itself) is Stateful
too, so ``"fetcher_state"["dataset_iter_state"]`` holds the same state again. Both are
loaded on restore (dataset first), so a merged state goes in both.

Prefetch rule: with ``num_workers=0`` the StatefulDataLoader fetches a micro-batch only
when asked (``prefetch_factor`` must stay ``None``, torchdata refuses it without workers;
``in_order`` only matters with workers), so its state is exactly what the trainer took.
``num_workers > 0`` is refused: each torch worker would iterate a full copy of the rank's
stream. Zephon's own ``num_workers`` (in the config) parallelises instead, and its states
stay exact under its prefetch.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from torchdata.stateful_dataloader import StatefulDataLoader

from loader.errors import StateError
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import merge_rank_states
from loader.integrations.torch_data import ZephonIterableDataset

# Keys of torchdata 0.11's single-process iterator state (stateful_dataloader.py).
DATASET_STATE = "dataset_state"
FETCHER_STATE = "fetcher_state"
DATASET_ITER_STATE = "dataset_iter_state"
NUM_YIELDED = "_num_yielded"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
MULTIPROCESS_SNAPSHOT = "_snapshot"  # only in states of num_workers > 0 loaders


def zephon_stateful_dataloader(loader: ZephonLoader, *, pin_memory: bool = False,
                               pin_memory_device: str = "") -> StatefulDataLoader:
    """A ``StatefulDataLoader`` that hands out the loader's micro-batches unchanged, no prefetch."""
    return StatefulDataLoader(ZephonIterableDataset(loader), batch_size=None, num_workers=0,
                              pin_memory=pin_memory, pin_memory_device=pin_memory_device)


def zephon_state_of(dataloader_state: dict[str, Any]) -> dict[str, Any]:
    """The Zephon loader state inside one ``StatefulDataLoader.state_dict()``."""
    if not isinstance(dataloader_state, dict):
        raise StateError(
            f"expected a StatefulDataLoader.state_dict() (a dict), got {type(dataloader_state).__name__}"
        )
    if MULTIPROCESS_SNAPSHOT in dataloader_state:
        raise StateError(
            "this StatefulDataLoader state comes from a loader with num_workers > 0; wrap a ZephonLoader with "
            "num_workers=0 (set num_workers in the Zephon config instead), e.g. zephon_stateful_dataloader(loader)"
        )
    if DATASET_STATE not in dataloader_state or FETCHER_STATE not in dataloader_state:
        raise StateError(
            f"not a single-process StatefulDataLoader state: keys {sorted(dataloader_state)} lack "
            f"{DATASET_STATE!r} / {FETCHER_STATE!r}"
        )
    dataset_state = dataloader_state[DATASET_STATE]
    fetcher_state = dataloader_state[FETCHER_STATE] or {}
    iter_state = fetcher_state.get(DATASET_ITER_STATE)
    if dataset_state is None:
        raise StateError(
            "the StatefulDataLoader state holds no dataset state: its dataset is not a ZephonIterableDataset "
            "(build it with zephon_stateful_dataloader(loader))"
        )
    # Both copies are taken at the same moment of the same loader; a difference means the
    # state was edited or assembled from two loaders, and loading it would apply the second.
    if iter_state is not None and iter_state != dataset_state:
        raise StateError(
            f"the StatefulDataLoader state's {DATASET_STATE!r} and {FETCHER_STATE!r}.{DATASET_ITER_STATE!r} "
            "differ; both must be the same Zephon state"
        )
    return dataset_state


def merge_dataloader_states(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The W per-rank ``StatefulDataLoader`` states of one step as one state any rank can load.

    The result has the shape of a single-process ``StatefulDataLoader`` state with the
    merged, topology-free Zephon state (:func:`loader.checkpoint.state.merge_rank_states`) as both the
    dataset and the iterator state, so ``dataloader.load_state_dict(merged)`` works on every
    rank of any world size. The states must be taken at the same step boundary (right after
    an optimizer step); a mid-step state is refused with the step it was in. Identical
    states (tensor-parallel peers) count once.
    """
    states = list(states)
    if not states:
        raise StateError("merge_dataloader_states needs the StatefulDataLoader state of every rank (got none)")
    merged_zephon = merge_rank_states([zephon_state_of(s) for s in states])
    merged = copy.deepcopy(states[0])
    merged[DATASET_STATE] = merged_zephon
    merged[FETCHER_STATE] = dict(merged[FETCHER_STATE] or {}, **{DATASET_ITER_STATE: copy.deepcopy(merged_zephon)})
    # torchdata counts yielded items per rank and uses the count only to fast-forward a
    # dataset that is not Stateful; the position is in the Zephon state, so drop the count.
    merged[NUM_YIELDED] = 0
    merged[SAMPLER_ITER_YIELDED] = 0
    return merged
