"""Packing window and balance (issue 32): packing efficiency, audit seek time, balance, exchange.

    python bench/packing_window.py [--only CASE ...] [--repeats 3] [--steps 20000]

Cases (the harness of ``bench/loader_throughput.py``: each timed measurement in a fresh
process, rounds interleaved, medians; the machine is shared, so wall times are noisy):

* ``efficiency``  non-padding tokens / all tokens of ``packing_window = K`` (K 64 .. 4096)
                  against best fit without windows (``best_fit_open_bins`` 8, the default, and
                  64), seq_len 2048, on three length distributions (generated, see
                  :func:`lengths`): ``text`` (lognormal web documents), ``chat`` (multi-turn
                  conversations, template tokens per turn) and ``image`` (1-3 images of the
                  dynamic Qwen2-VL policy's visual tokens plus a caption). Best fit runs the
                  loader's own :class:`~loader.stages.packing.BestFitPacker` over an in-memory
                  stream; windows use :func:`~loader.order.packing_windows.window_outputs`,
                  which the loader's windowed packer matches (checked here on one K).
* ``audit_*``     wall seconds of ``zephon audit``'s ``audit_step`` (the whole step, every lane)
                  in a fresh process, at step 20 and at ``--steps``: ``_cold`` with an empty
                  window-count cache, ``_warm`` with the cache the cold run left, ``_state``
                  from a checkpoint saved at that step (the result is checked equal).
* ``count``       CPU seconds of counting one lane's windows up to ``--steps`` with no cache
                  (lengths read + ``window_outputs``): what a cold audit pays once.
* ``throughput``  tokens/s of one in-process rank (no workers) on the audit dataset: concat, best
                  fit (8 open bins), ``packing_window`` 256 and 1024 (wall and CPU time).
* ``balance``     max/mean rank cost (loader.order.balance's cost model) over 100 steps of a
                  long-tailed corpus at W = 4, with and without ``balance = "attention"``, and
                  the simulated step time (slowest rank's cost) it saves.
* ``exchange``    a real gloo run (W = 2 and 4 processes on this machine): tokens/s and the
                  per-step latency of the balance exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "packing_window"
sys.path.insert(0, str(REPO_ROOT))

from bench.loader_throughput import add_run_options, child_main, run_and_report  # noqa: E402

SEQ_LEN = 2048
WINDOWS = (64, 128, 256, 512, 1024, 2048, 4096)
AUDIT = dict(lanes=8, docs=24000, seq_len=512, batch=16, window=256)  # window: --window


# -- efficiency --------------------------------------------------------------------------------
def lengths(kind: str, count: int, seed: int = 0) -> list[int]:
    """Wrapped document lengths (EOS included) of a generated corpus of ``kind``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "text":  # web text: median ~250 tokens, a long tail past seq_len
        values = rng.lognormal(5.5, 1.2, count)
    elif kind == "chat":  # 1 + geometric turns, user + assistant + 10 template tokens each
        turns = rng.geometric(0.35, count)
        values = np.array([sum(rng.lognormal(4.0, 0.8) + rng.lognormal(5.3, 0.9) + 10 for _ in range(t))
                           for t in turns])
    elif kind == "image":  # 1-3 images of (h/28) x (w/28) visual tokens (+2 markers), a caption
        images = rng.integers(1, 4, count)
        values = np.array([sum((rng.integers(8, 41) * rng.integers(8, 41)) + 2 for _ in range(n))
                           for n in images]) + rng.lognormal(4.5, 0.8, count)
    else:
        raise ValueError(f"kind must be text, chat or image (got {kind!r})")
    return [int(v) + 1 for v in np.minimum(values, 4 * SEQ_LEN)]


