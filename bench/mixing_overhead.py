"""Mixing overhead (issue 4): tokens/s of a two-source mix against the same data as one source.

    python bench/mixing_overhead.py [--mode separate|interleaved] [--quick] [--repeats 7]
                                    [--docs 80000] [--passes 3] [--only CASE ...]

Data: ``tests.dataset_factory.synthetic_texts(docs, seed=0)`` (142 tokens per document on
average) written with the dataset factory into 16 lanes, with the same document keys in
every layout (so a document sits in the same lane at the same place):

* ``one``     the whole corpus as one source (the baseline);
* ``half0`` / ``half1``  the even / odd documents as two sources, mixed 0.5 / 0.5 (cases
  ``*_seq``, ``*_tok``): the same data, split;
* ``one`` + ``copy``  the whole corpus twice, as two sources mixed 0.5 / 0.5 (cases
  ``*_seq_dup``, ``*_tok_dup``): every source has the baseline's row groups, so the reads,
  decoding and tokenizer calls per token are the baseline's and only the mixing differs. (A
  split has more, smaller row groups per token: each half ends every lane with a short
  one. That is layout, and shows as the difference between ``_seq`` and ``_seq_dup``.)

Once pre-tokenized (``--docs`` documents) and once as text (``--docs / 4``: online
tokenization is slower); row groups of 256 documents. Cached under
``bench/_work/mixing_overhead/``.

Every case runs the loader with concat packing, seq_len 2048, global batch 32, micro-batch 8,
one rank, ``num_workers`` 0, for ``--epochs`` (default 0.9) of the corpus's tokens, so that
every source stays in its first epoch; a measurement is ``--passes`` (default 3) such passes
in one process, each with a new loader. The first ``WARMUP_STEPS`` = 4 global steps of a pass are not
timed: by then every lane has opened its files and read its first block of every source (a
mix opens twice the files, a one-off start-up cost that is not throughput). A timed window
starts and ends with the loader's background reads finished (``wait_for_read_ahead``): the
reads queued before it are not charged to it, and the blocks it has read ahead when it ends
are, as many as were ahead when it started, so the window pays for the blocks it consumes.
Without that, a window of ~150 steps also paid for reads queued in the warm-up (two blocks
per source of every lane), twice as many for a two-source mix as for its baseline: in an
ad-hoc count, 231-238 block reads in the mix's window against 209-211 for the baseline's,
at ~0.5 ms of CPU each, ~4% of the window's CPU. ``_s128``
cases repeat the pre-tokenized sequence-unit cases at seq_len 128, global batch 512,
micro-batch 128 (16x more sequences per token: the per-sequence cost of mixing at its most
visible).

Each mix is measured in ``--repeats`` pairs with its one-source baseline, every pair in fresh
Python processes (imports and construction not timed):

* ``--mode separate`` (default): one process per run, the two runs of a pair adjacent and in
  alternating order;
* ``--mode interleaved``: one process per pair holds both loaders and alternates timed slices
  of ``SLICE_STEPS`` = 8 steps between them, so that load from other work on the machine
  falls on both alike (a steady-state comparison; one pass each). Every slice ends with its
  loader's background reads finished, so they are not charged to the other loader's slice.

The report gives median tokens/s and the median over pairs of mix / baseline, by wall clock
and by CPU time of the process (``time.process_time``, all its threads): on a machine shared
with other work, wall-clock rates swing with the load and the CPU-time ratio is the steadier
measure of the work mixing adds; the goal is judged on it.
Goal: every mix >= 0.95 x its ``one`` (at most 5% slower).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "mixing_overhead"
TOKENIZER = str(REPO_ROOT / "beam_jobs" / "assets" / "tokenizer.json")
NUM_LANES = 16
SEED = 0
ROW_GROUP_ROWS = 256
WARMUP_STEPS = 4
SLICE_STEPS = 8  # --mode interleaved: steps per timed slice
SHAPES = {
    "": {"seq_len": 2048, "global_batch_size": 32, "micro_batch_size": 8},
    "_s128": {"seq_len": 128, "global_batch_size": 512, "micro_batch_size": 128},
}
GOAL_RATIO = 0.95


def _dataset_dir(kind: str, layout: str, docs: int) -> Path:
    return WORK_DIR / f"{kind}_{docs}_rg{ROW_GROUP_ROWS}_{layout}"


LAYOUTS = {"one": slice(None), "half0": slice(0, None, 2), "half1": slice(1, None, 2), "copy": slice(None)}


def build_datasets(docs: int) -> None:
    from tokenizers import Tokenizer

    from tests.dataset_factory import synthetic_texts, write_dataset

    tokenizer = Tokenizer.from_file(TOKENIZER)
    for kind, count in (("pre", docs), ("text", docs // 4)):
        if all((_dataset_dir(kind, name, count) / "manifest.json").exists() for name in LAYOUTS):
            continue
        texts = synthetic_texts(count, seed=SEED)
        keys = [f"doc-{k:07d}" for k in range(count)]
        for name, part in LAYOUTS.items():
            out = _dataset_dir(kind, name, count)
            print(f"building {out.name} ...", flush=True)
            write_dataset(str(out), texts[part], keys=keys[part], num_lanes=NUM_LANES, seed=SEED,
                          source_name=name, row_group_rows=ROW_GROUP_ROWS, tokenizer=tokenizer if kind == "pre" else None)


def _tokens_of(dataset: Path) -> int:
    """Tokens of a dataset (pre-tokenized: from the manifest; text: from its pre twin's)."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    return sum(f["tokens"] or 0 for f in manifest["files"])


# ---------------------------------------------------------------------------------------
# Child: one measurement in a fresh process; prints one RESULT line


def _loader(datasets: list[str], unit: str, shape: dict):
    from loader.config import LoaderConfig
    from loader.pipeline import ZephonLoader

    entries = [{"path": d, "weight": 1.0} for d in datasets]
    config = LoaderConfig(datasets=entries, seed=SEED, tokenizer=TOKENIZER, num_workers=0,
                          mixing_unit=unit, **shape)
    return ZephonLoader(config), config.global_batch_size // config.micro_batch_size


def _consume(loader, micro_batches: int) -> int:
    """Take micro-batches the way a training loop does at least (touch every tensor); tokens."""
    import torch

    tokens = 0
    for _ in range(micro_batches):
        batch = next(loader)
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                int(value.sum())
        tokens += batch["input_ids"].numel()
    return tokens


def child_loader(datasets: list[str], unit: str, shape: dict, steps: int, passes: int) -> dict:
    """``passes`` passes over the same stretch of the stream, each with a new loader."""
    tokens, seconds, cpu_seconds = 0, 0.0, 0.0
    for _ in range(passes):
        loader, per_step = _loader(datasets, unit, shape)
        with loader:
            # Start-up, not timed: the first WARMUP_STEPS global steps, by which every lane
            # has opened its files and read its first block of every source.
            _consume(loader, WARMUP_STEPS * per_step)
            loader.wait_for_read_ahead()  # windows start and end with the reads finished (docstring)
            start, cpu_start = time.perf_counter(), time.process_time()
            tokens += _consume(loader, (steps - WARMUP_STEPS) * per_step)
            loader.wait_for_read_ahead()
            seconds += time.perf_counter() - start
            cpu_seconds += time.process_time() - cpu_start
    return {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds}


def child_interleaved(mix: dict, base: dict, slice_steps: int) -> dict:
    """The mix and its baseline in one process, alternating slices of ``slice_steps`` steps.

    Both loaders run the same number of steps (the shorter case's); each slice is timed on
    its own, so load on the machine falls on both sides alike.
    """
    runs = {}
    for name, args in (("mix", mix), ("base", base)):
        loader, per_step = _loader(args["datasets"], args["unit"], args["shape"])
        _consume(loader, WARMUP_STEPS * per_step)
        runs[name] = {"loader": loader, "per_step": per_step, "tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0}
    steps = min(mix["steps"], base["steps"]) - WARMUP_STEPS
    for run in runs.values():
        run["loader"].wait_for_read_ahead()
    for k, done in enumerate(range(0, steps, slice_steps)):
        for name in (("mix", "base") if k % 2 == 0 else ("base", "mix")):
            run = runs[name]
            start, cpu_start = time.perf_counter(), time.process_time()
            run["tokens"] += _consume(run["loader"], min(slice_steps, steps - done) * run["per_step"])
            run["loader"].wait_for_read_ahead()  # its reads are not charged to the other loader's slice
            run["seconds"] += time.perf_counter() - start
            run["cpu_seconds"] += time.process_time() - cpu_start
    for run in runs.values():
        run.pop("loader").close()
        run.pop("per_step")
    return runs


def run_child(**kwargs) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(kwargs)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kwargs} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------------------------------
# Orchestration


CASES = {  # label -> (mixing unit, layouts)
    "one": ("sequence", ["one"]),
    "seq": ("sequence", ["half0", "half1"]),
    "tok": ("token", ["half0", "half1"]),
    "seq_dup": ("sequence", ["one", "copy"]),
    "tok_dup": ("token", ["one", "copy"]),
}


def plan(docs: int, epochs: float, passes: int) -> dict[str, dict]:
    """Case name -> child arguments plus ``base``, the name of its one-source case."""
    cases = {}
    tokens_pre = _tokens_of(_dataset_dir("pre", "one", docs))
    for kind, count in (("pre", docs), ("text", docs // 4)):
        tokens = tokens_pre * count // docs  # the text corpus is a prefix-sized sample of the same generator
        for suffix, shape in SHAPES.items():
            # At least SLICE_STEPS timed steps: --quick's small text corpus has fewer in 0.9 epochs.
            steps = max(WARMUP_STEPS + SLICE_STEPS, int(epochs * tokens) // (shape["seq_len"] * shape["global_batch_size"]))
            for label, (unit, layouts) in CASES.items():
                if suffix and (kind == "text" or unit == "token"):
                    continue
                cases[f"{kind}_{label}{suffix}"] = {
                    "base": f"{kind}_one{suffix}",
                    "datasets": [str(_dataset_dir(kind, name, count)) for name in layouts],
                    "unit": unit, "shape": shape, "steps": steps, "passes": passes,
                }
    return cases


def measure(cases: dict[str, dict], repeats: int, mode: str) -> dict[str, list[tuple[dict, dict]]]:
    """Per mix case, ``repeats`` pairs (mix run, baseline run).

    ``separate``: each run in a fresh process, the two runs of a pair adjacent and in
    alternating order (baseline first in even rounds). ``interleaved``: one fresh process
    per pair runs both loaders, alternating slices of ``SLICE_STEPS`` steps.
    """
    mixes = [name for name, case in cases.items() if case["base"] != name]
    pairs: dict[str, list[tuple[dict, dict]]] = {name: [] for name in mixes}
    strip = lambda case: {k: v for k, v in case.items() if k != "base"}  # noqa: E731
    for round_ in range(repeats):
        for name in mixes:
            base_name = cases[name]["base"]
            if mode == "interleaved":
                got = run_child(kind="interleaved", mix=strip(cases[name]), base=strip(cases[base_name]),
                                slice_steps=SLICE_STEPS)
                pairs[name].append((got["mix"], got["base"]))
            else:
                order = [base_name, name] if round_ % 2 == 0 else [name, base_name]
                got = {which: run_child(kind="loader", **strip(cases[which])) for which in order}
                pairs[name].append((got[name], got[base_name]))
            mix, base = pairs[name][-1]
            print(f"  round {round_ + 1}/{repeats} {name}: {_rate(mix) / 1e6:.2f} M tok/s "
                  f"({_rate(mix, 'cpu_seconds') / 1e6:.2f} per CPU-s) vs {base_name} "
                  f"{_rate(base) / 1e6:.2f} ({_rate(base, 'cpu_seconds') / 1e6:.2f}): CPU ratio "
                  f"{_rate(mix, 'cpu_seconds') / _rate(base, 'cpu_seconds'):.3f}", flush=True)
    return pairs


def _rate(run: dict, clock: str = "seconds") -> float:
    return run["tokens"] / run[clock]


def report(pairs: dict[str, list[tuple[dict, dict]]], cases: dict[str, dict]) -> list[str]:
    lines = [
        "| case | median wall, mix / one source | mix / one, wall | mix / one, CPU time | goal | status (CPU) |",
        "|---|---:|---:|---:|---|---|",
    ]
    verdicts = []
    for name, runs in pairs.items():
        if not runs:
            continue
        rate = statistics.median(_rate(mix) for mix, _ in runs)
        base_rate = statistics.median(_rate(base) for _, base in runs)
        wall = statistics.median(_rate(mix) / _rate(base) for mix, base in runs)
        cpu = statistics.median(_rate(mix, "cpu_seconds") / _rate(base, "cpu_seconds") for mix, base in runs)
        status = "PASS" if cpu >= GOAL_RATIO else "FAIL"
        verdicts.append((name, wall, cpu, status))
        lines.append(f"| {name} (vs {cases[name]['base']}) | {rate / 1e6:.2f} / {base_rate / 1e6:.2f} M tok/s | "
                     f"{wall:.3f} | {cpu:.3f} | >= {GOAL_RATIO} | {status} |")
    lines.append("")
    for name, wall, cpu, status in verdicts:
        lines.append(f"GOAL {name} >= {GOAL_RATIO} x one: CPU {cpu:.3f} (wall {wall:.3f}) {status}")
    return lines


def machine_line() -> str:
    from bench.machine import machine_line as line  # the repo root is on sys.path by now

    return line()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="--docs 8000 and 1 repeat")
    parser.add_argument("--docs", type=int, default=None, help="documents of the pre-tokenized corpus (default 80000)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per case (default 7; quick 1)")
    parser.add_argument("--epochs", type=float, default=0.9,
                        help="corpus tokens per pass, in epochs (default 0.9: every source in its first epoch)")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes per measurement, each with a new loader (default 3; quick 1)")
    parser.add_argument("--mode", choices=("separate", "interleaved"), default="separate",
                        help="separate: one process per run (default); interleaved: mix and baseline "
                             "in one process per pair, alternating slices of steps")
    parser.add_argument("--only", nargs="+", default=None, metavar="CASE", help="run only these cases (prefixes)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        kwargs = json.loads(args.child)
        child = {"loader": child_loader, "interleaved": child_interleaved}[kwargs.pop("kind")]
        print("RESULT " + json.dumps(child(**kwargs)), flush=True)
        return 0
    docs = args.docs or (8000 if args.quick else 80000)
    repeats = args.repeats or (1 if args.quick else 7)
    if args.quick:
        args.passes = 1
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    build_datasets(docs)
    cases = plan(docs, args.epochs, args.passes)
    if args.only:
        wanted = {n for n in cases if any(n.startswith(p) for p in args.only)}
        wanted |= {cases[n]["base"] for n in wanted}  # keep the baselines of the selected mixes
        cases = {n: c for n, c in cases.items() if n in wanted}
    command = "python bench/mixing_overhead.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(f"{command}\n{machine_line()}", flush=True)
    started = time.perf_counter()
    pairs = measure(cases, repeats, args.mode)
    print(f"\n{len(pairs)} mixes x {repeats} pairs in {time.perf_counter() - started:.0f} s; {machine_line()}\n")
    print("\n".join(report(pairs, cases)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
