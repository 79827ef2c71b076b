"""A loader driven by a framework without Zephon's integration class: exact, or refused by name.

The integrations (:class:`~loader.integrations.lightning.ZephonLightning`,
:class:`~loader.integrations.hf.ZephonTrainer`) make a framework train on Zephon's steps
exactly. Wired the way each framework suggests by itself, a loader would train on other data
and exit 0. The loader cannot see the framework's objects, only who calls it, so these checks
read the Python call stack when the loader is iterated (``iter()``), asked for its current
state or given one, and recognise a framework by the module of a caller's frame: no
framework is imported here. A few frames are read once per ``iter()`` / ``state_dict()``,
never per micro-batch. What each path does (checked against lightning 2.6, transformers 5.25,
accelerate 1.16, torchdata 0.11)::

    path (no integration class)                              what happens
    Lightning iterates a ZephonLoader or a StatefulDataLoader
      and asks its state_dict() for a checkpoint             refused (its fetcher holds the next
                                                             micro-batch: the state is one ahead)
    Lightning restores a state into such a loader            refused (saved one micro-batch ahead)
    Lightning resumes at global step > 0 over a loader
      at step 0 (DataLoader(ZephonIterableDataset(...)):     refused (no loader state was saved:
      Lightning saves no state for a torch DataLoader)       steps 0.. would be trained again)
    a torch DataLoader with batch_size != None               refused (re-batches micro-batches;
      (HF Trainer's own train dataloader is one)             HF Trainer: use ZephonTrainer)
    accelerate's DataLoaderDispatcher, > 1 process           refused (rank 0's micro-batches for
      (accelerator.prepare of an IterableDataset)            every rank): use ZephonTrainer
    accelerate's IterableDatasetShard, > 1 process           refused (each rank keeps a slice)
    a Lightning run without checkpoints, accelerate on one
      process, a StatefulDataLoader in your own loop         exact: not refused

A frame of the integration's own module (``loader.integrations.lightning`` /
``loader.integrations.hf``) on the stack means the integration drives the loader, and the
check for that framework stands aside.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Iterator, Optional

from loader.errors import ConfigError, HFIntegrationError, LightningIntegrationError, ZephonError

LIGHTNING_MODULES = ("lightning.pytorch.", "pytorch_lightning.")
LIGHTNING_INTEGRATION = "loader.integrations.lightning"
HF_TRAINER_MODULES = ("transformers.trainer",)
HF_INTEGRATION = "loader.integrations.hf"
ACCELERATE_DATA_LOADER = "accelerate.data_loader"
# Modules of the torch DataLoader iterators (each has ``_auto_collation``: batch_size set).
DATALOADER_MODULES = ("torch.utils.data.dataloader", "torchdata.stateful_dataloader")
# accelerate classes that hand one rank's batches (or parts of them) to the other ranks.
DISPATCHER, DATASET_SHARD = "DataLoaderDispatcher", "IterableDatasetShard"

_USE_LIGHTNING = ("use ZephonLightning (loader.integrations.lightning): zephon = ZephonLightning(loader or config); "
                  "Trainer(callbacks=[zephon, ...], accumulate_grad_batches=zephon.micro_steps_per_step(world_size)); "
                  "trainer.fit(model, train_dataloaders=zephon.train_dataloader()), or return "
                  "zephon.train_dataloader() from LightningModule.train_dataloader()")
_USE_TRAINER = ("use ZephonTrainer (loader.integrations.hf): ZephonTrainer(model=..., args=..., zephon_loader=loader "
                "or config) hands every rank its own micro-batches, unchanged")


class _Stack:
    """The frames above a loader method, innermost first, with the module name of each."""

    def __init__(self, frame: Optional[FrameType]) -> None:
        self.frames: list[tuple[str, FrameType]] = []
        while frame is not None:
            self.frames.append((frame.f_globals.get("__name__") or "", frame))
            frame = frame.f_back

    def has(self, prefixes: tuple[str, ...]) -> bool:
        return any(name.startswith(prefixes) for name, _ in self.frames)

    def selves(self, prefixes: tuple[str, ...]) -> Iterator[Any]:
        """``self`` of each frame of these modules (the framework objects doing the call)."""
        for name, frame in self.frames:
            if name.startswith(prefixes):
                obj = frame.f_locals.get("self")
                if obj is not None:
                    yield obj

    @property
    def lightning_alone(self) -> bool:
        """Lightning drives the loader, and not through ZephonLightning."""
        return self.has(LIGHTNING_MODULES) and not self.has((LIGHTNING_INTEGRATION,))


def _caller_stack() -> _Stack:
    """From the frame of the loader method that called the check."""
    return _Stack(sys._getframe(2))


def check_iteration(loader: Any) -> Optional[ZephonError]:
    """Called by ``ZephonLoader.__iter__``: raises, or returns the refusal for the loader's first
    ``next()`` when Lightning iterates (an error inside Lightning's ``iter()`` of its loaders is
    hidden by a second one its teardown raises), or None."""
    stack = _caller_stack()
    try:
        _refuse_dispatch(stack)
        _refuse_rebatching(stack)
        if stack.lightning_alone:
            _refuse_lightning_restart(stack, loader)
    except ZephonError as refusal:
        if stack.has(LIGHTNING_MODULES):
            return refusal
        raise
    return None


def check_state_request() -> None:
    """Called by ``ZephonLoader.state_dict()`` without ``step`` (the loader's current position)."""
    stack = _caller_stack()
    if stack.lightning_alone:
        raise LightningIntegrationError(
            "Lightning asked for the Zephon loader's state_dict() (to save a checkpoint), but it iterates the loader "
            "without ZephonLightning: Lightning's fetcher already holds the next micro-batch, so the state is one "
            "micro-batch ahead of the model and a resume would skip it (under DDP only rank 0's state is saved). "
            f"To resume exactly, {_USE_LIGHTNING}"
        )


def check_state_load() -> None:
    """Called by ``ZephonLoader.load_state_dict``."""
    stack = _caller_stack()
    if stack.lightning_alone:
        raise LightningIntegrationError(
            "Lightning is restoring a Zephon loader state saved without ZephonLightning: Lightning's fetcher held "
            "the next micro-batch when it was saved, so it is one micro-batch ahead of the checkpoint's model and "
            f"the resume would skip that micro-batch. {_USE_LIGHTNING[0].upper()}{_USE_LIGHTNING[1:]} and "
            "resume from a checkpoint it wrote"
        )


def _refuse_dispatch(stack: _Stack) -> None:
    for obj in stack.selves((ACCELERATE_DATA_LOADER,)):
        kind = type(obj).__name__
        if kind == DISPATCHER:
            processes = getattr(getattr(obj, "state", None), "num_processes", 1)
            if processes > 1:
                raise HFIntegrationError(
                    f"accelerate's DataLoaderDispatcher iterates the Zephon loader on {processes} processes "
                    "(accelerator.prepare of a DataLoader over an IterableDataset dispatches by default): rank 0 "
                    "reads its own micro-batches and sends slices of them to every rank, so no other rank trains "
                    f"on its lanes. With transformers.Trainer, {_USE_TRAINER}; in your own accelerate loop, do not "
                    "pass the Zephon DataLoader to accelerator.prepare (each rank's loader already serves its lanes: "
                    "move the batches to the device yourself)"
                )
        elif kind == DATASET_SHARD and getattr(obj, "num_processes", 1) > 1:
            raise HFIntegrationError(
                f"accelerate's IterableDatasetShard wraps the Zephon loader on {obj.num_processes} processes "
                "(accelerator.prepare with dispatch_batches=False): every rank would keep only a slice of each "
                "group of its own micro-batches and drop the rest of its lanes. With transformers.Trainer, "
                f"{_USE_TRAINER}; in your own accelerate loop, do not pass the Zephon DataLoader to accelerator.prepare"
            )


def _refuse_rebatching(stack: _Stack) -> None:
    rebatching = next((obj for obj in stack.selves(DATALOADER_MODULES) if getattr(obj, "_auto_collation", False)),
                      None)
    if rebatching is None:
        return
    what = ("a torch DataLoader with batch_size set iterates the Zephon loader: it would stack several Zephon "
            "micro-batches into one batch (every Zephon batch is a whole micro-batch already)")
    if stack.has(HF_TRAINER_MODULES) and not stack.has((HF_INTEGRATION,)):
        raise HFIntegrationError(
            f"{what}. transformers.Trainer builds that DataLoader from train_dataset with "
            f"per_device_train_batch_size and skips trained batches on resume; {_USE_TRAINER}"
        )
    if stack.lightning_alone:
        raise LightningIntegrationError(f"{what}; {_USE_LIGHTNING}")
    raise ConfigError(
        f"{what}; wrap it as DataLoader(ZephonIterableDataset(loader), batch_size=None) or "
        "loader.integrations.stateful_dataloader.zephon_stateful_dataloader(loader), and set micro_batch_size in "
        "the Zephon config"
    )


def _refuse_lightning_restart(stack: _Stack, loader: Any) -> None:
    if loader.rank_position:
        return  # a later epoch of the same run, or a state Lightning loaded (check_state_load)
    for obj in stack.selves(LIGHTNING_MODULES):
        try:  # a LightningModule's .trainer raises while it is not attached
            trainer = getattr(obj, "trainer", None) or obj
            step = getattr(trainer, "global_step", None)
        except RuntimeError:
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            if step > 0:
                raise LightningIntegrationError(
                    f"Lightning resumes at global step {step}, but the Zephon loader it iterates starts at step 0: "
                    "it is not ZephonLightning's iterable (e.g. DataLoader(ZephonIterableDataset(loader)), for which "
                    "Lightning saves no loader state), so the run would train steps 0.. again. To resume exactly, "
                    f"{_USE_LIGHTNING}, and resume from a checkpoint it wrote"
                )
            return
