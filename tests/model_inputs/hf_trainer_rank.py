"""One rank of the 2-process ZephonTrainer run of test_trainers.py (``tests.rank_launcher``):
``argv`` = [config.json, output_dir, out, max_steps]. Plain SGD, so that a wrongly scaled loss
(a count taken twice, a missing world-size factor) changes the next steps' losses; Adam would
normalise a constant factor away."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run(config, output_dir: str, world_size: int, max_steps: int) -> list[dict]:
    from loader.integrations.hf import ZephonTrainer
    from loader.stages.tokenizer import load_tokenizer
    from tests.integrations.hf_rank import ForwardRecorder, build_model, training_arguments

    model = build_model(load_tokenizer(config.tokenizer).get_vocab_size(), config.seq_len)
    recorder = ForwardRecorder(model)
    args = training_arguments(output_dir, config, world_size, max_steps=max_steps, save_steps=max_steps,
                              optim="sgd", learning_rate=2.0, save_strategy="no")
    ZephonTrainer(model=model, args=args, zephon_loader=config).train()
    return recorder.forwards


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    from loader.config import LoaderConfig

    config_path, output_dir, out, max_steps = argv
    forwards = run(LoaderConfig.from_file(config_path), output_dir, int(os.environ["WORLD_SIZE"]), int(max_steps))
    Path(f"{out}.rank{os.environ['RANK']}").write_text(json.dumps(forwards))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
