"""Issue 16: what each loader costs a busy trainer, with and without worker processes, and the goals.

Run by ``python -m bench.compare`` (its default ``--only floors,trainer,replay,rss``), which
prepares the data and owns the runner: every case below runs in a fresh process of the
peers venv (``bench.peers.run``), once per repeat, the repeats interleaved round by round
(round 1 runs every case, then round 2, ...) so that load from other work on the machine
spreads over all cases; the tables show medians.

* ``floors``   the scan floor and the tokenizer floor (:mod:`bench.floors`) on Zephon's lane files.
* ``trainer``  per loader, in-process (0 workers) and with 2 workers: a simulated training step
               per batch that holds the GIL for ``busy_ms`` (a pure-Python loop calibrated
               once per run, in a fresh process) and then sleeps ``sleep_ms`` (the device
               computing, GIL released). Overhead per step = wall per step - (busy_ms +
               sleep_ms); ``next()`` wait p50/p99/max; tokens/s under that trainer; first
               batch from construction and after a restore (into the running loader, and
               into a new loader: built, ``load_state_dict``, first batch); peak RSS of the
               process tree. A ``no loader`` row (``next()`` returns one prepared batch)
               shows what the trainer loop itself costs on this machine.
* ``replay``   tokens/s with nothing else in the loop (pre-tokenized and online tokenization),
               every loader in-process and Zephon also with 2 workers; a window ends after
               ``seconds`` or ``replay_epochs`` passes over the corpus, whichever is first,
               so that no loader replays its data many times inside one window.
* ``rss``      Zephon's peak RSS (process tree) reading its pre-tokenized dataset N (a tenth
               of the corpus) and 10N (the corpus), the same number of tokens from each, with
               0 and 2 workers.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Callable, Optional

SECTION = "## Peers and workers: the full profile"
MEASUREMENTS = ("floors", "trainer", "replay", "rss")

# Pre-packed rows are the peers' offline LLM path; they exist for pre-tokenized data only.
PRETOK_LOADERS = ("zephon", "litdata", "grain_packed", "streaming_packed", "torchdata_packed", "hf_packed",
                  "grain", "streaming", "torchdata", "energon", "hf_datasets")
TEXT_LOADERS = ("zephon", "litdata", "grain", "streaming", "torchdata", "energon", "hf_datasets")
WORKERS = (0, 2)
# Issue 35: goals that this machine allows. next() p99 is judged against the best peer's p99 in
# the same run (a fixed 20 us task already has a p99 of 0.23 ms here: bench/noise_floor.py), and
# in-process replay against the scan floor of the same lane files (not against a peer that
# memcpys pre-packed rows).
GOAL_WORKER_OVERHEAD_VS_INPROCESS = 0.5  # 2 workers: trainer overhead per step <= 0.5x Zephon in-process
GOAL_WORKER_VS_INPROCESS = 0.9
GOAL_REPLAY_IDS_VS_SCAN = 0.9  # input_ids only
GOAL_REPLAY_FULL_VS_SCAN = 0.75  # labels, position_ids, cu_seqlens too (``zephon_full``)
GOAL_TEXT_VS_TOKENIZER = 0.9
GOAL_FIRST_BATCH_S = 0.5
GOAL_RSS_RATIO = 1.10
RSS_DATASETS = {"N": "web-ids-tenth", "10N": "web-ids"}

LABELS = {
    "none": "no loader (the trainer loop alone)",
    "zephon": "Zephon",
    "litdata": "LitData (optimize + TokensLoader)",
    "grain_packed": "Grain, pre-packed rows",
    "streaming_packed": "MosaicML Streaming, pre-packed (concat_tokens MDS)",
    "torchdata_packed": "torchdata, pre-packed .npy rows",
    "hf_packed": "HF datasets, pre-packed Arrow rows",
    "grain": "Grain, documents + ConcatThenSplit",
    "streaming": "MosaicML Streaming, documents + packer",
    "torchdata": "torchdata StatefulDataLoader, documents + packer",
    "energon": "Megatron-Energon, documents + packer",
    "hf_datasets": "HF datasets, streaming + group_texts",
}
TEXT_LABELS = {"litdata": "LitData (optimize text + packer)"}


def label(loader: str, mode: str = "pretok") -> str:
    return (TEXT_LABELS.get(loader) if mode == "text" else None) or LABELS[loader]


def key(loader: str, mode: str, workers: int, dataset: str = "") -> str:
    return f"{loader}|{mode}|k{workers}" + (f"|{dataset}" if dataset else "")


def loaders_for(mode: str, loaders: list[str]) -> list[str]:
    allowed = PRETOK_LOADERS if mode == "pretok" else TEXT_LOADERS
    return [n for n in allowed if n in loaders]


# --------------------------------------------------------------------------------------
# Cases and rounds.


def trainer_cases(loaders: list[str], spec: Callable[..., dict], prof: dict, busy_iters: int,
                  modes: tuple[str, ...] = ("pretok", "text")) -> dict[str, dict]:
    common = {"busy_iters": busy_iters, "sleep_ms": prof["sleep_ms"], "steps": prof["trainer_steps"],
              "warmup": prof["trainer_warmup"], "max_warmup_seconds": prof["trainer_seconds"] / 2,
              "max_seconds": prof["trainer_seconds"]}
    cases = {key("none", "pretok", 0): {"spec": spec("none", "pretok"), **common}} if "pretok" in modes else {}
    for mode in modes:
        for name in loaders_for(mode, loaders):
            for k in WORKERS:
                cases[key(name, mode, k)] = {"spec": spec(name, mode, num_workers=k), **common}
    return cases


def replay_cases(loaders: list[str], spec: Callable[..., dict], prof: dict, corpus_tokens: int) -> dict[str, dict]:
    cases = {}
    for mode in ("pretok", "text"):
        for name in loaders_for(mode, loaders):
            for k in ((0, 2) if name == "zephon" else (0,)):
                # text: a longer window, past the first row group of every lane (tokenized ahead by some loaders)
                seconds = prof["seconds"] * (prof.get("text_window_factor", 1.0) if mode == "text" else 1.0)
                cases[key(name, mode, k)] = {"spec": spec(name, mode, num_workers=k), "seconds": seconds,
                                             "max_tokens": int(prof["replay_epochs"] * corpus_tokens)}
    return cases


def rss_cases(spec: Callable[..., dict], prof: dict, small_tokens: int) -> dict[str, dict]:
    return {key("zephon", "pretok", k, size): {"spec": spec("zephon", "pretok", num_workers=k, dataset=dataset),
                                               "seconds": 600.0, "max_tokens": small_tokens}
            for size, dataset in RSS_DATASETS.items() for k in WORKERS}


def run_rounds(run: Callable[[str, dict, float], dict], task: str, cases: dict[str, dict], repeats: int,
               timeout: float, show: Callable[[str, dict], str]) -> dict[str, list[dict]]:
    """Every case once per round, ``repeats`` rounds. A case that failed twice in a row, or
    timed out, is not run again (one failure may be transient: a file mid-edit)."""
    out: dict[str, list[dict]] = {k: [] for k in cases}

    def given_up(runs: list[dict]) -> bool:
        errors = [r.get("error", "") for r in runs[-2:] if "error" in r]
        return any(e.startswith("timed out") for e in errors) or (len(runs) >= 2 and len(errors) == 2)

    for rnd in range(repeats):
        for name, payload in cases.items():
            if given_up(out[name]):
                continue
            res = run(task, payload, timeout)
            out[name].append(res)
            print(f"  [{task} {rnd + 1}/{repeats}] {name:32s} " + (res["error"] if "error" in res else show(name, res)),
                  flush=True)
    return out


# --------------------------------------------------------------------------------------
# Summaries.


def ok_runs(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "error" not in r]


def med(runs: list[dict], field: str) -> Optional[float]:
    vals = [r[field] for r in ok_runs(runs) if r.get(field) is not None]
    return statistics.median(vals) if vals else None


def error_of(runs: list[dict]) -> Optional[str]:
    errs = [r["error"] for r in runs if "error" in r]
    return errs[0] if errs and not ok_runs(runs) else None


def overhead_us(runs: list[dict], nominal_ms: float) -> Optional[float]:
    step = med(runs, "step_ms")
    return None if step is None else (step - nominal_ms) * 1e3


def best_peer(results: dict[str, list[dict]], mode: str, workers: Optional[int], value: Callable[[list[dict]], Optional[float]],
              lower_is_better: bool) -> tuple[Optional[str], Optional[float]]:
    """The peer (not Zephon, not the no-loader row) with the best value in ``mode``."""
    best: tuple[Optional[str], Optional[float]] = (None, None)
    for k, runs in results.items():
        loader, m, kw = k.split("|")[:3]
        if loader in ("zephon", "zephon_full", "none") or m != mode or (workers is not None and kw != f"k{workers}"):
            continue
        v = value(runs)
        if v is None:
            continue
        if best[1] is None or (v < best[1] if lower_is_better else v > best[1]):
            best = (k, v)
    return best


# --------------------------------------------------------------------------------------
# Goals.


def goals(results: dict, prof: dict) -> list[tuple[str, str, str]]:
    """(goal, PASS/FAIL/n/a, the numbers) for each goal of issue 16."""
    tr, rp, floors, rss = (results.get(x, {}) for x in ("trainer", "replay", "floors", "rss"))
    nominal = prof["busy_ms"] + prof["sleep_ms"]
    out: list[tuple[str, str, str]] = []

    def status(ok: Optional[bool]) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    z2 = tr.get(key("zephon", "pretok", 2), [])
    oh = overhead_us(z2, nominal)
    oh0 = overhead_us(tr.get(key("zephon", "pretok", 0), []), nominal)
    peer, peer_oh = best_peer(tr, "pretok", 2, lambda runs: overhead_us(runs, nominal), lower_is_better=True)
    out.append((f"2 workers: trainer overhead per step <= {GOAL_WORKER_OVERHEAD_VS_INPROCESS}x Zephon in-process "
                "and <= best peer's (pre-tokenized, busy trainer)",
                status(None if oh is None or peer_oh is None or oh0 is None
                       else oh <= max(peer_oh, 0.0) and oh <= GOAL_WORKER_OVERHEAD_VS_INPROCESS * max(oh0, 0.0)),
                f"Zephon {_us(oh)} vs in-process {_us(oh0)} = {_ratio(oh, oh0)}; best peer {_peer_name(peer)} "
                f"{_us(peer_oh)}"))
    p99 = med(z2, "next_p99_ms")
    peer, peer_p99 = best_peer(tr, "pretok", 2, lambda runs: med(runs, "next_p99_ms"), lower_is_better=True)
    out.append(("2 workers: next() p99 <= best peer's p99 (pre-tokenized, busy trainer)",
                status(None if p99 is None or peer_p99 is None else p99 <= peer_p99),
                f"p99 {_ms(p99)} vs {_peer_name(peer)} {_ms(peer_p99)}; p50 {_ms(med(z2, 'next_p50_ms'))}, "
                f"max {_ms(med(z2, 'next_max_ms'))}"))
    k0, k2 = med(rp.get(key("zephon", "pretok", 0), []), "tokens_per_s"), med(rp.get(key("zephon", "pretok", 2), []), "tokens_per_s")
    out.append((f"2 workers: replay tok/s >= {GOAL_WORKER_VS_INPROCESS}x Zephon in-process (pre-tokenized)",
                status(None if not k0 or k2 is None else k2 >= GOAL_WORKER_VS_INPROCESS * k0),
                f"{_rate(k2)} vs {_rate(k0)} = {_ratio(k2, k0)}"))
    scan = (floors.get("scan") or {}).get("tokens_per_s")
    full = med(rp.get(key("zephon_full", "pretok", 0), []), "tokens_per_s")
    for what, rate, goal in (("input_ids only", k0, GOAL_REPLAY_IDS_VS_SCAN), ("full batch", full, GOAL_REPLAY_FULL_VS_SCAN)):
        out.append((f"in-process: replay, {what} >= {goal}x the scan floor (pre-tokenized)",
                    status(None if rate is None or not scan else rate >= goal * scan),
                    f"{_rate(rate)} vs {_rate(scan)} = {_ratio(rate, scan)}"))
    t0 = med(rp.get(key("zephon", "text", 0), []), "tokens_per_s")
    tok = (floors.get("tokenize") or {}).get("tokens_per_s")
    out.append((f"in-process: text >= {GOAL_TEXT_VS_TOKENIZER}x tokenizer floor (encode_batch_fast)",
                status(None if t0 is None or not tok else t0 >= GOAL_TEXT_VS_TOKENIZER * tok),
                f"{_rate(t0)} vs {_rate(tok)} = {_ratio(t0, tok)}"))
    for mode in ("pretok", "text"):
        runs = tr.get(key("zephon", mode, 2), [])
        vals = {what: med(runs, field) for what, field in (("fresh", "first_batch_s"), ("restore, new loader", "restore_new_s"),
                                                            ("restore, same loader", "restore_inplace_s"))}
        known = [v for v in vals.values() if v is not None]
        out.append((f"2 workers: first batch <= {GOAL_FIRST_BATCH_S} s, fresh and after restore ({mode})",
                    status(None if len(known) < len(vals) else max(known) <= GOAL_FIRST_BATCH_S),
                    ", ".join(f"{w} {_s(v)}" for w, v in vals.items())))
    for k in WORKERS:
        small, big = (med(rss.get(key("zephon", "pretok", k, size), []), "tree_rss_mb") for size in RSS_DATASETS)
        out.append((f"peak RSS flat in dataset size, {k} workers: 10N <= {GOAL_RSS_RATIO}x N",
                    status(None if not small or big is None else big <= GOAL_RSS_RATIO * small),
                    f"N {_mb(small)}, 10N {_mb(big)} = {_ratio(big, small)}"))
    zt = med(tr.get(key("zephon", "text", 2), []), "tokens_per_s")
    peer, peer_rate = best_peer(tr, "text", None, lambda runs: med(runs, "tokens_per_s"), lower_is_better=False)
    out.append(("(item 4, reported) online tokenization, 2 workers, busy trainer: tok/s >= best peer's",
                status(None if zt is None or not peer_rate else zt >= peer_rate),
                f"{_rate(zt)} vs {_peer_name(peer)} {_rate(peer_rate)} = {_ratio(zt, peer_rate)}"))
    return out


def _peer_name(k: Optional[str]) -> str:
    if not k:
        return "-"
    loader, mode, kw = k.split("|")[:3]
    return f"{label(loader, mode)} ({kw[1:]} workers)"


def _fmt_pair(a: str, b: str) -> str:
    return f"{a} vs {b}"


def _us(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.0f} us"


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f} ms"


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f} MB"


def _rate(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.2f} M tok/s"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


# --------------------------------------------------------------------------------------
# Report.


def render(results: dict, prof: dict, header: list[str], chart: Optional[str], out_path: str) -> str:
    tr, rp, rss, floors = (results.get(x, {}) for x in ("trainer", "replay", "rss", "floors"))
    nominal = prof["busy_ms"] + prof["sleep_ms"]
    cal = results.get("calibration", {})
    lines = [SECTION, ""] + header + [""]

    lines += ["### Goals", "", "| goal | result | numbers |", "|---|---|---|"]
    lines += [f"| {g} | **{s}** | {n} |" for g, s, n in goals(results, prof)]
    lines.append("")
    if chart:
        lines += [f"![issue 16 at a glance]({os.path.relpath(chart, os.path.dirname(os.path.abspath(out_path)))})", ""]

    if tr:
        base = overhead_us(tr.get(key("none", "pretok", 0), []), nominal)
        lines += [f"### Busy trainer: {prof['busy_ms']:g} ms holding the GIL + {prof['sleep_ms']:g} ms sleeping per batch", ""]
        lines.append(
            f"Batch {prof['global_batch']} x {prof['seq_len']} tokens. The GIL-holding part is a pure-Python loop of "
            f"{cal.get('busy_iters', '?')} iterations, calibrated once in a fresh process (fastest of 200 timings; "
            f"median {cal.get('busy_ms_median', float('nan')):.2f} ms). Per run: the first batch, "
            f"{prof['trainer_warmup']} warm-up steps (at most {prof['trainer_seconds'] / 2:g} s), then up to "
            f"{prof['trainer_steps']} timed steps or {prof['trainer_seconds']:g} s. Overhead = wall per step - {nominal:g} ms "
            f"(the no-loader row: {_us(base)}, what sleep overshoot and the loop cost here). `next()`: time inside "
            "`next()` per step. First batch: construction to first batch (imports done); in brackets the wait "
            "inside the next `next()` (the second batch). Restore: `load_state_dict` "
            "of the state after the window into the running loader ('same'), or construct + `load_state_dict` into a "
            "new loader ('new'), to the first batch. CPU per timed step (user + system, from /proc): the trainer "
            f"process (all its threads; the busy loop alone is ~{prof['busy_ms']:g} ms) and its worker processes. "
            "RSS: sum of the peak RSS (VmHWM) of the process and its live "
            "worker processes at the end of the window. Medians of the repeats; 'vs best peer': the difference from "
            "the best peer's overhead in the same table and worker count.")
        lines.append("")
        for mode, title in (("pretok", "pre-tokenized"), ("text", "online tokenization")):
            names = (["none"] if mode == "pretok" else []) + loaders_for(mode, [k.split("|")[0] for k in tr])
            if not any(key(n, mode, k) in tr for n in names for k in WORKERS):
                continue
            lines += [f"#### {title.capitalize()}", "",
                      "| loader | workers | overhead per step | vs best peer | next() p50 / p99 / max ms | tok/s | "
                      "first batch s (wait for the 2nd) | restore same / new s | CPU ms per step: trainer process / workers "
                      "| peak RSS MB (procs) | runs |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for k in WORKERS:
                peer, peer_oh = best_peer(tr, mode, k, lambda runs: overhead_us(runs, nominal), lower_is_better=True)
                for name, _, runs, err in _measured(tr, mode, names, k):
                    if err:
                        lines.append(f"| {label(name, mode)} | {k} | FAILED: {err} | | | | | | | | |")
                        continue
                    oh = overhead_us(runs, nominal)
                    vs = "-" if peer_oh is None or name == "none" else f"{(oh or 0) - peer_oh:+.0f} us"
                    restore = " / ".join(_num(med(runs, f"restore_{w}_s"), 3) if med(runs, f"restore_{w}_s") is not None
                                         else "refused: " + _first_error(runs, f"restore_{w}_error")
                                         for w in ("inplace", "new"))
                    lines.append(
                        f"| {label(name, mode)} | {k} | {_us(oh)} | {vs} | {_num(med(runs, 'next_p50_ms'), 3)} / "
                        f"{_num(med(runs, 'next_p99_ms'), 3)} / {_num(med(runs, 'next_max_ms'), 1)} | "
                        f"{_rate(med(runs, 'tokens_per_s'))} | {_num(med(runs, 'first_batch_s'), 3)} "
                        f"({_num(med(runs, 'second_batch_wait_s'), 3)}) | {restore} | "
                        f"{_num(med(runs, 'own_cpu_ms_per_step'), 2)} / {_num(med(runs, 'workers_cpu_ms_per_step'), 2)} | "
                        f"{_num(med(runs, 'tree_rss_mb'), 0)} ({1 + (med(runs, 'descendants') or 0):.0f}) | {len(ok_runs(runs))} |")
                if peer:
                    lines.append(f"| *best peer, {k} workers: {_peer_name(peer)}* | | {_us(peer_oh)} | | | | | | | | |")
            lines.append("")

    if rp:
        lines += ["### Replay throughput: tokens/s with nothing else in the loop", ""]
        lines.append(
            f"Window: after the first batch and 3 warm-up batches, {prof['seconds']:g} s or {prof['replay_epochs']:g} "
            "passes over the corpus' tokens, whichever comes first (the 'epochs' column). Floors on the same lane files "
            "Zephon reads (`bench/floors.py`). 'vs best' divides by the best peer in-process in the same mode.")
        lines.append("")
        lines += ["| mode | loader | workers | tok/s (median) | runs (M tok/s) | vs best peer | vs floor | epochs in window "
                  "| first batch s | peak RSS MB |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
        for mode, floor in (("pretok", "scan"), ("text", "tokenize")):
            fl = (floors.get(floor) or {}).get("tokens_per_s")
            peer, peer_rate = best_peer(rp, mode, 0, lambda runs: med(runs, "tokens_per_s"), lower_is_better=False)
            for name in loaders_for(mode, [k.split("|")[0] for k in rp]):
                for _, k, runs, err in _measured(rp, mode, [name], *WORKERS):
                    if err:
                        lines.append(f"| {mode} | {label(name, mode)} | {k} | FAILED: {err} | | | | | | |")
                        continue
                    rate = med(runs, "tokens_per_s")
                    all_runs = " / ".join(f"{r['tokens_per_s'] / 1e6:.1f}" for r in ok_runs(runs))
                    tokens = med(runs, "tokens")
                    epochs = tokens / results["corpus_tokens"] if tokens and results.get("corpus_tokens") else None
                    lines.append(f"| {mode} | {label(name, mode)} | {k} | {_rate(rate)} | {all_runs} | {_ratio(rate, peer_rate)} "
                                 f"| {_ratio(rate, fl)} | {_num(epochs, 2)} | {_num(med(runs, 'first_batch_s'), 2)} "
                                 f"| {_num(med(runs, 'tree_rss_mb'), 0)} |")
            fname = {"scan": "floor: pyarrow scan of the lane files", "tokenize": "floor: encode_batch_fast"}[floor]
            lines.append(f"| {mode} | {fname} | | {_rate(fl)} | | | 1.00x | | | |")
        lines.append("")

    if rss:
        lines += ["### Peak RSS against dataset size (Zephon, pre-tokenized)", ""]
        lines.append("Each run reads the same number of tokens (one pass over N) from N (`web-ids-tenth`, the first "
                     "tenth of the documents) or 10N (`web-ids`, all of them), at full speed; peak RSS of the process "
                     "tree (sum of VmHWM: shared memory counts in each process that maps it).")
        lines.append("")
        lines += ["| workers | N: peak RSS MB | 10N: peak RSS MB | 10N / N |", "|---:|---:|---:|---:|"]
        for k in WORKERS:
            small, big = (med(rss.get(key("zephon", "pretok", k, size), []), "tree_rss_mb") for size in RSS_DATASETS)
            lines.append(f"| {k} | {_num(small, 0)} | {_num(big, 0)} | {_ratio(big, small)} |")
        lines.append("")
    return "\n".join(lines)


def _measured(table: dict, mode: str, names: list[str], *workers: int):
    """(loader, workers, runs, error or None) of every measured case among ``names`` x ``workers``."""
    for name in names:
        for k in workers:
            runs = table.get(key(name, mode, k))
            if runs is not None:
                err = error_of(runs)
                yield name, k, runs, (err.replace("|", "/")[:150] if err else None)


def _first_error(runs: list[dict], field: str) -> str:
    return next((r[field] for r in runs if r.get(field)), "-").replace("|", "/")[:80] or "(no message)"


def _num(x: Optional[float], digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


SHORT = {"none": "no loader", "zephon": "Zephon", "litdata": "LitData TokensLoader", "grain_packed": "Grain packed",
         "streaming_packed": "Streaming packed", "torchdata_packed": "torchdata packed", "hf_packed": "HF packed",
         "grain": "Grain docs", "streaming": "Streaming docs", "torchdata": "torchdata docs", "energon": "Energon docs",
         "hf_datasets": "HF streaming"}


def chart_rows(results: dict, prof: dict) -> dict:
    """What :func:`bench.peers.chart.workers_chart` draws: per mode, the loaders (rows) and per
    metric a value per worker count (None where not measured)."""
    nominal = prof["busy_ms"] + prof["sleep_ms"]
    tr, rp = results.get("trainer", {}), results.get("replay", {})
    out = {}
    for mode in ("pretok", "text"):
        names = [n for n in ((["none"] if mode == "pretok" else []) + loaders_for(mode, list(SHORT)))
                 if any(key(n, mode, k) in tr or key(n, mode, k) in rp for k in WORKERS)]

        def metric(table: dict, fn: Callable[[list[dict]], Optional[float]]) -> dict:
            return {str(k): [None if not table.get(key(n, mode, k)) or error_of(table[key(n, mode, k)])
                             else fn(table[key(n, mode, k)]) for n in names] for k in WORKERS}

        out[mode] = {"loaders": [("LitData optimize text" if mode == "text" and n == "litdata" else SHORT[n]) for n in names],
                     "overhead_us": metric(tr, lambda runs: overhead_us(runs, nominal)),
                     "p99_ms": metric(tr, lambda runs: med(runs, "next_p99_ms")),
                     "busy_tok_s": metric(tr, lambda runs: med(runs, "tokens_per_s")),
                     "replay_tok_s": metric(rp, lambda runs: med(runs, "tokens_per_s"))}
    # The p99 goal: the best peer's p99 with 2 workers in the same run (pre-tokenized).
    out["p99_goal_ms"] = best_peer(tr, "pretok", 2, lambda runs: med(runs, "next_p99_ms"), lower_is_better=True)[1]
    return out


def save(path: str, results: dict) -> None:
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
