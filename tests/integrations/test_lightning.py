"""``loader.integrations.lightning`` in real Lightning runs on CPU, checked against ``zephon fingerprints``.

Every micro-batch ``training_step`` received is hashed exactly like ``zephon fingerprints``
hashes a step (sequences of the step in global-index order, ``sequence_bytes`` each) and
compared with ``collect_fingerprints(config, world_size=1)``; the step a micro-batch is
attributed to is the optimizer step *Lightning* was accumulating, so a mis-grouping after a
resume fails the comparison. Runs (tiny LM, AdamW, B=8, micro-batch 2, L=8, seq_len 32):

- uninterrupted, 6 steps (one process, accumulate 4);
- checkpoint at step 3 (``ModelCheckpoint(every_n_train_steps=3)``), resumed with
  ``ckpt_path=``: same batches, bit-identical losses; the resumed run's own step-3 save
  right after the resume (Lightning issue #17903, mid-accumulation) and a
  ``trainer.save_checkpoint`` in the middle of a step both resume at their step boundary;
- elastic: 2 DDP processes (gloo, accumulate 2) checkpoint at step 3; 1 process resumes
  with accumulate 4: same batches, losses within float noise;
- refusals: accumulation mismatch, ``step_states_kept < 2``, a checkpoint without Zephon
  state (the old README recipe), a ``DataLoader`` around the iterable.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.commands.fingerprints import collect_fingerprints  # noqa: E402
from loader.integrations.lightning import STATE_KIND, LightningIntegrationError, ZephonLightning  # noqa: E402
from loader.checkpoint.state import dumps, loads  # noqa: E402
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.integrations.lightning_worker import RunSpec, train  # noqa: E402
from tests.rank_launcher import launch_ranks  # noqa: E402

STEPS = 6
STOP = 3
GLOBAL_BATCH = 8
MICRO_BATCH = 2
ACCUMULATE_W1 = GLOBAL_BATCH // MICRO_BATCH  # micro-batches per step on one process
ACCUMULATE_W2 = GLOBAL_BATCH // (2 * MICRO_BATCH)
LAUNCH_TIMEOUT_S = 90
LOSS_RTOL = 1e-5  # float noise of a 2-rank gradient all-reduce vs one process


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: as in the DDP ranks, and 2 cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("lightning_data")
    write_dataset(str(root / "data"), synthetic_texts(160, seed=7, max_words=40), num_lanes=8, seed=3,
                  tokenizer=Tokenizer.from_file(default_tokenizer_path()), files_per_lane=2, row_group_rows=4)
    path = root / "loader.json"
    path.write_text(json.dumps(dict(
        datasets=[{"path": str(root / "data")}], seq_len=32, global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH, seed=11, tokenizer=default_tokenizer_path(), num_workers=0,
    )))
    return str(path)


@pytest.fixture(scope="module")
def expected(config_path) -> dict[int, str]:
    results, _ = collect_fingerprints(LoaderConfig.from_file(config_path), world_size=1, end_step=STEPS)
    return {r.step: r.sha256 for r in results}


@pytest.fixture(scope="module")
def reference(config_path, tmp_path_factory) -> tuple[list[dict], Path]:
    """The uninterrupted run; it also saves a checkpoint mid-step 2 (after 10 micro-batches)."""
    root = tmp_path_factory.mktemp("lightning_reference")
    received = train(RunSpec(config_path, STEPS, ACCUMULATE_W1, str(root), save_at_micro_batches=[10]))
    return received, root / "micro_10.ckpt"


# -- helpers ---------------------------------------------------------------------------------
def step_fingerprints(*rank_logs: list[dict]) -> dict[int, str]:
    """``zephon fingerprints`` of what the model received, per optimizer step as Lightning counted them."""
    rows: dict[int, dict[int, bytes]] = {}
    for log in rank_logs:
        for micro in log:
            step_rows = rows.setdefault(micro["trainer_step"], {})
            for index, hex_bytes in micro["rows"].items():
                assert int(index) not in step_rows, f"sequence {index} trained twice in step {micro['trainer_step']}"
                step_rows[int(index)] = bytes.fromhex(hex_bytes)
    out = {}
    for step, by_index in rows.items():
        assert sorted(by_index) == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)), \
            f"step {step}: the model trained global indices {sorted(by_index)}"
        out[step] = hashlib.sha256(b"".join(by_index[i] for i in sorted(by_index))).hexdigest()
    return out


def assert_grouped_as_zephon(log: list[dict]) -> None:
    for micro in log:
        assert (micro["step"], micro["micro_step"]) == (micro["trainer_step"], micro["phase"]), micro


def step_losses(*rank_logs: list[dict]) -> dict[int, float]:
    """A step's loss: the sum of its micro-batches' losses (token-loss sums over a constant)."""
    losses: dict[int, float] = {}
    for log in rank_logs:
        for micro in log:
            losses[micro["trainer_step"]] = losses.get(micro["trainer_step"], 0.0) + micro["loss"]
    return losses


def saved_zephon_state(ckpt_path: Path) -> tuple[dict, dict]:
    checkpoint = torch.load(ckpt_path, weights_only=False)
    fit_loop = checkpoint["loops"]["fit_loop"]
    [saved] = fit_loop["state_dict"]["combined_loader"]
    assert saved["kind"] == STATE_KIND
    return saved, fit_loop


# -- one process -----------------------------------------------------------------------------
def test_uninterrupted_run_trains_zephon_global_batches(reference, expected):
    received, _ = reference
    assert len(received) == STEPS * ACCUMULATE_W1
    assert_grouped_as_zephon(received)
    assert step_fingerprints(received) == expected


def test_resume_on_the_same_world_size_is_exact(config_path, reference, expected, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loader.integrations.lightning")
    ref, _ = reference
    first = train(RunSpec(config_path, STOP, ACCUMULATE_W1, str(tmp_path / "a"), ckpt_every=STOP))
    assert [m["loss"] for m in first] == [m["loss"] for m in ref[: len(first)]]
    ckpt = tmp_path / "a" / "ckpt" / f"epoch=0-step={STOP}.ckpt"
    saved, fit_loop = saved_zephon_state(ckpt)
    # The global boundary state, byte for byte what `zephon fingerprints --save-state 3` writes,
    # although Lightning's fetcher had fetched a micro-batch of step 3 already.
    _, boundary = collect_fingerprints(LoaderConfig.from_file(config_path), end_step=STOP, save_state_step=STOP)
    assert saved["step"] == STOP and saved["state"] == dumps(boundary)
    assert "rank" not in loads(saved["state"])

    resumed = train(RunSpec(config_path, STEPS, ACCUMULATE_W1, str(tmp_path / "b"), ckpt_every=STOP,
                            resume=str(ckpt)))
    assert_grouped_as_zephon(resumed)
    assert sorted(step_fingerprints(resumed)) == list(range(STOP, STEPS))  # no step repeated or skipped
    assert step_fingerprints(resumed) == {s: expected[s] for s in range(STOP, STEPS)}
    assert [m["loss"] for m in resumed] == [m["loss"] for m in ref[STOP * ACCUMULATE_W1:]]  # bit-identical

    # Lightning #17903: the resumed run's ModelCheckpoint saved step 3 again after one more
    # micro-batch. It is saved as of the step boundary, and resumes there.
    assert "global step 3 taken mid-accumulation (13 micro-batches trained, step boundary 12)" in caplog.text
    again = tmp_path / "b" / "ckpt" / f"epoch=0-step={STOP}.ckpt"
    saved_again, fit_loop_again = saved_zephon_state(again)
    assert saved_again["state"] == saved["state"]
    assert fit_loop_again["epoch_loop.batch_progress"] == fit_loop["epoch_loop.batch_progress"]
    third = train(RunSpec(config_path, STOP + 1, ACCUMULATE_W1, str(tmp_path / "c"), resume=str(again)))
    assert step_fingerprints(third) == {STOP: expected[STOP]}
    assert [m["loss"] for m in third] == [m["loss"] for m in ref[STOP * ACCUMULATE_W1:(STOP + 1) * ACCUMULATE_W1]]


def test_checkpoint_in_the_middle_of_a_step_resumes_at_its_boundary(config_path, reference, expected, tmp_path):
    ref, mid_step = reference  # saved after 10 micro-batches: 2 into step 2
    saved, fit_loop = saved_zephon_state(mid_step)
    assert saved["step"] == 2
    assert fit_loop["epoch_loop.batch_progress"]["total"]["ready"] == 2 * ACCUMULATE_W1
    resumed = train(RunSpec(config_path, 4, ACCUMULATE_W1, str(tmp_path), resume=str(mid_step)))
    assert_grouped_as_zephon(resumed)
    assert step_fingerprints(resumed) == {2: expected[2], 3: expected[3]}
    assert [m["loss"] for m in resumed] == [m["loss"] for m in ref[2 * ACCUMULATE_W1:4 * ACCUMULATE_W1]]


def test_accumulation_mismatch_is_refused(config_path, tmp_path):
    mismatch = r"accumulate_grad_batches=2\) does not match .* = 4\. Set Trainer\(accumulate_grad_batches=4\)"
    with pytest.raises(LightningIntegrationError, match=mismatch):
        train(RunSpec(config_path, 1, 2, str(tmp_path)))
    zephon = ZephonLightning(LoaderConfig.from_file(config_path))
    assert [zephon.micro_steps_per_step(w) for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(LightningIntegrationError, match="not a multiple of world_size x micro_batch_size = 3 x 2"):
        zephon.micro_steps_per_step(3)


def test_too_few_kept_step_states_are_refused(config_path, tmp_path):
    with pytest.raises(LightningIntegrationError, match="step_states_kept=1 .* set step_states_kept >= 2"):
        train(RunSpec(config_path, 1, ACCUMULATE_W1, str(tmp_path), config_overrides={"step_states_kept": 1}))


def test_checkpoint_without_zephon_state_is_refused(config_path, tmp_path):
    """The old README recipe saves no loader state: resuming from it must not train from step 0."""
    train(RunSpec(config_path, 1, ACCUMULATE_W1, str(tmp_path / "old"), ckpt_every=1, readme_recipe=True))
    ckpt = tmp_path / "old" / "ckpt" / "epoch=0-step=1.ckpt"
    assert "combined_loader" not in torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    with pytest.raises(LightningIntegrationError, match="holds no Zephon loader state"):
        train(RunSpec(config_path, 2, ACCUMULATE_W1, str(tmp_path / "new"), resume=str(ckpt)))


def test_iterable_wrapped_in_a_dataloader_is_refused(config_path, tmp_path):
    with pytest.raises(LightningIntegrationError, match="not iterating ZephonLightning.train_dataloader"):
        train(RunSpec(config_path, 1, ACCUMULATE_W1, str(tmp_path), wrap_in_dataloader=True))


# -- two processes, then one ---------------------------------------------------------------------
def launch_ddp(world_size: int, spec: RunSpec, out_path: str) -> list[list[dict]]:
    """``world_size`` Lightning DDP ranks forked from a forkserver that imported Lightning once."""
    launch_ranks(world_size, "tests.integrations.lightning_worker", [json.dumps(asdict(spec)), out_path],
                 timeout_s=LAUNCH_TIMEOUT_S, preload=())
    return [json.loads(Path(f"{out_path}.rank{rank}.json").read_text()) for rank in range(world_size)]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_elastic_resume_from_two_ddp_processes_on_one(config_path, reference, expected, tmp_path):
    ref, _ = reference
    logs = launch_ddp(2, RunSpec(config_path, STOP, ACCUMULATE_W2, str(tmp_path / "ddp"), devices=2,
                                 ckpt_every=STOP), str(tmp_path / "ddp_log"))
    for log in logs:
        assert len(log) == STOP * ACCUMULATE_W2
        assert_grouped_as_zephon(log)
    assert step_fingerprints(*logs) == {s: expected[s] for s in range(STOP)}  # both ranks' lanes, not rank 0's twice
    ref_losses = step_losses(ref)
    for step, loss in step_losses(*logs).items():
        assert loss == pytest.approx(ref_losses[step], rel=LOSS_RTOL), f"step {step}"

    ckpt = tmp_path / "ddp" / "ckpt" / f"epoch=0-step={STOP}.ckpt"
    saved, _ = saved_zephon_state(ckpt)
    _, boundary = collect_fingerprints(LoaderConfig.from_file(config_path), end_step=STOP, save_state_step=STOP)
    assert saved["state"] == dumps(boundary)  # merged over both ranks, topology-free

    # Resuming with the old accumulation (2 micro-batches per step) would group wrongly: refused.
    with pytest.raises(LightningIntegrationError, match=r"Set Trainer\(accumulate_grad_batches=4\)"):
        train(RunSpec(config_path, STEPS, ACCUMULATE_W2, str(tmp_path / "w1_wrong"), resume=str(ckpt)))
    resumed = train(RunSpec(config_path, STEPS, ACCUMULATE_W1, str(tmp_path / "w1"), resume=str(ckpt)))
    assert_grouped_as_zephon(resumed)
    assert step_fingerprints(resumed) == {s: expected[s] for s in range(STOP, STEPS)}
    resumed_losses = step_losses(resumed)
    assert sorted(resumed_losses) == list(range(STOP, STEPS))
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(ref_losses[step], rel=LOSS_RTOL), f"step {step}"
