"""What p99 this machine allows a call of a given size: the yardstick for the ``next()`` p99 goal.

    python bench/noise_floor.py [--steps 1200] [--workers 0 2] [--work bench/_work/compare-full]

Issue 16 asks for ``next()`` p99 below 0.2 ms with 2 workers under the busy trainer of
``bench.compare`` (1 ms holding the GIL + 4 ms asleep per batch). How far a p99 can be from its
p50 on a machine is not the loader's to choose: interrupts, the other processes' wake-ups and
a shared host's steal stretch some calls by milliseconds. So the same loop that times
``next()`` also times, right after it on every step, a *fixed* task: the calibrated pure-Python
loop of ``bench.peers.run.busy_loop``, of 20, 50, 100 and 300 us (taking turns, one per step),
while Zephon's workers run as in the comparison. A fixed task's p99 is the machine's, for a
call of that size, in those conditions; ``next()`` cannot do better than a fixed task of its
own p50.

Uses the Zephon datasets of ``python -m bench.compare`` (the full profile; run it first) and
its pre-tokenized Zephon setup (seq_len 2048, batch 8). Prints one line per case.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.machine import machine_line  # noqa: E402
from bench.peers import zephon  # noqa: E402
from bench.peers.common import Layout, Spec  # noqa: E402
from bench.peers.run import busy_loop, task_calibrate  # noqa: E402

TASK_US = (20, 50, 100, 300)
WARMUP_BATCHES = 50
SLEEP_S = 0.004  # the comparison's busy trainer: 1 ms holding the GIL, then 4 ms asleep


def _iterations(us: float) -> int:
    return task_calibrate({"busy_ms": us / 1000})["busy_iters"]


def _quantiles(seconds: list[float]) -> str:
    ms = np.array(seconds) * 1e3
    return f"p50 {np.percentile(ms, 50):.3f}  p99 {np.percentile(ms, 99):.3f}  max {ms.max():.2f} ms"


def measure(work: str, workers: int, steps: int) -> dict[str, list[float]]:
    spec = Spec(loader="zephon", mode="pretok", data_dir=work, seq_len=2048, global_batch=8, num_workers=workers)
    session = zephon.open_session(spec, Layout(work))
    try:
        batches = iter(session)
        for _ in range(WARMUP_BATCHES):
            next(batches)
        trainer = _iterations(1000)
        tasks = {us: _iterations(us) for us in TASK_US}
        times: dict[str, list[float]] = {"next()": [], **{f"fixed {us} us": [] for us in TASK_US}}
        for step in range(steps):
            busy_loop(trainer)
            time.sleep(SLEEP_S)
            started = time.perf_counter()
            next(batches)
            times["next()"].append(time.perf_counter() - started)
            us = TASK_US[step % len(TASK_US)]
            started = time.perf_counter()
            busy_loop(tasks[us])
            times[f"fixed {us} us"].append(time.perf_counter() - started)
        return times
    finally:
        session.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--work", default=str(REPO_ROOT / "bench" / "_work" / "compare-full"))
    args = parser.parse_args(argv)
    print("python bench/noise_floor.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(machine_line())
    for workers in args.workers:
        for name, seconds in measure(args.work, workers, args.steps).items():
            print(f"workers {workers}  {name:14s} {_quantiles(seconds)}  ({len(seconds)} calls)")


if __name__ == "__main__":
    main()