class _LengthStream:
    """A stream of zero tokens in documents of given lengths, read as the packers read a lane."""

    def __init__(self, sizes: list[int]) -> None:
        import numpy as np

        self._np = np
        self.sizes, self.doc, self.offset = sizes, 0, 0
        self.last_origin = (0, 0, 0)

    def take(self, n: int, *, within_document: bool = False):
        from loader.io.blocks import Chunk

        np = self._np
        if self.doc >= len(self.sizes):
            return None
        count = min(n, self.sizes[self.doc] - self.offset)
        starts = np.zeros(1 if self.offset == 0 else 0, dtype=np.int64)
        self.offset += count
        if self.offset == self.sizes[self.doc]:
            self.doc, self.offset = self.doc + 1, 0
        return Chunk(tokens=np.zeros(count, dtype=np.int32), doc_starts=starts, features={})

    def at_document_start(self) -> bool:
        return self.offset == 0

    def get_state(self) -> dict:
        return {"doc": self.doc, "offset": self.offset}


def _efficiency_of(packer) -> tuple[float, int]:
    used = total = 0
    while (sequence := packer.next_sequence()) is not None:
        total += len(sequence.input_ids)
        used += len(sequence.input_ids) - sequence.padding
    return used / total, total // SEQ_LEN


def efficiency(docs: int = 40000) -> dict:
    from loader.order.packing_windows import window_outputs
    from loader.stages.packing import BestFitPacker
    from loader.stages.window_packing import WindowedBestFitPacker

    out = {}
    for kind in ("text", "chat", "image"):
        sizes = lengths(kind, docs)
        row = {"documents": docs, "mean_length": sum(sizes) / len(sizes)}
        for bins in (8, 64):
            row[f"best_fit_{bins}"] = _efficiency_of(BestFitPacker(_LengthStream(sizes), SEQ_LEN, 0, bins))[0]
        for window in WINDOWS:
            outputs = sum(window_outputs(sizes[k:k + window], SEQ_LEN) for k in range(0, len(sizes), window))
            row[f"window_{window}"] = sum(sizes) / (outputs * SEQ_LEN)
        check, rows = _efficiency_of(WindowedBestFitPacker(_LengthStream(sizes), SEQ_LEN, 0, 256))
        assert abs(check - row["window_256"]) < 1e-12, (kind, check, row["window_256"])  # the packer's own count
        out[kind] = row
    return out


# -- audit seek time ---------------------------------------------------------------------------
def _audit_dataset() -> str:
    path = WORK_DIR / f"data_{AUDIT['docs']}"
    if not (path / "manifest.json").exists():
        from loader.samples import default_tokenizer_path
        from loader.stages.tokenizer import load_tokenizer
        from tests.dataset_factory import synthetic_texts, write_dataset

        write_dataset(str(path), synthetic_texts(AUDIT["docs"], seed=5, max_words=300), num_lanes=AUDIT["lanes"],
                      seed=2, tokenizer=load_tokenizer(default_tokenizer_path()), row_group_rows=256)
    return str(path)


def _audit_config(**overrides):
    from loader.samples import default_tokenizer_path
    from loader.config import LoaderConfig

    fields = dict(datasets=[{"path": _audit_dataset()}], seq_len=AUDIT["seq_len"], global_batch_size=AUDIT["batch"],
                  micro_batch_size=AUDIT["batch"], seed=7, tokenizer=default_tokenizer_path(), packing="best_fit",
                  packing_window=AUDIT["window"])
    fields.update(overrides)
    return LoaderConfig(**fields)


def _state_file(step: int) -> Path:
    return WORK_DIR / f"state_{AUDIT['docs']}_K{AUDIT['window']}_{step}.json"


def child_make_state(step: int, window: int) -> dict:
    from loader.commands.fingerprints import collect_fingerprints

    AUDIT["window"] = window
    start = time.perf_counter()
    _, state = collect_fingerprints(_audit_config(batch_fields=("input_ids",)), end_step=step, save_state_step=step)
    _state_file(step).write_text(json.dumps(state))
    return {"seconds": time.perf_counter() - start}


