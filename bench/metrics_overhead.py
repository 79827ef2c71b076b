"""Metrics overhead (issue 20): tokens/s of pre-tokenized replay with ``loader.metrics`` on and off.

    python -m bench.metrics_overhead                       # pre_concat_k0 and pre_best_fit_k0, 9 rounds
    python -m bench.metrics_overhead --cases pre_concat_k0,pre_concat_k2 --rounds 7 --epochs 2

The same tree, the same data (``bench.loader_throughput``'s Beam-built pre-tokenized dataset,
``--docs`` documents, cached in ``bench/_work/loader_throughput/``) and the same loader child
(``bench/loader_throughput.py --child``, a fresh process per run through the shared
:class:`bench.compare.Runner`), once as it ships and once with ``metrics=False``: the child
replaces the loader's :class:`loader.metrics.MetricsRecorder` with one that counts nothing
(the two ``perf_counter`` calls per micro-batch remain). With workers only the trainer's
accounting is switched off; the workers still ship their read counts.

On a shared machine the wall-time ratio swings by more than the 1% it is to show, so
``--probes`` runs per case also measure the accounting in place: after every real call the
child times ``METRICS_PROBE_CALLS`` calls of a twin recorder on the same items
(``bench.loader_throughput._probed_count``) and reports the time per micro-batch; the report
gives it as a share of a micro-batch's delivery time at the ``off`` runs' median rate, with
its own GOAL line.

Rounds, pairing and the report are :mod:`bench.before_after`'s (``off`` in the place of its
old tree, ``on`` of its new one, the order flipped every round): per case the median
tokens/s after the first micro-batch of each, on/off within each round with its median and
range, tokens per CPU second, and the GOAL line: median on/off >= ``GOAL_RATIO`` (at most 1%
slower).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Optional

from bench import before_after as ba
from bench import loader_throughput as lt
from bench.compare import REPO, Runner, code_version
from bench.machine import load_average, machine_line

WORK = os.path.join(REPO, "bench", "_work", "metrics_overhead")
GOAL_RATIO = 0.99
DEFAULT_CASES = ("pre_concat_k0", "pre_best_fit_k0")
CHILD_TIMEOUT_S = 600.0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of {', '.join(c for c in ba.CASES if c.startswith('pre_'))}")
    parser.add_argument("--rounds", type=int, default=9, help="runs per case and setting, interleaved (default 9)")
    parser.add_argument("--epochs", type=float, default=float(lt.PRE_EPOCHS), help="epochs' worth of tokens per run")
    parser.add_argument("--docs", type=int, default=20000, help="documents of the pre-tokenized dataset (default 20000)")
    parser.add_argument("--probes", type=int, default=3, help="probe runs per case (default 3)")
    a = parser.parse_args(argv)
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases if c not in ba.CASES or not c.startswith("pre_")]
    if unknown or not a.cases:
        parser.error(f"--cases {','.join(unknown) or '(empty)'}: pre-tokenized cases of {', '.join(ba.CASES)}")
    if a.rounds < 1 or not a.epochs > 0:
        parser.error("--rounds must be >= 1 and --epochs > 0")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    command = "python -m bench.metrics_overhead" + "".join(
        " " + shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    os.makedirs(WORK, exist_ok=True)
    r = Runner(sys.executable, os.path.join(WORK, "metrics_overhead.log"))
    print(f"[metrics_overhead] {command}\n[metrics_overhead] {machine_line(load=True)}; code {code_version()}",
          flush=True)
    ba.build_data(a.cases, a.docs)
    dataset = ba.datasets_for(a.cases, a.docs)["pre"][0]
    shape = lt.THROUGHPUT
    per_step = shape["seq_len"] * shape["global_batch_size"]
    first_tokens = shape["seq_len"] * shape["micro_batch_size"]
    steps = max(2, int(a.epochs * lt._dataset_tokens(dataset)) // per_step)
    specs = {}
    for case in a.cases:
        _, packing, workers = ba.CASES[case]
        specs[case] = {"kind": "loader", "dataset": dataset, "packing": packing, "num_workers": workers, "steps": steps}
    results = {c: {t: [None] * a.rounds for t in ba.TREES} for c in a.cases}
    child = os.path.join(REPO, "bench", "loader_throughput.py")
    t0 = time.perf_counter()
    for rnd, case, label in ba.schedule(a.cases, a.rounds):  # "old" = metrics off, "new" = on
        spec = dict(specs[case], metrics=label == "new")
        res = r.run_command([sys.executable, child, "--child", json.dumps(spec)], CHILD_TIMEOUT_S, prefix="RESULT ")
        results[case][label][rnd] = res
        shown = res["error"] if "error" in res else f"{ba.steady_rate(res, first_tokens) / 1e6:7.2f} M tok/s"
        print(f"  [{rnd + 1}/{a.rounds}] {case:16s} metrics {'on ' if label == 'new' else 'off'}: {shown}  "
              f"(load {load_average()})", flush=True)
    summaries = {c: ba.summarize(results[c]["old"], results[c]["new"], first_tokens, GOAL_RATIO) for c in a.cases}
    print(f"\nold = metrics off, new = metrics on; {steps} steps x {per_step:,} tokens per run, {a.rounds} round(s), "
          f"{(time.perf_counter() - t0) / 60:.1f} min.")
    print("\n".join(ba.report(summaries, GOAL_RATIO)))
    probes: dict[str, list[float]] = {}
    for case in a.cases:  # the accounting's own time per micro-batch, on the run's real items
        for k in range(a.probes):
            res = r.run_command([sys.executable, child, "--child", json.dumps(dict(specs[case], account_metrics=True))],
                                CHILD_TIMEOUT_S, prefix="RESULT ")
            if "error" in res:
                print(f"  probe {case}: {res['error']}", flush=True)
                continue
            per_micro_batch = res["metrics_s"] / res["micro_batches"]
            off = summaries[case].get("old_tokens_per_s")
            share = per_micro_batch * off / first_tokens if off else float("nan")  # of a micro-batch at the off rate
            probes.setdefault(case, []).append(share)
            print(f"  probe {k + 1}/{a.probes} {case}: {per_micro_batch * 1e6:.2f} us per micro-batch = {share:.3%} "
                  f"of a micro-batch's time at the off runs' median rate", flush=True)
    for case, shares in probes.items():
        median = statistics.median(shares)
        print(f"GOAL {case} accounting time per micro-batch <= {1 - GOAL_RATIO:.0%} of its delivery time: "
              f"{median:.3%} {'PASS' if median <= 1 - GOAL_RATIO else 'FAIL'}")
    print(f"[metrics_overhead] at the end: {machine_line(load=True)}", flush=True)
    with open(os.path.join(WORK, "results.json"), "w") as fh:
        json.dump({"command": command, "specs": specs, "results": results, "summaries": summaries,
                   "probes": probes}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
