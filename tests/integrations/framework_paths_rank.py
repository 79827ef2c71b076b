"""HF ``Trainer`` runs wired the way transformers and accelerate suggest by themselves, without ``ZephonTrainer``.

Used in process by ``test_framework_paths.py`` and as each rank of a 2-process gloo run
(:func:`main`, started by ``tests.rank_launcher`` with torchrun's environment). ``wiring``:

- ``"train_dataset"``: ``Trainer(train_dataset=ZephonIterableDataset(loader))``, Trainer's own
  train dataloader (``per_device_train_batch_size``, then ``accelerator.prepare``);
- ``"prepare"``: a ``Trainer`` subclass whose ``get_train_dataloader`` hands accelerate the
  loader's micro-batches: ``accelerator.prepare(DataLoader(ZephonIterableDataset(loader),
  batch_size=None))``;
- ``"train_dataset_no_dispatch"``: ``"train_dataset"`` with ``accelerator_config={"dispatch_batches":
  False}`` (under several processes accelerate then wraps the dataset in ``IterableDatasetShard``).

A run returns the recorded forwards (``hf_rank.ForwardRecorder``) or, when the loader
refused, ``{"error": [type name, message]}``, so a refused rank exits 0 and the launch does
not wait for a timeout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from loader.errors import ZephonError

WIRINGS = ("train_dataset", "prepare", "train_dataset_no_dispatch")


def run_user_trainer(config, output_dir: str, *, wiring: str, max_steps: int, world_size: int = 1,
                     save_steps: Optional[int] = None, resume: Optional[str] = None) -> dict[str, Any]:
    """One ``trainer.train(resume_from_checkpoint=resume)``; checkpoints every ``save_steps``."""
    from torch.utils.data import DataLoader
    from transformers import Trainer

    from loader.integrations.torch_data import ZephonIterableDataset
    from loader.pipeline import ZephonLoader
    from loader.stages.tokenizer import load_tokenizer
    from tests.integrations import hf_rank

    if wiring not in WIRINGS:
        raise ValueError(f"wiring={wiring!r}: one of {WIRINGS}")
    model = hf_rank.build_model(load_tokenizer(config.tokenizer).get_vocab_size(), config.seq_len)
    recorder = hf_rank.ForwardRecorder(model)
    overrides = {"accelerator_config": {"dispatch_batches": False}} if wiring.endswith("no_dispatch") else {}
    args = hf_rank.training_arguments(output_dir, config, world_size, max_steps=max_steps,
                                      save_steps=save_steps or max_steps, **overrides)
    dataset = ZephonIterableDataset(ZephonLoader(config, dp_rank=args.process_index, dp_world_size=world_size))

    class MicroBatchTrainer(Trainer):
        def get_train_dataloader(self):
            return self.accelerator.prepare(DataLoader(dataset, batch_size=None))

    trainer_class = MicroBatchTrainer if wiring == "prepare" else Trainer
    trainer = trainer_class(model=model, args=args, train_dataset=dataset)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except ZephonError as refusal:
        return {"error": [type(refusal).__name__, str(refusal)]}
    first_step = 0 if resume is None else json.loads(Path(resume, "trainer_state.json").read_text())["global_step"]
    return {"first_step": first_step, "forwards": recorder.forwards, "final_step": trainer.state.global_step}


def main(argv: list[str]) -> int:
    """One rank: ``argv`` = [config.json, output_dir, out path, comma-separated wirings, max_steps];
    writes ``{wiring: result}`` to ``<out path>.rank<RANK>``."""
    import torch

    torch.set_num_threads(1)
    from loader.config import LoaderConfig

    config_path, output_dir, out_path, wirings, max_steps = argv
    results = {wiring: run_user_trainer(LoaderConfig.from_file(config_path), os.path.join(output_dir, wiring),
                                        wiring=wiring, max_steps=int(max_steps),
                                        world_size=int(os.environ["WORLD_SIZE"]))
               for wiring in wirings.split(",")}
    Path(f"{out_path}.rank{os.environ['RANK']}").write_text(json.dumps(results))
    return 0
