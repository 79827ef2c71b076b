"""``loader.integrations.hf``: real ``transformers.Trainer`` runs on CPU, checked against ``zephon fingerprints``.

A tiny randomly initialised GPT-2 (vocabulary = the shipped tokenizer's) trains 6 steps on
a small pre-tokenized dataset (L = 8, B = 8, seq_len 64). A forward hook records every row
the model received; ``hf_rank.step_fingerprints`` hashes each step exactly as
``collect_fingerprints`` does, which is the reference (W = 1, in process):

1. an uninterrupted run (its ``checkpoint-3`` state is also the reference's state at step 3);
2. a run interrupted after step 3 and resumed from its ``checkpoint-3``: the same rows
   and bit-identical losses as the uninterrupted run;
3. two gloo processes (accumulation 2) interrupted after step 3, resumed by one process with
   micro-batch 4: the same rows, losses within float noise.

Plus each misconfiguration the integration refuses.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from loader.samples import default_tokenizer_path  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.commands.fingerprints import collect_fingerprints  # noqa: E402
from loader.integrations.hf import (  # noqa: E402
    ZEPHON_STATE_NAME, HFIntegrationError, ZephonTrainer,
)
from tests.dataset_factory import synthetic_texts, write_dataset  # noqa: E402
from tests.integrations import hf_rank  # noqa: E402
from tests.rank_launcher import launch_ranks  # noqa: E402

STEPS = 6
STOP = 3
LAUNCH_TIMEOUT_S = 120
PRELOAD = ["transformers", "accelerate", "loader.integrations.hf"]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> LoaderConfig:
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("hf_data") / "pretokenized"
    write_dataset(str(path), synthetic_texts(160, seed=7, max_words=40), num_lanes=8, seed=3,
                  tokenizer=Tokenizer.from_file(default_tokenizer_path()), files_per_lane=2, row_group_rows=4)
    return LoaderConfig(datasets=[{"path": str(path)}], seq_len=64, global_batch_size=8, micro_batch_size=2,
                        seed=11, tokenizer=default_tokenizer_path(), num_workers=0)


@pytest.fixture(scope="module")
def reference(config) -> tuple[list[str], dict]:
    """Fingerprint lines of steps 0..5 (W = 1, no trainer) and the merged state at step 3."""
    results, state = collect_fingerprints(config, world_size=1, end_step=STEPS, save_state_step=STOP)
    return [r.line() for r in results], json.loads(json.dumps(state))


@pytest.fixture(scope="module")
def uninterrupted(config, tmp_path_factory) -> tuple[dict, Path]:
    output_dir = tmp_path_factory.mktemp("hf_uninterrupted")
    return hf_rank.run_trainer(config, str(output_dir), max_steps=STEPS, save_steps=STOP), output_dir


def test_uninterrupted_run_trains_on_exactly_zephons_batches(config, reference, uninterrupted):
    run, output_dir = uninterrupted
    lines, state_at_stop = reference
    assert run["final_step"] == STEPS
    assert len(run["forwards"]) == STEPS * 4  # accumulation 4: micro-batches of 2, never re-batched
    assert {tuple(f["keys"]) for f in run["forwards"]} == {("input_ids", "labels", "num_items_in_batch", "position_ids")}
    assert hf_rank.step_fingerprints(config, 1, [run]) == lines
    # accelerate had fetched one micro-batch of step 3 when Trainer saved checkpoint-3 ...
    assert run["positions_at_save"][STOP] == STOP * config.global_batch_size + config.micro_batch_size
    # ... and checkpoint-3 holds the merged state of step boundary 3, not that position
    saved = json.loads((output_dir / f"checkpoint-{STOP}" / ZEPHON_STATE_NAME).read_text())
    assert saved == state_at_stop
    assert saved["next_global_index"] == STOP * config.global_batch_size


def test_interrupted_and_resumed_run_is_bit_identical(config, reference, uninterrupted, tmp_path):
    run, reference_dir = uninterrupted
    first = hf_rank.run_trainer(config, str(tmp_path), max_steps=STEPS, save_steps=STOP, stop_at=STOP)
    assert first["final_step"] == STOP and not (tmp_path / f"checkpoint-{STEPS}").exists()
    checkpoint = tmp_path / f"checkpoint-{STOP}"
    assert (checkpoint / ZEPHON_STATE_NAME).read_bytes() == \
        (reference_dir / f"checkpoint-{STOP}" / ZEPHON_STATE_NAME).read_bytes()
    resumed = hf_rank.run_trainer(config, str(tmp_path), max_steps=STEPS, save_steps=STOP, resume=str(checkpoint))
    assert resumed["final_step"] == STEPS
    assert hf_rank.step_fingerprints(config, 1, [first]) + hf_rank.step_fingerprints(config, 1, [resumed]) == reference[0]
    # same rows in the same micro-batches, same loss bits, forward by forward
    assert first["forwards"] + resumed["forwards"] == run["forwards"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_process_run_resumed_on_one_process(config, reference, uninterrupted, tmp_path):
    config_path = tmp_path / "loader.json"
    config_path.write_text(json.dumps(config.to_dict()))
    out = tmp_path / "w2.json"
    started = time.monotonic()
    # forked from a forkserver that imported transformers once (importing it in every rank costs more than the run)
    launch_ranks(2, "tests.integrations.hf_rank", [str(config_path), str(tmp_path), str(out), str(STEPS), str(STOP),
                                                   str(STOP)], timeout_s=LAUNCH_TIMEOUT_S, preload=PRELOAD)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    logging.getLogger(__name__).info("2-process HF Trainer launch: %.1f s wall, rank CPU %s s",
                                     time.monotonic() - started, [round(r["cpu_s"], 1) for r in ranks])
    assert all(r["final_step"] == STOP and len(r["forwards"]) == STOP * 2 for r in ranks)  # accumulation 2
    checkpoint = tmp_path / f"checkpoint-{STOP}"
    assert json.loads((checkpoint / ZEPHON_STATE_NAME).read_text()) == reference[1]  # topology-free

    one_process = config.replace(micro_batch_size=4)  # accumulation 2 on one process
    resumed = hf_rank.run_trainer(one_process, str(tmp_path), max_steps=STEPS, save_steps=STOP, resume=str(checkpoint))
    assert resumed["final_step"] == STEPS
    got = hf_rank.step_fingerprints(config, 2, ranks) + hf_rank.step_fingerprints(one_process, 1, [resumed])
    assert got == reference[0]
    expected = hf_rank.step_losses(config, 1, [uninterrupted[0]])
    losses = hf_rank.step_losses(config, 2, ranks) + hf_rank.step_losses(one_process, 1, [resumed])
    assert losses == pytest.approx(expected, rel=1e-5)


# -- refusals ------------------------------------------------------------------------------
def make_trainer(config, tmp_path, *, world_size: int = 1, **overrides):
    from loader.stages.tokenizer import load_tokenizer

    model = hf_rank.build_model(load_tokenizer(config.tokenizer).get_vocab_size(), config.seq_len)
    args = hf_rank.training_arguments(str(tmp_path), config, world_size, max_steps=STEPS, save_steps=STOP, **overrides)
    return ZephonTrainer(model=model, args=args, zephon_loader=config)


@pytest.mark.parametrize("setting", ["dispatch_batches", "split_batches"])
def test_accelerate_dispatching_or_splitting_batches_is_refused(config, tmp_path, setting):
    with pytest.raises(HFIntegrationError, match=rf"{setting}=True.*'{setting}': False"):
        make_trainer(config, tmp_path, accelerator_config={setting: True})


def test_accumulation_mismatch_is_refused_naming_both_numbers(config, tmp_path):
    with pytest.raises(HFIntegrationError, match=r"gradient_accumulation_steps=2, but .* is 4 micro-batches.*"
                                                 r"gradient_accumulation_steps=4\)"):
        make_trainer(config, tmp_path, gradient_accumulation_steps=2)


def test_trainer_batch_skipping_is_switched_off_and_refused_if_switched_back_on(config, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="loader.integrations.hf"):
        trainer = make_trainer(config, tmp_path, ignore_data_skip=False)
    assert trainer.args.ignore_data_skip is True
    assert "set ignore_data_skip=True" in caplog.text and "twice" in caplog.text
    trainer.args.ignore_data_skip = False
    with pytest.raises(HFIntegrationError, match="double skip.*leave ignore_data_skip=True"):
        trainer.train()


def test_resume_from_a_checkpoint_without_zephon_state_is_refused(config, tmp_path):
    checkpoint = tmp_path / f"checkpoint-{STOP}"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": STOP}))
    with pytest.raises(HFIntegrationError, match=f"{ZEPHON_STATE_NAME} does not exist.*train steps 0"):
        make_trainer(config, tmp_path).train(resume_from_checkpoint=True)


def test_loader_of_another_data_parallel_rank_is_refused(config, tmp_path):
    from loader.pipeline import ZephonLoader
    from loader.stages.tokenizer import load_tokenizer

    model = hf_rank.build_model(load_tokenizer(config.tokenizer).get_vocab_size(), config.seq_len)
    args = hf_rank.training_arguments(str(tmp_path), config, 2, max_steps=STEPS, save_steps=STOP)
    with pytest.raises(HFIntegrationError, match="rank 1 of 2, but this Trainer process is rank 0 of 1"):
        ZephonTrainer(model=model, args=args, zephon_loader=ZephonLoader(config, dp_rank=1, dp_world_size=2))


def test_loader_that_keeps_too_few_step_boundaries_is_refused(config, tmp_path):
    with pytest.raises(HFIntegrationError, match="step_states_kept=1.*set step_states_kept >= 2"):
        make_trainer(config.replace(step_states_kept=1), tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (dict(dataloader_num_workers=2), "set num_workers in the loader config"),
    (dict(auto_find_batch_size=True), "auto_find_batch_size=True"),
])
def test_trainer_batching_options_that_zephon_owns_are_refused(config, tmp_path, overrides, message):
    with pytest.raises(HFIntegrationError, match=message):
        make_trainer(config, tmp_path, **overrides)
