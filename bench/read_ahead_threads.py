"""Read-ahead threads: tokens/s with ``read_ahead_threads`` 1 against 2, in alternating pairs.

    python bench/read_ahead_threads.py [--mode pretok|mix] [--pairs 6] [--seconds 3]
        [--loader zephon|zephon_full] [--work bench/_work/compare-quick]

Uses the Zephon datasets of ``python -m bench.compare --quick`` (run that first) and the
loader setup of its measurement (1) (``--mode mix``: (3)): seq_len 1024, global batch 16,
0 workers; ``zephon`` delivers ``input_ids`` only. Each run is a fresh process (imports and
construction not timed, 50 start-up steps skipped) that iterates for ``--seconds``; the two
settings alternate which goes first from pair to pair, so that drift of the shared machine
falls on both. Prints every run, the medians and the per-pair ratio 2 / 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from bench.peers import zephon
from bench.peers.common import Layout, Spec
work, mode, loader, threads, seconds = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
layout = Layout(work)
spec = Spec(loader=loader, mode=mode, data_dir=layout.root, seq_len=1024, global_batch=16)
session = zephon.open_session(spec, layout, read_ahead_threads=threads)
batches = iter(session)
for _ in range(50):
    next(batches)
tokens, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    tokens += next(batches).numel()
print(tokens / (time.perf_counter() - start))
session.close()
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="pretok", choices=("pretok", "mix"))
    parser.add_argument("--loader", default="zephon", choices=("zephon", "zephon_full"))
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--work", default=str(REPO_ROOT / "bench" / "_work" / "compare-quick"))
    args = parser.parse_args(argv)

    from bench.machine import cpu_model, load_average

    rates: dict[int, list[float]] = {1: [], 2: []}
    for pair in range(args.pairs):
        for threads in ((1, 2) if pair % 2 == 0 else (2, 1)):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(REPO_ROOT), args.work, args.mode, args.loader, str(threads),
                 str(args.seconds)], capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            rates[threads].append(float(out.stdout) / 1e6)
    print(f"python bench/read_ahead_threads.py --mode {args.mode} --loader {args.loader} --pairs {args.pairs} "
          f"--seconds {args.seconds}")
    print(f"nproc {os.cpu_count()}, {cpu_model()}; load average {load_average()}")
    for threads, runs in rates.items():
        print(f"read_ahead_threads={threads}: median {statistics.median(runs):.1f} M tok/s "
              f"(runs {' / '.join(f'{r:.1f}' for r in runs)})")
    ratios = [b / a for a, b in zip(rates[1], rates[2])]
    print(f"2 / 1 per pair: {' '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
