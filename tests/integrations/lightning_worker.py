"""A real Lightning run on CPU that logs every micro-batch its ``training_step`` received.

Used in process by ``test_lightning.py`` and ``test_framework_paths.py`` (one process) and as one rank of a 2-process DDP
run (:func:`main`, forked by ``tests.rank_launcher`` with the environment torchrun sets). The model is a tiny
randomly initialised LM (embedding + linear head over the shipped tokenizer's vocabulary),
seeded identically everywhere. Its loss is the *sum* of the token losses over a constant
(``micro_batch_size x seq_len``), so the gradient of a step does not depend on how its
sequences are split over ranks and micro-batches; a step's loss is then the sum of its
micro-batches' losses on every topology, up to float rounding.

Each received micro-batch is logged as ``{"trainer_step", "phase", "step", "micro_step",
"loss", "rows": {global_index: hex of fingerprints.sequence_bytes}}``: ``trainer_step`` is
the optimizer step Lightning is accumulating (``trainer.global_step`` in training_step) and
``phase`` its place in the step by Lightning's counter, so grouping errors show.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tokenizers import Tokenizer

from loader.config import LoaderConfig
from loader.commands.fingerprints import sequence_bytes
from loader.integrations.lightning import ZephonLightning
from loader.pipeline import ZephonLoader
from loader.integrations.torch_data import ZephonIterableDataset

MODEL_SEED = 1234
EMBED_DIM = 16


@dataclass
class RunSpec:
    config_path: str
    max_steps: int
    accumulate_grad_batches: int
    root_dir: str
    devices: int = 1
    resume: Optional[str] = None
    ckpt_every: Optional[int] = None  # ModelCheckpoint(every_n_train_steps=...), save_top_k=-1
    save_at_micro_batches: list[int] = field(default_factory=list)  # trainer.save_checkpoint at these totals
    readme_recipe: bool = False  # DataLoader(ZephonIterableDataset(loader), batch_size=None), no callback
    wrap_in_dataloader: bool = False  # the callback, but its iterable inside a torch DataLoader
    # Without ZephonLightning: "module_returns_loader" (LightningModule.train_dataloader() returns
    # the ZephonLoader), "stateful_dataloader" (zephon_stateful_dataloader(loader) as train_dataloaders).
    wiring: str = ""
    config_overrides: dict[str, Any] = field(default_factory=dict)


class TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int, seq_len: int, micro_batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(MODEL_SEED)
        self.vocab_size = vocab_size
        self.embed = torch.nn.Embedding(vocab_size, EMBED_DIM)
        self.head = torch.nn.Linear(EMBED_DIM, vocab_size)
        self.received: list[dict[str, Any]] = []
        self.loss_scale = float(micro_batch_size * seq_len)

    def training_step(self, batch, batch_idx):
        vocab_size = self.vocab_size
        logits = self.head(self.embed(batch["input_ids"]))
        # labels == input_ids (HF convention): position p predicts token p + 1.
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab_size), batch["labels"][:, 1:].reshape(-1),
            ignore_index=-100, reduction="sum",
        ) / self.loss_scale
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        self.received.append({
            "trainer_step": self.trainer.global_step,
            "phase": (progress.current.ready - 1) % self.trainer.accumulate_grad_batches,
            "step": batch.get("step"), "micro_step": batch.get("micro_step"),
            "loss": loss.item(),
            "rows": {int(i): sequence_bytes(ids, lab).hex() for i, ids, lab in zip(
                batch["global_indices"].tolist(), batch["input_ids"].numpy(), batch["labels"].numpy())},
        })
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(spec: RunSpec) -> list[dict[str, Any]]:
    """One ``trainer.fit``; returns this rank's received micro-batches (JSON-able)."""
    config = LoaderConfig.from_file(spec.config_path, **spec.config_overrides)
    vocab = Tokenizer.from_file(config.tokenizer).get_vocab_size()
    model = TinyLM(vocab, config.seq_len, config.micro_batch_size)
    callbacks: list = []
    if spec.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(spec.root_dir, "ckpt"),
                                         every_n_train_steps=spec.ckpt_every, save_top_k=-1, save_last=False))
    if spec.save_at_micro_batches:
        wanted = set(spec.save_at_micro_batches)

        class SaveAt(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                done = trainer.fit_loop.epoch_loop.batch_progress.total.ready
                if done in wanted:
                    trainer.save_checkpoint(os.path.join(spec.root_dir, f"micro_{done}.ckpt"))

        callbacks.append(SaveAt())
    if spec.wiring == "module_returns_loader":
        model = _ModuleWithLoader(vocab, config.seq_len, config.micro_batch_size)
        model.config = config
        train_data = None
    elif spec.wiring == "stateful_dataloader":
        from loader.integrations.stateful_dataloader import zephon_stateful_dataloader

        train_data = zephon_stateful_dataloader(ZephonLoader(config))
    elif spec.wiring:
        raise ValueError(f"RunSpec.wiring={spec.wiring!r}")
    elif spec.readme_recipe:
        train_data = torch.utils.data.DataLoader(ZephonIterableDataset(ZephonLoader(config)), batch_size=None)
    else:
        zephon = ZephonLightning(config)
        callbacks.insert(0, zephon)
        train_data = zephon.train_dataloader()
        if spec.wrap_in_dataloader:
            train_data = torch.utils.data.DataLoader(_IterableDataset(train_data), batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=spec.devices, strategy="ddp" if spec.devices > 1 else "auto",
        max_steps=spec.max_steps, accumulate_grad_batches=spec.accumulate_grad_batches,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(spec.ckpt_every), default_root_dir=spec.root_dir, num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=train_data, ckpt_path=spec.resume)
    return model.received


class _ModuleWithLoader(TinyLM):
    """Lightning's own recipe: the module's ``train_dataloader()`` returns the loader."""

    config: LoaderConfig

    def train_dataloader(self):
        return ZephonLoader(self.config)


class _IterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, iterable) -> None:
        super().__init__()
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)


def main(argv: list[str]) -> int:
    """One DDP rank (``tests.rank_launcher.launch_ranks``): ``argv = [RunSpec as JSON, log path prefix]``.

    The launcher sets torchrun's environment; ``TORCHELASTIC_RUN_ID`` is what makes Lightning
    take the ranks from it (``TorchElasticEnvironment``) instead of launching processes itself.
    """
    spec = RunSpec(**json.loads(argv[0]))
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "zephon-lightning-test")
    torch.set_num_threads(1)  # OMP_NUM_THREADS comes too late: the forkserver imported torch
    received = train(spec)
    with open(f"{argv[1]}.rank{os.environ['RANK']}.json", "w") as fh:
        json.dump(received, fh)
    return 0
