"""PyTorch Lightning 2.x: Zephon's micro-batches, checkpointed as of the last optimizer step.

One object, :class:`ZephonLightning`, is both a ``Callback`` and the source of the train
iterable::

    zephon = ZephonLightning(config)            # or a ZephonLoader you built yourself
    trainer = L.Trainer(max_steps=N, callbacks=[zephon, ModelCheckpoint(...)],
                        accumulate_grad_batches=zephon.micro_steps_per_step(world_size))
    trainer.fit(model, train_dataloaders=zephon.train_dataloader(), ckpt_path=...)

What it guarantees, and why each part is needed (Lightning 2.6):

- **The checkpoint holds the global state as of the last optimizer step.** Lightning saves
  ``state_dict()`` of a train iterable that has ``state_dict``/``load_state_dict`` (under
  ``loops.fit_loop.state_dict.combined_loader``). Its fetcher has already fetched one more
  micro-batch when a checkpoint is taken, so the iterable saves
  ``loader.global_state_dict(step=trainer.global_step)``: the boundary state merged over all
  ranks (a collective). ``Trainer.save_checkpoint`` builds the checkpoint dict on every rank
  (only rank 0 writes it), so every rank takes part; a checkpoint taken on one rank alone
  would hang, as any collective does.
- **Lightning groups Zephon's micro-batches into Zephon's steps.** ``accumulate_grad_batches``
  must equal ``loader.topology.micro_steps_per_step`` (checked at ``setup``), and every
  micro-batch is checked on arrival: its ``step`` / ``micro_step`` must be the optimizer
  step Lightning is accumulating and the micro-batch's place in it.
- **A mid-accumulation checkpoint is mapped to the last step boundary.** Right after a resume
  ``ModelCheckpoint(every_n_train_steps=N)`` saves again before the first step is complete
  (Lightning issue #17903); a ``save_checkpoint`` from any hook can do the same. Gradients
  are not saved, so weights and optimizer are those of the boundary; the loader state is
  the boundary's; Lightning's batch counters are rewritten to the boundary's (and the
  mapping is logged). Resuming from it repeats nothing and skips nothing.
- **Any world size resumes.** The saved state is topology-free. Lightning restores its batch
  counters from the checkpoint and derives the accumulation phase from them, which is wrong
  when the micro-batches per step changed; on load they are rewritten to
  ``global_step x accumulate_grad_batches`` of the new run.

- **Metrics.** After every optimizer step the loader's ``loader.metrics()`` are logged as
  ``zephon/...`` scalars with ``LightningModule.log_dict`` (``log_metrics=False`` leaves them out).

An elastic resume (other world size or micro-batch size, same ``global_batch_size``) needs
``accumulate_grad_batches`` set to the new ``micro_steps_per_step`` = B / (W x micro-batch);
the loss must not depend on how a step's sequences are split into micro-batches (sum the
token losses and divide by a constant, or accept float-noise differences). Automatic
optimization only; iteration-based training (``max_steps``) in a single epoch.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from loader.config import LoaderConfig
from loader.errors import LightningIntegrationError
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import dumps, loads

log = logging.getLogger(__name__)

STATE_KIND = "zephon.lightning_train_iterable"
_BATCH_PROGRESS = "epoch_loop.batch_progress"
_EPOCH_LOOP_STATE = "epoch_loop.state_dict"


class ZephonTrainIterable:
    """The train iterable Lightning sees: Zephon's micro-batches, with the boundary state.

    ``state_dict()`` -> ``{"kind": STATE_KIND, "step": t, "state": "<JSON of the merged global
    state at the boundary before step t>"}``; the JSON text is the same bytes as
    ``zephon fingerprints --save-state t``. Made by :meth:`ZephonLightning.train_dataloader`;
    pass it to Lightning as is (a ``DataLoader`` around it hides its state from Lightning).
    """

    def __init__(self, integration: "ZephonLightning") -> None:
        self._integration = integration

    def __iter__(self):
        return iter(self._integration.loader)

    def state_dict(self) -> dict[str, Any]:
        return self._integration.global_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._integration.load_global_state(state)


class ZephonLightning(Callback):
    """Callback + train iterable for one ``ZephonLoader`` (see the module docstring).

    ``source``: a :class:`LoaderConfig` (the loader is built in ``setup`` with
    ``dp_rank=trainer.global_rank, dp_world_size=trainer.world_size``, i.e. pure data
    parallelism), or a :class:`ZephonLoader` you built (for tensor/pipeline parallelism, with
    ``dp_rank``/``dp_world_size`` or a device mesh). ``check_batches``: verify every
    micro-batch's ``step``/``micro_step`` against Lightning's counters (cheap; keep it on).
    """

    def __init__(self, source: Union[LoaderConfig, ZephonLoader], *, check_batches: bool = True,
                 log_metrics: bool = True) -> None:
        if isinstance(source, ZephonLoader):
            self.config, self._loader = source.config, source
        elif isinstance(source, LoaderConfig):
            self.config, self._loader = source, None
        else:
            raise LightningIntegrationError(
                f"ZephonLightning takes a LoaderConfig or a ZephonLoader (got {type(source).__name__})"
            )
        self.check_batches = check_batches
        self.log_metrics = log_metrics
        self._iterable = ZephonTrainIterable(self)
        self._trainer: Optional[pl.Trainer] = None

    # -- what the user calls -------------------------------------------------------------
    @property
    def loader(self) -> ZephonLoader:
        if self._loader is None:
            raise LightningIntegrationError(
                "the Zephon loader is built when the Trainer sets up (it needs the trainer's rank and "
                "world size): add this ZephonLightning to Trainer(callbacks=[...]) and call trainer.fit"
            )
        return self._loader

    def train_dataloader(self) -> ZephonTrainIterable:
        """The iterable to pass as ``train_dataloaders=`` (or return from ``train_dataloader()``)."""
        return self._iterable

    def micro_steps_per_step(self, world_size: int) -> int:
        """``accumulate_grad_batches`` for ``world_size`` data-parallel ranks: B / (W x micro-batch)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise LightningIntegrationError(f"micro_steps_per_step takes a world size >= 1 (got {world_size!r})")
        per_rank, rest = divmod(self.config.global_batch_size, world_size * self.config.micro_batch_size)
        if rest or per_rank == 0:
            raise LightningIntegrationError(
                f"global_batch_size={self.config.global_batch_size} is not a multiple of world_size x "
                f"micro_batch_size = {world_size} x {self.config.micro_batch_size}; change micro_batch_size "
                "or the number of processes"
            )
        return per_rank

    # -- state (called by ZephonTrainIterable) -------------------------------------------
    def global_state(self) -> dict[str, Any]:
        trainer = self._require_trainer("save a checkpoint")
        step = trainer.global_step
        # A collective: every rank builds the checkpoint dict (Trainer.save_checkpoint).
        state = self.loader.global_state_dict(step=step)
        return {"kind": STATE_KIND, "step": step, "state": dumps(state)}

    def load_global_state(self, saved: Any) -> None:
        trainer = self._require_trainer("resume")
        if not isinstance(saved, dict) or saved.get("kind") != STATE_KIND:
            raise LightningIntegrationError(
                f"the checkpoint's train-iterable state is not a ZephonLightning state (got "
                f"{_describe(saved)}); resume only from checkpoints of a run that used "
                "ZephonLightning.train_dataloader()"
            )
        state = loads(saved["state"])
        step = state["next_global_index"] // self.config.global_batch_size
        if step != trainer.global_step:
            raise LightningIntegrationError(
                f"the checkpoint's Zephon state resumes at step {step} but its Lightning global_step is "
                f"{trainer.global_step}: the checkpoint was not written by ZephonLightning as is"
            )
        self.loader.load_state_dict(state)

    # -- Callback hooks --------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        if self._loader is None:
            self._loader = ZephonLoader(self.config, dp_rank=trainer.global_rank, dp_world_size=trainer.world_size)
        elif self._loader.dp_group is None and (self._loader.topology.rank, self._loader.topology.world_size) != (
                trainer.global_rank, trainer.world_size):
            raise LightningIntegrationError(
                f"the ZephonLoader is rank {self._loader.topology.rank} of {self._loader.topology.world_size} "
                f"but the Trainer runs this process as rank {trainer.global_rank} of {trainer.world_size}: build "
                "the loader inside the launched processes with dp_rank/dp_world_size (or device_mesh=...), or "
                "pass the LoaderConfig to ZephonLightning and let it build the loader"
            )
        if not pl_module.automatic_optimization:
            raise LightningIntegrationError(
                "ZephonLightning needs automatic optimization (Lightning groups the micro-batches into "
                "optimizer steps); with manual optimization save loader.global_state_dict(step=...) yourself"
            )
        if self.config.step_states_kept < 2:
            # With one micro-batch per step the fetcher already holds the whole next step when
            # a checkpoint is taken: the boundary before it is the second newest.
            raise LightningIntegrationError(
                f"step_states_kept={self.config.step_states_kept} in the Zephon config: Lightning's fetcher runs "
                "one micro-batch ahead, which can be a whole step; set step_states_kept >= 2 (default 4)"
            )
        wanted = self.loader.topology.micro_steps_per_step
        if trainer.accumulate_grad_batches != wanted:
            topo = self.loader.topology
            raise LightningIntegrationError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) does not match Zephon's "
                f"micro-batches per optimizer step: global_batch_size {topo.global_batch_size} / (world size "
                f"{topo.world_size} x micro_batch_size {topo.micro_batch_size}) = {wanted}. Set "
                f"Trainer(accumulate_grad_batches={wanted}) (after an elastic resume too), or change "
                "micro_batch_size in the Zephon config"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not any(it is self._iterable for it in _flatten(trainer.train_dataloader)):
            raise LightningIntegrationError(
                "trainer.fit is not iterating ZephonLightning.train_dataloader() itself (got "
                f"{_describe(trainer.train_dataloader)}): Lightning would save no loader state, and a resume "
                "would train steps 0.. again. Pass train_dataloaders=zephon.train_dataloader() unwrapped "
                "(no torch DataLoader around it: Zephon batches, pins and prefetches itself)"
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # A batch laid out for the model (model_inputs) holds no step keys to check.
        if not self.check_batches or not isinstance(batch, dict) or "step" not in batch:
            return
        k = trainer.accumulate_grad_batches
        # The counter was incremented for this batch already (training_epoch_loop.advance).
        phase = (trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1) % k
        if (batch["step"], batch["micro_step"]) != (trainer.global_step, phase):
            raise LightningIntegrationError(
                f"Lightning is about to train micro-batch {phase} of optimizer step {trainer.global_step} on "
                f"Zephon's micro-batch {batch['micro_step']} of step {batch['step']}: the model would train "
                "on other batches than the loader's steps. Was the loader iterated outside of Lightning, or "
                "its state loaded by hand?"
            )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After the last micro-batch of each optimizer step: this rank's loader metrics
        (``zephon/...``) through ``LightningModule.log_dict``, so the trainer's loggers record
        them every ``log_every_n_steps``."""
        if not (self.log_metrics and self._loader is not None and isinstance(batch, dict)):
            return
        if "micro_step" in batch:
            last_of_step = batch["micro_step"] == trainer.accumulate_grad_batches - 1
        else:  # laid out for the model (model_inputs): no step keys; Lightning's own count of batches
            last_of_step = trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0
        if last_of_step:
            pl_module.log_dict(self._loader.metrics().flat(), on_step=True, on_epoch=False)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = fit_loop.get(_BATCH_PROGRESS)
        if progress is None:
            return
        boundary = trainer.global_step * trainer.accumulate_grad_batches
        if progress["total"]["ready"] != boundary:
            log.info(
                "checkpoint at global step %d taken mid-accumulation (%d micro-batches trained, step "
                "boundary %d): saved as of the boundary (weights and optimizer are the boundary's; "
                "Lightning's batch counters and the Zephon state are set to it)",
                trainer.global_step, progress["total"]["ready"], boundary,
            )
            _set_batch_counters(fit_loop, boundary, global_step=trainer.global_step)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # validate/test/predict from a checkpoint: no data state
            return
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        states = fit_loop.get("state_dict", {}).get("combined_loader") or []
        if not any(isinstance(s, dict) and s.get("kind") == STATE_KIND for s in states):
            raise LightningIntegrationError(
                f"the checkpoint (global step {checkpoint.get('global_step')}) holds no Zephon loader state "
                "(it was written by a run without ZephonLightning.train_dataloader(), e.g. a torch "
                "DataLoader around ZephonIterableDataset); resuming would train from step 0 again. "
                "Resume from a checkpoint written with ZephonLightning"
            )
        progress = fit_loop.get(_BATCH_PROGRESS)
        step = int(checkpoint.get("global_step", 0))
        boundary = step * trainer.accumulate_grad_batches
        if progress is not None and progress["total"]["ready"] != boundary:
            # The accumulation phase is `batch_progress.current.ready % accumulate_grad_batches`:
            # with another number of micro-batches per step the saved count is not a boundary.
            log.info("resuming at step %d with accumulate_grad_batches=%d: Lightning's batch counters "
                     "set from %d to %d micro-batches", step, trainer.accumulate_grad_batches,
                     progress["total"]["ready"], boundary)
            _set_batch_counters(fit_loop, boundary, global_step=step)

    def state_dict(self) -> dict[str, Any]:
        """For the record: the topology the checkpoint was written with (nothing is restored from it)."""
        if self._loader is None:
            return {}
        topo = self._loader.topology
        return {"world_size": topo.world_size, "micro_steps_per_step": topo.micro_steps_per_step}

    def _require_trainer(self, what: str) -> pl.Trainer:
        if self._trainer is None:
            raise LightningIntegrationError(
                f"cannot {what}: this ZephonLightning is not attached to a Trainer; pass it in "
                "Trainer(callbacks=[zephon, ...]) as well as train_dataloaders=zephon.train_dataloader()"
            )
        return self._trainer


def _set_batch_counters(fit_loop: dict[str, Any], boundary: int, *, global_step: int) -> None:
    """Rewrite the saved batch counters as if the checkpoint had been taken at micro-batch ``boundary``.

    Keeps the shape Lightning uses to tell where it saved: ``completed == ready - 1`` for a save
    in ``on_train_batch_end`` (completed on restore), ``completed == ready`` for one after it.
    """
    progress = fit_loop[_BATCH_PROGRESS]
    total, current = progress["total"], progress["current"]
    if current["ready"] != total["ready"]:
        raise LightningIntegrationError(
            f"cannot align Lightning's batch counters for a resume in epoch > 0 (this epoch "
            f"{current['ready']} micro-batches, in total {total['ready']}): with Zephon train in one "
            "epoch with max_steps (its stream does not end unless the data is finite)"
        )
    after_batch_end = total["completed"] == total["ready"] - 1 and boundary > 0
    for tracker in (total, current):
        tracker.update(ready=boundary, started=boundary, processed=boundary,
                       completed=boundary - 1 if after_batch_end else boundary)
    epoch_state = fit_loop.get(_EPOCH_LOOP_STATE)
    if isinstance(epoch_state, dict) and "_batches_that_stepped" in epoch_state:
        # Counts logged optimizer steps; a save in on_train_batch_end has not counted its own yet.
        epoch_state["_batches_that_stepped"] = global_step - 1 if after_batch_end else global_step


def _flatten(iterables: Any) -> list:
    if isinstance(iterables, (list, tuple)):
        return [x for it in iterables for x in _flatten(it)]
    if isinstance(iterables, dict):
        return [x for it in iterables.values() for x in _flatten(it)]
    return [iterables]


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:6]}"
    return type(value).__name__


__all__ = ["LightningIntegrationError", "ZephonLightning", "ZephonTrainIterable"]
