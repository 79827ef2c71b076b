"""Hugging Face ``transformers.Trainer`` integration: Zephon's micro-batches, unchanged, checkpointed exactly.

::

    from loader.integrations.hf import ZephonTrainer

    args = TrainingArguments(output_dir="out", max_steps=1000, save_steps=100,
                             gradient_accumulation_steps=4)   # = loader.topology.micro_steps_per_step
    trainer = ZephonTrainer(model=model, args=args, zephon_loader=config)  # a LoaderConfig or a ZephonLoader
    trainer.train()                                  # or train(resume_from_checkpoint=True / "out/checkpoint-100")

What the subclass changes, and why (checked against transformers 5.24 / accelerate 1.15):

- **The train dataloader.** ``Trainer.get_train_dataloader`` builds
  ``DataLoader(dataset, batch_size=per_device_train_batch_size)`` (re-batching Zephon's
  micro-batches) and hands it to ``accelerator.prepare``, which for an ``IterableDataset``
  under several processes either dispatches rank 0's batches to every rank
  (``dispatch_batches``, the default there) or wraps the dataset in ``IterableDatasetShard``
  (every rank keeps a slice of each group of batches): both throw away the lanes Zephon
  gave each rank. ``ZephonTrainer`` yields the loader's micro-batches one by one
  (``batch_size=None``) through a single-process ``DataLoaderShard`` (device placement only;
  it is never sharded, split or dispatched), each reduced to ``model_inputs`` (default
  ``input_ids``, ``labels``, ``position_ids``: GPT-2 and other causal LMs of transformers 5
  take ``position_ids`` that restart at document starts, with no attention mask, as packed
  sequences and keep attention inside each document).
  An accelerator configured with ``dispatch_batches=True`` or ``split_batches=True`` is
  refused (those settings cannot be honoured); ``even_batches`` has no effect on it
  (the ranks agree on the end of finite data themselves).
- **Accumulation.** One optimizer step is ``loader.topology.micro_steps_per_step``
  micro-batches; ``gradient_accumulation_steps`` must equal it, else :class:`HFIntegrationError`.
- **Checkpoints.** ``ZephonCheckpointCallback`` writes ``checkpoint-N/zephon_state.json``: the
  merged, topology-free state as of step boundary ``N`` (``loader.global_state_dict(step=N)``,
  a collective every rank joins; rank 0 writes). accelerate's ``DataLoaderShard`` fetches
  one micro-batch ahead, so the loader's current state is ahead of the model when Trainer
  saves; the boundary state is not.
- **Resume.** ``train(resume_from_checkpoint=...)`` loads that file into the loader on
  every rank (any world size) before Trainer starts iterating. Trainer's own batch skipping
  (``skip_first_batches``) would skip the trained steps a second time, so ``ZephonTrainer``
  **switches it off** (``ignore_data_skip=True``, logged at construction) and refuses to
  train if it was switched back on.
- **Model inputs and the loss count.** With ``LoaderConfig.model_inputs`` set
  (:mod:`loader.model_inputs`) every micro-batch is already the model's arguments: it is passed
  whole (``model_inputs`` must then be left at its default), and Trainer's own count of the
  step's loss tokens (``_get_num_items_in_batch``: prefetched micro-batches, then an
  ``accelerator.gather`` over ranks) is replaced by the loader's ``num_items_in_batch``, which
  already covers every micro-batch of the step on every rank: no second count, no gather.
  Trainer multiplies the loss by the world size when ``average_tokens_across_devices`` (the
  default), cancelling DDP's gradient average; with it off the count is divided by the world
  size instead, so the gradient is the same either way.
- **Metrics.** Every training log (each ``logging_steps``) also holds the loader's
  ``loader.metrics()`` as ``zephon/...`` scalars (``log_zephon_metrics=False`` leaves them out).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator, Sequence, Union

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from loader.config import LoaderConfig
from loader.errors import HFIntegrationError, StateError
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import dumps, loads

log = logging.getLogger(__name__)

ZEPHON_STATE_NAME = "zephon_state.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
DEFAULT_MODEL_INPUTS = ("input_ids", "labels", "position_ids")


class ModelInputs(IterableDataset):
    """The loader's micro-batches, each reduced to the keys the model's ``forward`` takes."""

    def __init__(self, loader: ZephonLoader, keys: Sequence[str]) -> None:
        super().__init__()
        self.loader = loader
        self.keys = tuple(keys)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.loader.model_inputs is not None:  # laid out for the model already (loader.model_inputs)
            yield from self.loader
            return
        for batch in self.loader:
            yield {key: batch[key] for key in self.keys}


def _checkpoint_step(path: str) -> int:
    """The optimizer step a Trainer checkpoint was saved at (``global_step`` of its trainer state)."""
    trainer_state = os.path.join(path, TRAINER_STATE_NAME)
    try:
        with open(trainer_state) as fh:
            return int(json.load(fh)["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HFIntegrationError(f"cannot read global_step from {trainer_state}: {exc}") from None


def read_checkpoint_state(path: str) -> dict[str, Any]:
    """The merged loader state of Trainer checkpoint ``path``, checked against its ``global_step``."""
    state_path = os.path.join(path, ZEPHON_STATE_NAME)
    if not os.path.isfile(state_path):
        raise HFIntegrationError(
            f"{state_path} does not exist: checkpoint {path} was not written by ZephonTrainer, so it holds no "
            "loader state and resuming from it would train steps 0.. again. Resume from a checkpoint that "
            "ZephonTrainer saved"
        )
    with open(state_path) as fh:
        state = loads(fh.read())
    step = _checkpoint_step(path)
    batch = state["config"]["global_batch_size"]
    if state.get("next_global_index") != step * batch:
        raise StateError(
            f"{state_path} is at global index {state.get('next_global_index')!r}, but the checkpoint's "
            f"{TRAINER_STATE_NAME} says {step} optimizer steps were trained (index {step * batch} with "
            f"global_batch_size={batch}); the two files come from different points of training"
        )
    return state


class ZephonCheckpointCallback(TrainerCallback):
    """Writes ``checkpoint-N/zephon_state.json`` on every save: the merged state as of step boundary N.

    ``on_save`` runs on every rank; the gather is a collective, so every rank takes part and
    the processes that save Trainer's files (``args.should_save``: rank 0, or local rank 0
    of each node with ``save_on_each_node``) write it. The file is written to a temporary
    name and renamed, so a crash never leaves half a state.
    """

    def __init__(self, loader: ZephonLoader) -> None:
        self.loader = loader

    def on_save(self, args, state, control, **kwargs):
        merged = self.loader.global_state_dict(step=state.global_step)
        if args.should_save:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            target = os.path.join(folder, ZEPHON_STATE_NAME)
            with open(target + ".tmp", "w") as fh:
                fh.write(dumps(merged))
            os.replace(target + ".tmp", target)
        return control


class ZephonTrainer(Trainer):
    """A ``transformers.Trainer`` whose train data is a Zephon loader's stream, micro-batch for micro-batch.

    ``zephon_loader``: a :class:`~loader.config.LoaderConfig` (the loader is built here with
    ``dp_rank = args.process_index``, ``dp_world_size = args.world_size``, right for pure data
    parallelism and FSDP) or a :class:`~loader.pipeline.ZephonLoader` built by the caller
    (needed under tensor/context parallelism: pass its ``dp_rank`` / ``device_mesh``).
    ``model_inputs``: the batch keys passed to ``model(**inputs)``; each must be one of the
    config's ``batch_fields``. Do not pass ``train_dataset``. Hyperparameter search is not
    supported (states are written under ``args.output_dir``).
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *,
        zephon_loader: Union[ZephonLoader, LoaderConfig],
        model_inputs: Sequence[str] = DEFAULT_MODEL_INPUTS,
        log_zephon_metrics: bool = True,
        **kwargs: Any,
    ) -> None:
        if args is None:
            raise HFIntegrationError("ZephonTrainer needs args=TrainingArguments(..., max_steps=N, "
                                     "gradient_accumulation_steps=loader.topology.micro_steps_per_step)")
        if kwargs.get("train_dataset") is not None:
            raise HFIntegrationError(
                "ZephonTrainer takes its train data from zephon_loader; do not pass train_dataset as well"
            )
        _refuse_unsupported_arguments(args)
        if not args.ignore_data_skip:
            # Trainer would skip_first_batches() the trained steps on resume, on top of the
            # restored loader state: the data would jump ahead by as many steps as were trained.
            args.ignore_data_skip = True
            log.info(
                "ZephonTrainer set ignore_data_skip=True: on resume the loader state in checkpoint-N/%s puts "
                "the data at step N; Trainer's own batch skipping on top of it would skip those steps twice",
                ZEPHON_STATE_NAME,
            )
        super().__init__(model=model, args=args, **kwargs)
        _refuse_batch_dispatch(self.accelerator)
        if isinstance(zephon_loader, LoaderConfig):
            zephon_loader = ZephonLoader(zephon_loader, dp_rank=self.args.process_index,
                                         dp_world_size=self.args.world_size)
        elif not isinstance(zephon_loader, ZephonLoader):
            raise HFIntegrationError(
                f"zephon_loader must be a LoaderConfig or a ZephonLoader (got {type(zephon_loader).__name__})"
            )
        self.zephon_loader = zephon_loader
        self.model_inputs = tuple(model_inputs)
        self.log_zephon_metrics = log_zephon_metrics
        self._check_topology()
        if zephon_loader.model_inputs is not None and self.model_inputs != DEFAULT_MODEL_INPUTS:
            raise HFIntegrationError(
                f"model_inputs={list(self.model_inputs)} picks batch keys, but the loader config's model_inputs = "
                f"{zephon_loader.config.model_inputs!r} already lays every micro-batch out as the model's arguments; "
                "leave ZephonTrainer's model_inputs at its default"
            )
        missing = [k for k in self.model_inputs if k not in zephon_loader.config.batch_fields]
        if missing and zephon_loader.model_inputs is None:
            raise HFIntegrationError(
                f"model_inputs {list(self.model_inputs)} name {missing}, which the loader does not produce "
                f"(config batch_fields={list(zephon_loader.config.batch_fields)}); add them to batch_fields "
                "or leave them out of model_inputs"
            )
        if zephon_loader.config.step_states_kept < 2:
            # Trainer saves after step N with one micro-batch fetched ahead: with one micro-step
            # per step that is already the boundary of step N + 1, so N must still be kept.
            raise HFIntegrationError(
                f"loader config step_states_kept={zephon_loader.config.step_states_kept}: ZephonTrainer saves "
                "the state of the last step boundary while accelerate holds one micro-batch of the next step, "
                "which needs the newest 2 boundaries; set step_states_kept >= 2 (default 4)"
            )
        micro_batch_size = zephon_loader.config.micro_batch_size
        if self.args.per_device_train_batch_size != micro_batch_size:
            log.info("ZephonTrainer: per_device_train_batch_size=%d is not used; every micro-batch holds the "
                     "loader's micro_batch_size=%d sequences", self.args.per_device_train_batch_size, micro_batch_size)
        if hasattr(self, "_train_batch_size"):  # what Trainer logs and stores as the per-device batch size
            self._train_batch_size = micro_batch_size
        self.add_callback(ZephonCheckpointCallback(zephon_loader))

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, with this rank's loader metrics (``zephon/...``, :meth:`LoaderMetrics.flat
        <loader.metrics.LoaderMetrics.flat>`) added to every training log (the ones with a ``loss``),
        so every ``report_to`` integration (TensorBoard, W&B, ...) records them."""
        if self.log_zephon_metrics and "loss" in logs:
            logs = {**logs, **self.zephon_loader.metrics().flat()}
        super().log(logs, *args, **kwargs)

    def _check_topology(self) -> None:
        topology = self.zephon_loader.topology
        parallel = getattr(self.accelerator, "parallelism_config", None)
        peers = 1  # processes that share one data-parallel rank (tensor / context / sequence parallel)
        for name in ("tp_size", "cp_size", "sp_size"):
            peers *= int(getattr(parallel, name, None) or 1)
        dp_world_size = self.args.world_size // peers
        if topology.world_size != dp_world_size or (peers == 1 and topology.rank != self.args.process_index):
            raise HFIntegrationError(
                f"the ZephonLoader serves data-parallel rank {topology.rank} of {topology.world_size}, but this "
                f"Trainer process is rank {self.args.process_index} of {self.args.world_size}"
                + (f" ({peers} model-parallel peers per data-parallel rank)" if peers > 1 else "")
                + "; build it with ZephonLoader(config, dp_rank=..., dp_world_size=...) for this process, or "
                "pass zephon_loader=config and ZephonTrainer builds it"
            )
        accumulation = self.args.gradient_accumulation_steps
        if accumulation != topology.micro_steps_per_step:
            raise HFIntegrationError(
                f"gradient_accumulation_steps={accumulation}, but one Zephon step (global_batch_size="
                f"{self.zephon_loader.config.global_batch_size}) is {topology.micro_steps_per_step} micro-batches "
                f"of {self.zephon_loader.config.micro_batch_size} sequences on each of {topology.world_size} "
                f"data-parallel ranks; set TrainingArguments(gradient_accumulation_steps="
                f"{topology.micro_steps_per_step}), or change micro_batch_size in the loader config"
            )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The loader's count of the step's loss tokens (all micro-batches, all ranks) when it lays
        batches out (``model_inputs``); Trainer's own count and gather otherwise."""
        if self.zephon_loader.model_inputs is None or not batch_samples:
            return super()._get_num_items_in_batch(batch_samples, device)
        counts = {int(b["num_items_in_batch"]) for b in batch_samples}
        if len(counts) != 1:
            raise HFIntegrationError(
                f"the micro-batches Trainer grouped into one step carry different step counts {sorted(counts)}: "
                "its accumulation is not aligned with the loader's steps (gradient_accumulation_steps must be "
                f"{self.zephon_loader.topology.micro_steps_per_step} and training must resume at a step boundary)"
            )
        count = torch.tensor(counts.pop(), device=device)
        if not self.args.average_tokens_across_devices and self.args.world_size > 1:
            # Trainer leaves DDP's average over ranks in place: the per-rank share of the count
            return count / self.args.world_size
        return count

    # -- data ----------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """The loader's micro-batches one by one, never re-batched, sharded or dispatched."""
        from accelerate.data_loader import prepare_data_loader

        base = DataLoader(
            ModelInputs(self.zephon_loader, self.model_inputs), batch_size=None, num_workers=0,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        # num_processes=1: accelerate's per-process view of a loader that is already per rank;
        # it adds device placement and its gradient-state bookkeeping, and shards nothing.
        return prepare_data_loader(
            base, device=self.args.device, num_processes=1, process_index=0, split_batches=False,
            put_on_device=True, rng_types=None, dispatch_batches=False,
            non_blocking=bool(self.accelerator.dataloader_config.non_blocking),
        )

    # -- training --------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; a resume first loads the checkpoint's Zephon state on every rank."""
        if not self.args.ignore_data_skip:
            raise HFIntegrationError(
                "args.ignore_data_skip was set back to False after ZephonTrainer was built: on resume Trainer "
                "would skip the trained batches on top of the restored loader state (a double skip); leave "
                "ignore_data_skip=True"
            )
        _refuse_unsupported_arguments(self.args)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise HFIntegrationError(
                    f"train(resume_from_checkpoint=True) found no checkpoint-N directory in {self.args.output_dir}"
                )
        if resume_from_checkpoint:
            state = read_checkpoint_state(resume_from_checkpoint)
            self.zephon_loader.load_state_dict(state)
            log.info("ZephonTrainer: loader resumes at step %d from %s (Trainer's batch skipping is off)",
                     self.zephon_loader.step, os.path.join(resume_from_checkpoint, ZEPHON_STATE_NAME))
        elif self.zephon_loader.rank_position != 0:
            raise HFIntegrationError(
                f"the loader is at step {self.zephon_loader.step} ({self.zephon_loader.rank_position} sequences "
                "handed out on this rank) but Trainer starts at step 0; resume with "
                "train(resume_from_checkpoint=...) instead of loading or advancing the loader yourself"
            )
        return super().train(resume_from_checkpoint or None, *args, **kwargs)


def _refuse_unsupported_arguments(args: Any) -> None:
    if getattr(args, "auto_find_batch_size", False):
        raise HFIntegrationError(
            "auto_find_batch_size=True would change the micro-batch size behind Zephon's back; set "
            "micro_batch_size in the loader config instead (and leave auto_find_batch_size=False)"
        )
    if getattr(args, "dataloader_num_workers", 0):
        raise HFIntegrationError(
            f"dataloader_num_workers={args.dataloader_num_workers}: Zephon runs its own worker processes; set "
            "num_workers in the loader config and leave dataloader_num_workers=0"
        )
    config = getattr(args, "accelerator_config", None)
    if config is not None:
        _refuse_batch_dispatch(config)


def _refuse_batch_dispatch(settings: Any) -> None:
    """``settings``: an ``Accelerator`` or a ``TrainingArguments.accelerator_config``."""
    if getattr(settings, "dispatch_batches", None):
        raise HFIntegrationError(
            "accelerate is configured with dispatch_batches=True: rank 0 would read its own micro-batches and "
            "send them to every rank, so other ranks never train on their lanes; remove it from "
            "TrainingArguments(accelerator_config=...) or set accelerator_config={'dispatch_batches': False}"
        )
    if getattr(settings, "split_batches", False):
        raise HFIntegrationError(
            "accelerate is configured with split_batches=True: it would cut every Zephon micro-batch across "
            "the ranks; set accelerator_config={'split_batches': False} and choose micro_batch_size in the "
            "loader config"
        )