def child_audit(step: int, cache: str, use_state: bool, window: int) -> dict:
    """One audit of ``step`` in this fresh process: wall seconds from before the import of the
    loader (what a user's ``zephon audit`` waits for, minus the interpreter start)."""
    os.environ["ZEPHON_WINDOW_CACHE"] = cache
    AUDIT["window"] = window
    start = time.perf_counter()
    from loader.commands.audit import audit_step

    state = json.loads(_state_file(step).read_text()) if use_state else None
    report = audit_step(_audit_config(), step, load_state=state)
    seconds = time.perf_counter() - start
    pieces = [[(p.key, p.position, p.length, p.start) for p in s.pieces] for s in report.sequences]
    return {"seconds": seconds, "method": report.method, "notes": report.notes,
            "digest": __import__("hashlib").sha256(json.dumps(pieces).encode()).hexdigest()}


# -- balance -----------------------------------------------------------------------------------
BALANCE = dict(seq_len=2048, batch=64, micro=4, steps=100, docs=4000)


def _balance_dataset() -> str:
    """Lognormal document lengths (median ~400 tokens) up to seq_len, pre-tokenized, 8 lanes."""
    path = WORK_DIR / f"long_tailed_{BALANCE['docs']}"
    if not (path / "manifest.json").exists():
        import numpy as np

        from loader.samples import default_tokenizer_path
        from loader.stages.tokenizer import load_tokenizer
        from tests.dataset_factory import write_dataset

        rng = np.random.default_rng(11)
        words = ["alpha", "beta", "gamma", "delta", "data", "model", "token", "lane", "zephon", "batch"]
        counts = np.minimum(rng.lognormal(6.0, 1.0, BALANCE["docs"]).astype(int) + 1, BALANCE["seq_len"] - 2)
        texts = [" ".join(words[k] for k in rng.integers(0, len(words), n)) for n in counts]
        write_dataset(str(path), texts, num_lanes=8, seed=1, tokenizer=load_tokenizer(default_tokenizer_path()),
                      row_group_rows=128)
    return str(path)


def _balance_config(**overrides):
    from loader.samples import default_tokenizer_path
    from loader.config import LoaderConfig

    fields = dict(datasets=[{"path": _balance_dataset()}], seq_len=BALANCE["seq_len"],
                  global_batch_size=BALANCE["batch"], micro_batch_size=BALANCE["micro"], seed=3,
                  tokenizer=default_tokenizer_path(), packing="best_fit",
                  batch_fields=("input_ids", "labels", "position_ids"))
    fields.update(overrides)
    return LoaderConfig(**fields)


def balance_figures() -> dict:
    """Per cost model and world size: mean over the steps of max/mean rank cost, balanced and not,
    and the simulated step time (the slowest rank's cost, summed over steps) balancing saves."""
    from loader.order.balance import CostModel, balanced_assignment, default_assignment, rank_costs
    from loader.pipeline import ZephonLoader

    config = _balance_config()
    loader = ZephonLoader(config, rank=0, world_size=1)  # every sequence of every step
    rows = []
    try:
        for _ in range(BALANCE["steps"]):
            items = [item for _ in range(loader.topology.micro_steps_per_step) for item in loader._next_items()]
            rows.append([(item.sequence.segment_starts, item.sequence.padding) for item in items])
    finally:
        loader.close()
    out = {}
    for name, model in (("linear=seq_len (default)", CostModel.for_seq_len(config.seq_len)),
                        ("attention only (linear=0)", CostModel(linear=0))):
        for world_size in (4, 8):
            ratios = {"balanced": [], "unbalanced": []}
            slowest = {"balanced": 0, "unbalanced": 0}
            for step_rows in rows:
                costs = [model.row_cost(starts, config.seq_len, padding) for starts, padding in step_rows]
                for kind, assignment in (("balanced", balanced_assignment(costs, world_size, BALANCE["micro"])),
                                         ("unbalanced", default_assignment(len(costs), world_size, BALANCE["micro"]))):
                    per_rank = rank_costs(costs, assignment)
                    ratios[kind].append(max(per_rank) / (sum(per_rank) / world_size))
                    slowest[kind] += max(per_rank)
            out[f"{name}, W={world_size}"] = {
                "balanced": statistics.mean(ratios["balanced"]), "unbalanced": statistics.mean(ratios["unbalanced"]),
                "step_time_saved": 1 - slowest["balanced"] / slowest["unbalanced"]}
    return out


