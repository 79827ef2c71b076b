"""One ``ZephonTrainer`` run under test: a tiny random GPT-2, every forward's inputs recorded.

Used in process by ``test_hf.py`` and, for the multi-process run, as each rank's
:func:`main` (started by ``tests.rank_launcher`` with torchrun's environment).

What is recorded is what the model's ``forward`` received (a forward hook with kwargs):
each row of ``input_ids`` / ``labels`` in the byte layout of ``zephon fingerprints``, the
keys it was called with, and the loss it returned (``float.hex``, so bits survive JSON).
:func:`step_fingerprints` places every recorded row at its global index using only the
documented ordering (sequence ``p`` of data-parallel rank ``r`` of ``W`` is global index
``r + p * W``) and hashes each step as ``collect_fingerprints`` does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

MODEL_SEED = 0


def build_model(vocab_size: int, seq_len: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(MODEL_SEED)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=seq_len, vocab_size=vocab_size,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


class ForwardRecorder:
    """Every training forward of ``model``: rows (hex, fingerprint layout), keys, loss bits."""

    def __init__(self, model) -> None:
        self.forwards: list[dict[str, Any]] = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        from loader.commands.fingerprints import sequence_bytes

        if not module.training:
            return
        rows = [sequence_bytes(ids, labels).hex()
                for ids, labels in zip(kwargs["input_ids"].numpy(), kwargs["labels"].numpy())]
        self.forwards.append({"keys": sorted(kwargs), "rows": rows, "loss": float(output.loss.detach()).hex()})


class StopAtStep(TrainerCallback):
    """Ends training after optimizer step ``step``: an interruption."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class PositionAtSave(TrainerCallback):
    """Sequences the loader had handed out when Trainer saved checkpoint N: ``{N: count}``."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.positions: dict[int, int] = {}

    def on_save(self, args, state, control, **kwargs):
        self.positions[state.global_step] = self.loader.rank_position
        return control


def training_arguments(output_dir: str, config, world_size: int, *, max_steps: int, save_steps: int, **overrides):
    from transformers import TrainingArguments

    options = dict(
        output_dir=output_dir, max_steps=max_steps, save_strategy="steps", save_steps=save_steps,
        logging_steps=1, report_to="none", use_cpu=True, learning_rate=1e-3, seed=0, disable_tqdm=True,
        dataloader_pin_memory=False, per_device_train_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.global_batch_size // (world_size * config.micro_batch_size),
    )
    options.update(overrides)
    return TrainingArguments(**options)


def run_trainer(config, output_dir: str, *, world_size: int = 1, max_steps: int, save_steps: int,
                stop_at: Optional[int] = None, resume: Optional[str] = None) -> dict[str, Any]:
    """Train, optionally resumed and/or interrupted; returns the recorded forwards and the first step."""
    from loader.integrations.hf import ZephonTrainer
    from loader.stages.tokenizer import load_tokenizer

    model = build_model(load_tokenizer(config.tokenizer).get_vocab_size(), config.seq_len)
    recorder = ForwardRecorder(model)
    args = training_arguments(output_dir, config, world_size, max_steps=max_steps, save_steps=save_steps)
    trainer = ZephonTrainer(model=model, args=args, zephon_loader=config,
                            callbacks=[StopAtStep(stop_at)] if stop_at is not None else None)
    at_save = PositionAtSave(trainer.zephon_loader)
    trainer.add_callback(at_save)
    trainer.train(resume_from_checkpoint=resume)
    first_step = 0 if resume is None else json.loads(Path(resume, "trainer_state.json").read_text())["global_step"]
    return {"first_step": first_step, "forwards": recorder.forwards, "final_step": trainer.state.global_step,
            "positions_at_save": at_save.positions}


def step_fingerprints(config, world_size: int, runs: list[dict[str, Any]]) -> list[str]:
    """``"STEP SHA256"`` per step from the rows each rank's model received (``runs[r]`` = rank r)."""
    from loader.commands.fingerprints import StepFingerprint

    micro, batch = config.micro_batch_size, config.global_batch_size
    per_rank = batch // world_size
    accumulation = per_rank // micro
    rows: dict[int, bytes] = {}
    first_steps = {run["first_step"] for run in runs}
    assert len(first_steps) == 1, f"ranks started at different steps {first_steps}"
    first = first_steps.pop()
    for rank, run in enumerate(runs):
        for k, forward in enumerate(run["forwards"]):
            step, micro_step = first + k // accumulation, k % accumulation
            assert len(forward["rows"]) == micro, f"rank {rank} forward {k}: {len(forward['rows'])} rows, not {micro}"
            for j, row in enumerate(forward["rows"]):
                position = step * per_rank + micro_step * micro + j
                rows[rank + position * world_size] = bytes.fromhex(row)
    steps = len(rows) // batch
    assert sorted(rows) == list(range(first * batch, (first + steps) * batch)), "rows do not cover whole steps"
    lines = []
    for step in range(first, first + steps):
        digest = hashlib.sha256()
        for index in range(step * batch, (step + 1) * batch):
            digest.update(rows[index])
        lines.append(StepFingerprint(step, digest.hexdigest()).line())
    return lines


def step_losses(config, world_size: int, runs: list[dict[str, Any]]) -> list[float]:
    """Per step, the sum of the micro-batch losses of all ranks: each is its token-loss sum over
    the step's token count (Trainer passes ``num_items_in_batch``), so the sum is the step's mean."""
    accumulation = config.global_batch_size // (world_size * config.micro_batch_size)
    steps = len(runs[0]["forwards"]) // accumulation
    return [math.fsum(float.fromhex(f["loss"]) for run in runs
                      for f in run["forwards"][step * accumulation:(step + 1) * accumulation])
            for step in range(steps)]


def main(argv: list[str]) -> int:
    """One rank (``tests.rank_launcher`` sets torchrun's environment first):
    ``argv`` = [config.json, output_dir, out.json, max_steps, save_steps, stop_at]."""
    import torch

    torch.set_num_threads(1)
    from loader.config import LoaderConfig

    config_path, output_dir, out_path, max_steps, save_steps, stop_at = argv
    result = run_trainer(LoaderConfig.from_file(config_path), output_dir, world_size=int(os.environ["WORLD_SIZE"]),
                         max_steps=int(max_steps), save_steps=int(save_steps), stop_at=int(stop_at))
    result["cpu_s"] = time.process_time()  # this rank's CPU since the fork (imports were done by the forkserver)
    Path(f"{out_path}.rank{os.environ['RANK']}").write_text(json.dumps(result))
    return 0
