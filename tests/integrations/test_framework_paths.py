"""Framework paths without Zephon's integration classes (``loader.integrations.framework_paths``).

Each test is a real framework run on CPU (tiny models, 1-3 steps, B=8, micro-batch 2,
seq_len 32) wired the way the framework suggests by itself, and shows the outcome is either
exactly Zephon's steps (``collect_fingerprints``) or a project error naming the integration:

- Lightning iterating the loader itself (``LightningModule.train_dataloader()`` returns the
  ``ZephonLoader``, or a torchdata ``StatefulDataLoader`` of it): exact without checkpoints;
  its first checkpoint is refused (the state would be one micro-batch ahead), and so is
  restoring a state saved that way;
- Lightning over ``DataLoader(ZephonIterableDataset(loader))``: exact without a resume; the
  resume is refused (Lightning saved no loader state: steps 0.. again);
- ``transformers.Trainer(train_dataset=ZephonIterableDataset(loader))``: refused (Trainer's
  DataLoader re-batches micro-batches); a Trainer subclass that hands accelerate the
  micro-batches is exact on one process and refused on two (gloo ranks), where accelerate
  dispatches rank 0's batches to every rank or shards each rank's stream.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from loader.commands.fingerprints import collect_fingerprints  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.errors import ConfigError, HFIntegrationError, LightningIntegrationError  # noqa: E402
from loader.integrations import framework_paths  # noqa: E402
from loader.integrations.torch_data import ZephonIterableDataset  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from tests.integrations import hf_rank  # noqa: E402
from tests.integrations.conftest import write_loader_config  # noqa: E402
from tests.integrations.framework_paths_rank import run_user_trainer  # noqa: E402
from tests.integrations.lightning_worker import RunSpec, train  # noqa: E402
from tests.rank_launcher import launch_ranks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GLOBAL_BATCH = 8
ACCUMULATE = 4  # micro-batches of 2 per step on one process
STEPS = 2
LAUNCH_TIMEOUT_S = 150
USE_LIGHTNING = "use ZephonLightning"
USE_TRAINER = "use ZephonTrainer"


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    return write_loader_config(tmp_path_factory.mktemp("framework_paths_data"), seq_len=32,
                               global_batch_size=GLOBAL_BATCH, micro_batch_size=2, seed=11, num_workers=0)


@pytest.fixture(scope="module")
def config(config_path) -> LoaderConfig:
    return LoaderConfig.from_file(config_path)


@pytest.fixture(scope="module")
def expected(config) -> dict[int, str]:
    results, _ = collect_fingerprints(config, world_size=1, end_step=STEPS)
    return {r.step: r.sha256 for r in results}


def lightning_steps(received: list[dict]) -> dict[int, str]:
    """``zephon fingerprints`` of the rows each optimizer step (as Lightning counted them) trained."""
    rows: dict[int, dict[int, bytes]] = {}
    for micro in received:
        rows.setdefault(micro["trainer_step"], {}).update({int(i): bytes.fromhex(h) for i, h in micro["rows"].items()})
    out = {}
    for step, by_index in rows.items():
        assert sorted(by_index) == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)), (step, sorted(by_index))
        out[step] = hashlib.sha256(b"".join(by_index[i] for i in sorted(by_index))).hexdigest()
    return out


# -- Lightning -------------------------------------------------------------------------------------
@pytest.mark.parametrize("wiring", ["module_returns_loader", "stateful_dataloader"])
def test_lightning_iterating_the_loader_itself_refuses_its_first_checkpoint(config_path, tmp_path, wiring):
    with pytest.raises(LightningIntegrationError, match=r"state_dict\(\).*one micro-batch ahead.*" + USE_LIGHTNING):
        train(RunSpec(config_path, STEPS, ACCUMULATE, str(tmp_path), ckpt_every=1, wiring=wiring))
    assert not list(tmp_path.glob("ckpt/*.ckpt"))  # no checkpoint that would resume one micro-batch late


def test_lightning_iterating_the_loader_itself_without_checkpoints_is_exact(config_path, tmp_path, expected):
    received = train(RunSpec(config_path, STEPS, ACCUMULATE, str(tmp_path), wiring="module_returns_loader"))
    assert len(received) == STEPS * ACCUMULATE
    assert lightning_steps(received) == expected


def test_lightning_restoring_a_state_saved_one_micro_batch_ahead_is_refused(config_path, tmp_path, monkeypatch):
    """A checkpoint as the bare loader wrote it before the save was refused: its restore is refused."""
    with monkeypatch.context() as patch:
        patch.setattr(framework_paths, "check_state_request", lambda: None)
        train(RunSpec(config_path, 1, ACCUMULATE, str(tmp_path / "a"), ckpt_every=1, wiring="module_returns_loader"))
    ckpt = tmp_path / "a" / "ckpt" / "epoch=0-step=1.ckpt"
    [saved] = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved["rank_position"] == GLOBAL_BATCH + 2  # step 0 and the micro-batch of step 1 the fetcher held
    with pytest.raises(LightningIntegrationError, match="restoring a Zephon loader state saved without ZephonLightning"):
        train(RunSpec(config_path, 2, ACCUMULATE, str(tmp_path / "b"), resume=str(ckpt), wiring="module_returns_loader"))


def test_lightning_resume_over_a_torch_dataloader_is_refused(config_path, tmp_path, expected):
    """``DataLoader(ZephonIterableDataset(loader))``: exact until a resume, which would restart at step 0."""
    first = train(RunSpec(config_path, 1, ACCUMULATE, str(tmp_path / "a"), ckpt_every=1, readme_recipe=True))
    assert lightning_steps(first) == {0: expected[0]}
    ckpt = tmp_path / "a" / "ckpt" / "epoch=0-step=1.ckpt"
    with pytest.raises(LightningIntegrationError, match="resumes at global step 1, but the Zephon loader it iterates "
                                                        "starts at step 0.*" + USE_LIGHTNING):
        train(RunSpec(config_path, 2, ACCUMULATE, str(tmp_path / "b"), resume=str(ckpt), readme_recipe=True))


# -- transformers.Trainer / accelerate -------------------------------------------------------------
def test_hf_trainer_with_its_own_train_dataloader_is_refused(config, tmp_path):
    run = run_user_trainer(config, str(tmp_path), wiring="train_dataset", max_steps=STEPS)
    name, message = run["error"]
    assert name == "HFIntegrationError"
    assert "stack several Zephon micro-batches" in message and "per_device_train_batch_size" in message
    assert USE_TRAINER in message


def test_trainer_subclass_handing_accelerate_micro_batches_on_one_process_is_exact(config, tmp_path):
    """Resumed too: Trainer saves no loader state and replays the trained batches of a fresh loader."""
    lines = [r.line() for r in collect_fingerprints(config, world_size=1, end_step=STEPS)[0]]
    run = run_user_trainer(config, str(tmp_path), wiring="prepare", max_steps=STEPS, save_steps=1)
    assert "error" not in run, run.get("error")
    assert len(run["forwards"]) == STEPS * ACCUMULATE
    assert hf_rank.step_fingerprints(config, 1, [run]) == lines
    resumed = run_user_trainer(config, str(tmp_path), wiring="prepare", max_steps=STEPS,
                               resume=str(tmp_path / "checkpoint-1"))
    assert hf_rank.step_fingerprints(config, 1, [resumed]) == lines[1:]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_accelerate_dispatching_or_sharding_on_two_processes_is_refused_on_every_rank(config_path, tmp_path):
    wirings = ("train_dataset", "prepare", "train_dataset_no_dispatch")
    out = tmp_path / "result"
    launch_ranks(2, "tests.integrations.framework_paths_rank",
                 [config_path, str(tmp_path / "runs"), str(out), ",".join(wirings), str(STEPS)],
                 timeout_s=LAUNCH_TIMEOUT_S, preload=["transformers", "accelerate", "loader.pipeline"])
    for rank in range(2):
        results = json.loads(Path(f"{out}.rank{rank}").read_text())
        for wiring in wirings:
            assert "error" in results[wiring], f"rank {rank}, {wiring}: trained {len(results[wiring]['forwards'])} " \
                                               "micro-batches instead of refusing"
            name, message = results[wiring]["error"]
            assert name == "HFIntegrationError" and USE_TRAINER in message, (rank, wiring, message)
            wanted = "IterableDatasetShard wraps" if wiring.endswith("no_dispatch") else "DataLoaderDispatcher iterates"
            assert f"accelerate's {wanted} the Zephon loader on 2 processes" in message, (rank, wiring, message)


# -- plain torch ---------------------------------------------------------------------------------------
def test_a_torch_dataloader_that_rebatches_micro_batches_is_refused(config):
    loader = ZephonLoader(config)
    with pytest.raises(ConfigError, match=r"stack several Zephon micro-batches.*batch_size=None"):
        next(iter(torch.utils.data.DataLoader(ZephonIterableDataset(loader), batch_size=2)))
    batch = next(iter(torch.utils.data.DataLoader(ZephonIterableDataset(loader), batch_size=None)))
    assert batch["input_ids"].shape == (config.micro_batch_size, config.seq_len)
    loader.close()