# -- the exchange on real ranks ------------------------------------------------------------------
def rank_run(argv: list[str]) -> int:
    """One gloo rank (``tests.rank_launcher.launch_ranks``): steps of the loader, with or without
    balance; rank 0 writes wall time, tokens and the per-step exchange latencies."""
    import torch.distributed as dist

    from loader.pipeline import ZephonLoader

    spec = json.loads(argv[0])
    dist.init_process_group("gloo")
    loader = ZephonLoader(_balance_config(**spec["overrides"]))
    for _ in range(loader.topology.micro_steps_per_step):  # first step: start-up, not timed
        next(loader)
    dist.barrier()
    started, tokens, latencies = time.perf_counter(), 0, []
    for _ in range(spec["steps"]):
        for _ in range(loader.topology.micro_steps_per_step):
            batch = next(loader)
            tokens += int((batch["labels"] != -100).sum())
        if "exchange_s" in loader.metrics().balance:
            latencies.append(loader.metrics().balance["exchange_s"])
    dist.barrier()
    seconds = time.perf_counter() - started
    totals = [None] * dist.get_world_size()
    dist.all_gather_object(totals, tokens)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"seconds": seconds, "tokens": sum(totals), "latencies": latencies}))
    loader.close()
    dist.destroy_process_group()
    return 0


def child_exchange(world_size: int, balance: bool, steps: int) -> dict:
    from tests.rank_launcher import launch_ranks

    out = WORK_DIR / f"exchange_{world_size}_{balance}.json"
    spec = {"overrides": {"balance": "attention"} if balance else {}, "steps": steps, "out": str(out)}
    launch_ranks(world_size, "bench.packing_window", ["--rank-run", json.dumps(spec)], timeout_s=600,
                 preload=("torch.distributed", "loader.pipeline"))
    result = json.loads(out.read_text())
    latencies = result.pop("latencies")
    if latencies:
        result["exchange_ms_median"] = 1e3 * statistics.median(latencies)
        result["exchange_ms_p90"] = 1e3 * sorted(latencies)[int(0.9 * (len(latencies) - 1))]
    return result


