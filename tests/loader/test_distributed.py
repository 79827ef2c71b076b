"""A real multi-process torch.distributed (gloo) run, checkpointed with DCP, resumed on another W.

Launch 1: 4 ranks (one process each, with the environment torchrun sets) consume K steps and
``dcp.save({"data": LoaderStateful(loader)})``. Launch 2: 2 ranks ``dcp.load`` that
checkpoint into fresh loaders (one worker process each) and consume K more steps. The
global batches reassembled from all ranks' sequences (all_gather) must have exactly the
fingerprints of one uninterrupted W=1 ``collect_fingerprints`` run.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import socket
import time
from pathlib import Path

import pytest

from tests.loader import dist_worker
from tests.loader.settings import GLOBAL_BATCH

STEPS_PER_LAUNCH = 3
LAUNCH_TIMEOUT_S = 50


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world_size: int, args: list[str]) -> None:
    """Start ``world_size`` ranks with the environment torchrun gives them, and wait for all.

    The ranks are forked from a forkserver that imported torch.distributed.checkpoint and
    the loader once: importing them in every rank costs more than the whole run.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed.checkpoint", "loader.pipeline", "tests.loader.dist_worker"])
    port = free_port()
    procs = []
    for rank in range(world_size):
        environment = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        proc = ctx.Process(target=dist_worker.run_rank, args=(environment, args), name=f"rank{rank}-of-{world_size}")
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
    assert not failed, f"W={world_size} launch: ranks (rank, exit code) {failed} failed or hung (output above)"


def global_fingerprints(result: dict) -> list[str]:
    """``"STEP SHA256"`` per step, from every rank's sequences; checks each rank got its own indices."""
    world_size = result["world_size"]
    rows: dict[int, tuple[int, bytes]] = {}
    for rank, part in enumerate(result["ranks"]):
        for index, (owner, step, hex_bytes) in part["rows"].items():
            index = int(index)
            assert owner == rank and index % world_size == rank, f"rank {rank} received global index {index}"
            assert step == index // GLOBAL_BATCH
            rows[index] = (step, bytes.fromhex(hex_bytes))
    first = result["ranks"][0]["first_step"]
    steps = len(rows) // GLOBAL_BATCH
    assert sorted(rows) == list(range(first * GLOBAL_BATCH, (first + steps) * GLOBAL_BATCH))
    lines = []
    for step in range(first, first + steps):
        digest = hashlib.sha256()
        for index in range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH):
            digest.update(rows[index][1])
        lines.append(f"{step} {digest.hexdigest()}")
    return lines


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
    from loader.fingerprints import collect_fingerprints

    config = make_config("concat").to_dict()
    config["datasets"] = [{"path": d["path"], "max_epochs": 1} for d in config["datasets"]]
    config_path, out = tmp_path / "finite.json", tmp_path / "finite-out.json"
    config_path.write_text(json.dumps(config))
    single, _ = collect_fingerprints(LoaderConfig.from_file(str(config_path)), world_size=1, end_step=10_000)
    assert 0 < len(single) < 10_000

    launch(2, [str(config_path), str(out), "0", str(tmp_path / "unused"), "drain"])
    result = json.loads(out.read_text())
    assert global_fingerprints(result) == [line.line() for line in single]
