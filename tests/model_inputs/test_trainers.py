"""The recipes of docs/guides/model-inputs.md, run as written: HF ``ZephonTrainer`` with
``model_inputs`` passes each micro-batch whole and divides by the loader's step count (not its
own), and a step's summed micro-batch losses are the global batch's mean token loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tokenizers import Tokenizer  # noqa: E402

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.integrations.hf import HFIntegrationError, ZephonTrainer  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.integrations import hf_rank  # noqa: E402
from tests.integrations.hf_rank import training_arguments  # noqa: E402
from tests.model_inputs import hf_trainer_rank  # noqa: E402
from tests.model_inputs.models import tiny_llama  # noqa: E402
from tests.rank_launcher import launch_ranks  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> LoaderConfig:
    path = tmp_path_factory.mktemp("trainers") / "pre"
    write_dataset(str(path), synthetic_texts(80, seed=3, max_words=5), num_lanes=4, seed=1,
                  tokenizer=Tokenizer.from_file(default_tokenizer_path()))
    return LoaderConfig(datasets=[{"path": str(path)}], seq_len=64, global_batch_size=4, micro_batch_size=2, seed=5,
                        tokenizer=default_tokenizer_path(), model_inputs="causal_lm")


def global_mean_loss(model, micro_batches: list[dict]) -> float:
    packed = {k: torch.cat([b[k] for b in micro_batches]) for k in ("input_ids", "labels", "position_ids")}
    with torch.no_grad():
        logits = model(**packed, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             packed["labels"][:, 1:].reshape(-1), ignore_index=-100).item()


@pytest.mark.usefixtures("one_torch_thread")
def test_hf_trainer_takes_the_loaders_count_and_the_batch_whole(config, tmp_path):
    model = tiny_llama("sdpa")
    with ZephonLoader(config) as loader:
        expected = [next(loader) for _ in range(2)]  # step 0
    reference = global_mean_loss(model, expected)
    seen = []

    def record(module, args, kwargs, output):
        seen.append({"keys": sorted(kwargs), "num_items": int(kwargs["num_items_in_batch"]),
                     "loss": output.loss.item(), "use_cache": kwargs["use_cache"]})

    model.register_forward_hook(record, with_kwargs=True)
    args = training_arguments(str(tmp_path), config, 1, max_steps=STEPS, save_steps=STEPS, learning_rate=0.0)
    trainer = ZephonTrainer(model=model, args=args, zephon_loader=config)
    trainer.train()
    assert len(seen) == STEPS * 2
    assert set(seen[0]["keys"]) == set(expected[0]) and seen[0]["use_cache"] is False
    assert [s["num_items"] for s in seen[:2]] == [int(b["num_items_in_batch"]) for b in expected]
    assert abs(seen[0]["loss"] + seen[1]["loss"] - reference) <= 1e-5 * reference


def test_hf_trainer_refuses_picking_keys_of_a_laid_out_batch(config, tmp_path):
    args = training_arguments(str(tmp_path), config, 1, max_steps=1, save_steps=1)
    with pytest.raises(HFIntegrationError, match="already lays every micro-batch out"):
        ZephonTrainer(model=tiny_llama("sdpa"), args=args, zephon_loader=config, model_inputs=("input_ids",))


class _LitLlama:
    """The Lightning recipe of docs/guides/model-inputs.md around a tiny Llama; records the
    gradients of the first optimizer step (learning rate 0: the weights stay as built)."""

    @staticmethod
    def build():
        import lightning.pytorch as pl  # optional: the test skips without it

        class LitLlama(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = tiny_llama("sdpa")
                self.grads = None
                self.losses = []

            def training_step(self, batch, batch_idx):
                loss = self.model(**batch).loss
                self.losses.append(loss.item())
                # Lightning divides by accumulate_grad_batches, DDP averages over ranks; the loss
                # is already normalised by the whole step's loss tokens
                return loss * self.trainer.world_size * self.trainer.accumulate_grad_batches

            def on_before_optimizer_step(self, optimizer):
                if self.grads is None:
                    self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

        return LitLlama()


@pytest.mark.usefixtures("one_torch_thread")
def test_lightning_recipe_gives_the_global_mean_loss_gradient(config, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from loader.integrations.lightning import ZephonLightning  # imports lightning: only when it is installed

    with ZephonLoader(config) as loader:
        step0 = [next(loader) for _ in range(loader.topology.micro_steps_per_step)]
    reference = tiny_llama("sdpa")
    packed = {k: torch.cat([b[k] for b in step0]) for k in ("input_ids", "labels", "position_ids")}
    logits = reference(**packed, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                      packed["labels"][:, 1:].reshape(-1), ignore_index=-100).backward()
    module = _LitLlama.build()
    zephon = ZephonLightning(config)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=zephon.micro_steps_per_step(1),
                         callbacks=[zephon], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=zephon.train_dataloader())
    assert len(module.losses) == len(step0)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(module.grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hf_trainer_on_two_processes_trains_as_one(config, tmp_path):
    """Two gloo ranks with the loader's count (no second count, no gather) train like one process:
    the same summed losses step after step under plain SGD."""
    steps = 4
    config_path = tmp_path / "loader.json"
    config_path.write_text(json.dumps(config.to_dict()))
    out = tmp_path / "w2"
    launch_ranks(2, "tests.model_inputs.hf_trainer_rank", [str(config_path), str(tmp_path / "run2"), str(out), str(steps)],
                 timeout_s=200, preload=["transformers", "accelerate", "loader.integrations.hf"])
    ranks = [{"forwards": json.loads(Path(f"{out}.rank{r}").read_text())} for r in range(2)]
    one = [{"forwards": hf_trainer_rank.run(config, str(tmp_path / "run1"), 1, steps)}]
    expected = hf_rank.step_losses(config, 1, one)
    assert len(expected) == steps and expected[-1] < expected[0] - 0.05  # SGD moved the model
    assert hf_rank.step_losses(config, 2, ranks) == pytest.approx(expected, rel=1e-5)
