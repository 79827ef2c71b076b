"""A real multi-process torch.distributed (gloo) run, checkpointed with DCP, resumed on another W.

Launch 1: 4 ranks (one process each, with the environment torchrun sets) consume K steps and
``dcp.save({"data": LoaderStateful(loader)})``. Launch 2: 2 ranks ``dcp.load`` that
checkpoint into fresh loaders (one worker process each) and consume K more steps. The
global batches reassembled from all ranks' sequences (all_gather) must have exactly the
fingerprints of one uninterrupted W=1 ``collect_fingerprints`` run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.loader.settings import GLOBAL_BATCH
from tests.rank_launcher import global_fingerprints as rank_fingerprints, launch_ranks

STEPS_PER_LAUNCH = 3
LAUNCH_TIMEOUT_S = 50


def launch(world_size: int, args: list[str]) -> None:
    """Start ``world_size`` ranks of ``dist_worker`` with the environment torchrun gives them, and wait for all."""
    launch_ranks(world_size, "tests.loader.dist_worker", args, timeout_s=LAUNCH_TIMEOUT_S)


def global_fingerprints(result: dict) -> list[str]:
    return rank_fingerprints(result, GLOBAL_BATCH)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("packing", ["best_fit"])
def test_gloo_ranks_save_with_dcp_on_4_and_resume_on_2(tmp_path, make_config, baseline, packing):
    config = make_config(packing).to_dict()
    config["datasets"] = [{"path": d["path"]} for d in config["datasets"]]
    first_config, second_config = tmp_path / "w4.json", tmp_path / "w2.json"
    first_config.write_text(json.dumps(config))
    second_config.write_text(json.dumps(dict(config, num_workers=1, micro_batch_size=4)))
    checkpoint = str(tmp_path / "checkpoint")
    first_out, second_out = tmp_path / "w4-out.json", tmp_path / "w2-out.json"

    launch(4, [str(first_config), str(first_out), str(STEPS_PER_LAUNCH), checkpoint, "save"])
    assert any(Path(checkpoint).iterdir()), "dcp.save wrote nothing"
    launch(2, [str(second_config), str(second_out), str(STEPS_PER_LAUNCH), checkpoint, "load"])

    got = global_fingerprints(json.loads(first_out.read_text())) + \
        global_fingerprints(json.loads(second_out.read_text()))
    assert got == baseline(packing, 2 * STEPS_PER_LAUNCH)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_gloo_ranks_agree_where_finite_data_ends(tmp_path, make_config):
    """max_epochs=1: every real rank stops at the same step, the one a single rank stops at.

    Each rank's own lanes run out at different steps; the loader all-reduces (MIN, gloo) a
    "whole step available" flag at each step boundary, so no rank starts a step that another
    cannot finish (which would hang the trainers' next collective).
    """
    from loader.config import LoaderConfig
    from loader.commands.fingerprints import collect_fingerprints

    config = make_config("concat").to_dict()
    config["datasets"] = [{"path": d["path"], "max_epochs": 1} for d in config["datasets"]]
    config_path, out = tmp_path / "finite.json", tmp_path / "finite-out.json"
    config_path.write_text(json.dumps(config))
    single, _ = collect_fingerprints(LoaderConfig.from_file(str(config_path)), world_size=1, end_step=10_000)
    assert 0 < len(single) < 10_000

    launch(2, [str(config_path), str(out), "0", str(tmp_path / "unused"), "drain"])
    result = json.loads(out.read_text())
    assert global_fingerprints(result) == [line.line() for line in single]
