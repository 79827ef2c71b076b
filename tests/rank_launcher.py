"""Launch real torch.distributed ranks for a test, and reassemble global batches from their rows.

``launch_ranks(W, "tests.pkg.worker", argv)`` starts W processes with the environment
``torchrun`` gives its ranks (RANK, WORLD_SIZE, MASTER_ADDR, ... on loopback, gloo) and runs
``worker.main(argv)`` in each. The ranks are forked from a forkserver that imported the
heavy modules once (``preload``): importing torch.distributed.checkpoint and the loader in
every rank costs more than a whole small run.

A worker reports what each rank received as ``{"world_size": W, "ranks": [{"first_step": s,
"rows": {global_index: [rank, step, hex bytes in the fingerprint layout]}}, ...]}``;
:func:`global_fingerprints` turns that into ``zephon fingerprints`` lines.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing as mp
import os
import socket
import time
from typing import Optional, Sequence

DEFAULT_PRELOAD = ("torch.distributed.checkpoint", "loader.pipeline")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_worker(module: str, environment: dict[str, str], argv: list[str]) -> None:
    """Process target: set the torchrun-style environment, then run ``module.main(argv)``."""
    os.environ.update(environment)
    code = importlib.import_module(module).main(argv)
    if code:
        raise SystemExit(code)


def launch_ranks(world_size: int, module: str, argv: list[str], *, timeout_s: float,
                 preload: Optional[Sequence[str]] = None) -> None:
    """Start ``world_size`` ranks of ``module.main(argv)`` and wait for all; a failed or hung rank fails."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload if preload is not None else DEFAULT_PRELOAD) + [module])
    port = free_port()
    procs = []
    for rank in range(world_size):
        environment = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        proc = ctx.Process(target=run_worker, args=(module, environment, argv), name=f"rank{rank}-of-{world_size}")
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
    assert not failed, f"W={world_size} launch: ranks (rank, exit code) {failed} failed or hung (output above)"


def write_gathered(dist, out_path: str, part: dict) -> None:
    """Every rank's ``part`` to rank 0, which writes ``{"world_size": W, "ranks": [part, ...]}`` to ``out_path``."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, part)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump({"world_size": dist.get_world_size(), "ranks": gathered}, fh)


def global_fingerprints(result: dict, global_batch: int) -> list[str]:
    """``"STEP SHA256"`` per step, from every rank's sequences; checks each rank got its own indices."""
    world_size = result["world_size"]
    rows: dict[int, tuple[int, bytes]] = {}
    for rank, part in enumerate(result["ranks"]):
        for index, (owner, step, hex_bytes) in part["rows"].items():
            index = int(index)
            assert owner == rank and index % world_size == rank, f"rank {rank} received global index {index}"
            assert step == index // global_batch
            rows[index] = (step, bytes.fromhex(hex_bytes))
    first = result["ranks"][0]["first_step"]
    steps = len(rows) // global_batch
    assert sorted(rows) == list(range(first * global_batch, (first + steps) * global_batch))
    lines = []
    for step in range(first, first + steps):
        digest = hashlib.sha256()
        for index in range(step * global_batch, (step + 1) * global_batch):
            digest.update(rows[index][1])
        lines.append(f"{step} {digest.hexdigest()}")
    return lines
