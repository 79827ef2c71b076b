"""The trainer integrations hand ``loader.metrics()`` to the framework's logger."""

from __future__ import annotations

import pytest

from tests.audit.conftest import GLOBAL_BATCH


def test_hf_trainer_logs_the_loader_metrics(make_config, tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    from loader.integrations.hf import ZephonTrainer
    from loader.stages.tokenizer import load_tokenizer
    from tests.integrations import hf_rank

    config = make_config("concat", micro_batch_size=4)
    model = hf_rank.build_model(load_tokenizer(config.tokenizer).get_vocab_size(), config.seq_len)
    args = hf_rank.training_arguments(str(tmp_path), config, 1, max_steps=3, save_steps=100)
    logged = []

    class Keep(TrainerCallback):  # what every report_to integration receives
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append((state.global_step, dict(logs or {})))

    trainer = ZephonTrainer(model=model, args=args, zephon_loader=config, callbacks=[Keep()])
    loader = trainer.zephon_loader
    while loader.step < 2:
        next(loader)
    trainer.log({"loss": 0.5})  # what Trainer does every logging_steps
    trainer.log({"eval_loss": 0.5})  # not a training log: left alone
    (_, train_logs), (_, eval_logs) = logged
    assert train_logs["zephon/total/steps"] == 2.0 and train_logs["loss"] == 0.5
    assert train_logs["zephon/total/tokens/web"] == 2 * GLOBAL_BATCH * config.seq_len  # concat: no padding
    assert train_logs["zephon/last_step/sequences"] == GLOBAL_BATCH and "zephon/total/wait_s" in train_logs
    assert not any(k.startswith("zephon/") for k in eval_logs)
    loader.close()


def test_lightning_logs_the_loader_metrics_every_step(make_config, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import Logger

    from loader.integrations.lightning import ZephonLightning
    from tests.integrations.lightning_worker import TinyLM

    class Keep(Logger):
        name, version = "keep", 0
        experiment = None

        def __init__(self):
            super().__init__()
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    config = make_config("best_fit", micro_batch_size=4)
    zephon = ZephonLightning(config)
    logger = Keep()
    model = TinyLM(8000, config.seq_len, config.micro_batch_size)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, callbacks=[zephon],
                         logger=logger, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    trainer.fit(model, train_dataloaders=zephon.train_dataloader())
    steps = [m["zephon/total/steps"] for _, m in logger.rows if "zephon/total/steps" in m]
    assert steps and steps == sorted(steps) and steps[-1] >= 3
    last = [m for _, m in logger.rows if "zephon/total/padding_tokens" in m][-1]
    assert last["zephon/total/tokens/web"] + last["zephon/total/padding_tokens"] == \
        last["zephon/total/sequences"] * config.seq_len