def exchange_report(results: dict) -> list[str]:
    lines = ["case                 tokens/s (median)   per-step exchange ms (median, p90 of the median run)"]
    for name, runs in results.items():
        runs = sorted(runs, key=lambda r: r["tokens"] / r["seconds"])
        middle = runs[len(runs) // 2]
        exchange = (f"{middle['exchange_ms_median']:.1f}, {middle['exchange_ms_p90']:.1f}"
                    if "exchange_ms_median" in middle else "-")
        lines.append(f"{name:<20} {middle['tokens'] / middle['seconds']:>12,.0f}        {exchange}")
    return lines


# -- throughput of the windowed packer ----------------------------------------------------------------
def child_throughput(packing: str, window, steps: int) -> dict:
    """Tokens/s of an in-process loader (one rank, no workers) on the audit dataset: wall and CPU."""
    from loader.pipeline import ZephonLoader

    overrides = {"packing": packing, "packing_window": window, "micro_batch_size": 4,
                 "batch_fields": ("input_ids", "labels", "position_ids")}
    loader = ZephonLoader(_audit_config(**overrides), rank=0, world_size=1)
    try:
        for _ in range(4 * loader.topology.micro_steps_per_step):  # start-up: the first row groups
            next(loader)
        started, cpu, tokens = time.perf_counter(), time.process_time(), 0
        for _ in range(steps * loader.topology.micro_steps_per_step):
            tokens += int((next(loader)["labels"] != -100).sum())
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        padding = loader.metrics().total.padding_fraction
    finally:
        loader.close()
    return {"tokens": tokens, "seconds": seconds, "cpu_s": cpu, "padding": padding}


def throughput_report(results: dict) -> list[str]:
    lines = ["case                 tokens/s (median)  tokens/CPU s (median)  padding"]
    for name, runs in results.items():
        rate = statistics.median(r["tokens"] / r["seconds"] for r in runs)
        per_cpu = statistics.median(r["tokens"] / r["cpu_s"] for r in runs)
        lines.append(f"{name:<20} {rate:>14,.0f}  {per_cpu:>18,.0f}      {runs[0]['padding']:.2%}")
    return lines


CHILDREN = {"audit": child_audit, "make_state": child_make_state, "exchange": child_exchange,
            "throughput": child_throughput}


def count_rate(steps: int) -> dict:
    """CPU seconds of counting one lane's windows from nothing up to ``steps`` (no cache): the
    one-time cost behind a cold audit."""
    from dataclasses import replace

    from loader.commands import audit
    from loader.commands.window_index import WindowIndex
    from loader.pipeline import ZephonLoader

    config = _audit_config()
    loader = ZephonLoader(config.replace(read_ahead=False), rank=0, world_size=1)
    try:
        spec = replace(loader.spec, features=audit.AUDIT_FEATURES, read_ahead=False)
        stream = audit._build(spec, [0], loader)[0].source_streams()[0]
        outputs = int(audit.source_counts_before(spec.schedule, 1, AUDIT["batch"], AUDIT["lanes"], steps)[0, 0])
        wall, cpu = time.perf_counter(), time.process_time()
        index = WindowIndex(stream, seq_len=AUDIT["seq_len"], window=AUDIT["window"], dataset_fingerprint="-",
                            directory=None)
        index.locate(outputs)
        return {"documents": index.scanned, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    finally:
        loader.close()


def _warm_cache() -> str:
    return str(WORK_DIR / f"cache_warm_K{AUDIT['window']}")


def audit_cases(steps: int) -> dict[str, dict]:
    cases, window = {}, AUDIT["window"]
    for step in (20, steps):
        cold = str(WORK_DIR / f"cache_cold_K{window}_{step}")
        cases[f"audit_{step}_cold"] = {"kind": "audit", "step": step, "cache": cold, "use_state": False,
                                       "fresh_cache": True, "window": window}
        cases[f"audit_{step}_warm"] = {"kind": "audit", "step": step, "cache": _warm_cache(), "use_state": False,
                                       "window": window}
        cases[f"audit_{step}_state"] = {"kind": "audit", "step": step, "cache": _warm_cache(), "use_state": True,
                                        "window": window}
    return cases


def audit_report(results: dict) -> list[str]:
    lines = ["case                      wall s (median)  runs   method      same pieces as _state"]
    for name, runs in results.items():
        step = name.split("_")[1]
        reference = results.get(f"audit_{step}_state", [{}])[0].get("digest")
        same = all(r["digest"] == reference for r in runs)
        lines.append(f"{name:<25} {statistics.median(r['seconds'] for r in runs):>10.2f}  "
                     f"{', '.join(format(r['seconds'], '.2f') for r in runs):<18} {runs[0]['method']:<11} {same}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000, help="the far audit step (default 20,000)")
    parser.add_argument("--window", type=int, default=AUDIT["window"], help="packing_window of the audit and "
                        "count cases (default 256, the recommended K)")
    parser.add_argument("--exchange-steps", type=int, default=30, help="timed steps of each gloo run (default 30)")
    parser.add_argument("--rank-run", default=None, help=argparse.SUPPRESS)
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.rank_run is not None:
        return rank_run([args.rank_run])
    if args.child is not None:
        spec = json.loads(args.child)
        if spec.pop("fresh_cache", False):
            shutil.rmtree(spec["cache"], ignore_errors=True)
        return child_main(CHILDREN, json.dumps(spec))
    AUDIT["window"] = args.window
    only = args.only or ["efficiency", "audit", "throughput", "balance", "exchange"]
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    if "efficiency" in only:
        print(f"efficiency (non-padding / all tokens), seq_len {SEQ_LEN}:")
        for kind, row in efficiency().items():
            base = row["best_fit_8"]
            print(f"  {kind:<6} mean length {row['mean_length']:.0f}: best fit 8 bins {base:.4f}, 64 bins "
                  f"{row['best_fit_64']:.4f}; windows " + ", ".join(
                      f"K={w} {row[f'window_{w}']:.4f} ({row[f'window_{w}'] / base:.3f}x)" for w in WINDOWS))
    if "audit" in only:
        from bench.loader_throughput import run_child

        script = str(Path(__file__).resolve())
        for step in (20, args.steps):
            if not _state_file(step).exists():
                made = run_child("make_state", script=script, step=step, window=AUDIT["window"])
                print(f"state at step {step} saved ({made['seconds']:.1f} s)")
        cases = audit_cases(args.steps)
        warm = run_child("audit", script=script, step=args.steps, cache=_warm_cache(), use_state=False,
                         window=AUDIT["window"])
        print(f"warm-up audit of step {args.steps} (fills cache_warm): {warm['seconds']:.2f} s; {warm['notes'][-1]}")
        run_and_report(cases, args.repeats or 3, audit_report, argv,
                       data=f"{AUDIT['docs']:,} synthetic documents pre-tokenized in {AUDIT['lanes']} lanes, "
                            f"seq_len {AUDIT['seq_len']}, B {AUDIT['batch']}, packing_window {AUDIT['window']}",
                       script=str(Path(__file__).resolve()))
    if "count" in only:
        row = count_rate(args.steps)
        print(f"window counts of lane 0 up to step {args.steps}: {row['documents']:,} documents in "
              f"{row['cpu_s']:.2f} CPU s ({row['documents'] / row['cpu_s']:,.0f} documents per CPU s; "
              f"wall {row['wall_s']:.2f} s)")
    if "throughput" in only:
        _audit_dataset()
        cases = {"concat": {"kind": "throughput", "packing": "concat", "window": None, "steps": 400},
                 "best_fit_8_bins": {"kind": "throughput", "packing": "best_fit", "window": None, "steps": 400},
                 "best_fit_window_256": {"kind": "throughput", "packing": "best_fit", "window": 256, "steps": 400},
                 "best_fit_window_1024": {"kind": "throughput", "packing": "best_fit", "window": 1024, "steps": 400}}
        run_and_report(cases, args.repeats or 3, throughput_report, argv,
                       data=f"the audit dataset ({AUDIT['docs']:,} documents, seq_len {AUDIT['seq_len']}), B "
                            f"{AUDIT['batch']}, micro-batch 4, in-process, 400 timed steps",
                       script=str(Path(__file__).resolve()))
    if "balance" in only:
        print(f"balance: {BALANCE['steps']} steps of B={BALANCE['batch']}, micro-batch {BALANCE['micro']}, seq_len "
              f"{BALANCE['seq_len']}, best fit, lognormal(6.0, 1.0) words up to seq_len ({BALANCE['docs']} documents)")
        for name, row in balance_figures().items():
            print(f"  {name:<36} mean max/mean rank cost {row['balanced']:.4f} balanced, {row['unbalanced']:.4f} "
                  f"unbalanced; simulated step time saved {row['step_time_saved']:.1%}")
    if "exchange" in only:
        _balance_dataset()
        cases = {f"gloo_W{w}_{'balance' if b else 'plain'}": {"kind": "exchange", "world_size": w, "balance": b,
                                                              "steps": args.exchange_steps}
                 for w in (2, 4) for b in (False, True)}
        run_and_report(cases, args.repeats or 3, exchange_report, argv,
                       data=f"the balance corpus, B={BALANCE['batch']}, seq_len {BALANCE['seq_len']}, "
                            f"{args.exchange_steps} timed steps per run, W processes on this machine's cores",
                       script=str(Path(__file__).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
