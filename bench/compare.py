"""Side-by-side benchmark: Zephon vs peer loaders on one generated corpus (issues 6 and 16).

    bash bench/setup_peers.sh                      # once: bench/_work/peers-venv
    python -m bench.compare --quick                # smoke test (~10 min on 2 cores)
    python -m bench.compare                        # the full profile, recorded in bench/RESULTS.md

The default measurements (``--only floors,trainer,replay,rss``) are those of issue 16 (see
``bench/workers_report.py``: the busy-trainer overhead of every loader in-process and with 2
workers, replay throughput against the floors, first batch and restore, peak RSS against
dataset size, and the goals); they replace the section "## Peers and workers: the full
profile" of ``--out``. ``--only throughput,resume,elastic`` runs the issue 6 comparison below.

This process only orchestrates (standard library); every measurement runs in a fresh
subprocess of the peers venv (``bench.peers.run``), one per loader and repeat, because the
background threads of one loader slow the next. The Zephon datasets are built by the Beam
job (``beam_jobs.shard``) with the Python that runs this module (it needs apache-beam).

Measurements (same seq_len, global batch, worker count and consuming loop for all):
  1. pre-tokenized documents, packed: tokens/s
  2. text, tokenized online and packed: tokens/s
  3. two sources mixed 0.7/0.3: tokens/s and per-batch deviation of the source share
  4. resume: state size, and time from load_state_dict to first batch at steps 10/1e3/1e5
  5. elasticity: global batch fingerprints with world size 2 vs 1 and 2 workers vs 0
  6. peak RSS of each run
plus floors (bare pyarrow scan, bare tokenizers encode_batch).
The results replace the section "## Zephon vs peer loaders (issue 6)" of ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from bench import workers_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Zephon vs peer loaders (issue 6)"
LOADERS = ("zephon", "zephon_full", "streaming", "litdata", "grain", "energon", "torchdata", "hf_datasets",
           "streaming_packed", "grain_packed", "torchdata_packed", "hf_packed")
# Pre-packed rows (pre-tokenized only), prepared per seq_len: each peer's offline LLM path.
PACKED = ("streaming_packed", "grain_packed", "torchdata_packed", "hf_packed")
# Zephon twice: delivering what the consuming loop reads (input_ids, as every peer delivers)
# and delivering the full trainer batch. The second reads the first's data and is measured
# for throughput only: its stream, state and resume are the first's.
ZEPHON_LOADERS = ("zephon", "zephon_full")
DATA_OF = {"zephon_full": "zephon"}  # throughput-only variants -> the loader whose data they read
THROUGHPUT_ONLY = tuple(DATA_OF)
PEER_LABELS = {
    "zephon": "Zephon",
    "zephon_full": "Zephon, full batch",
    "streaming": "MosaicML Streaming",
    "litdata": "LitData",
    "grain": "Grain",
    "energon": "Megatron-Energon",
    "torchdata": "torchdata StatefulDataLoader",
    "hf_datasets": "HF datasets",
    "streaming_packed": "MosaicML Streaming, pre-packed",
    "grain_packed": "Grain, pre-packed",
    "torchdata_packed": "torchdata, pre-packed",
    "hf_packed": "HF datasets, pre-packed",
}
DISTRIBUTIONS = {  # for the versions line
    "streaming": "mosaicml-streaming", "litdata": "litdata", "grain": "grain", "energon": "megatron-energon",
    "torchdata": "torchdata", "hf_datasets": "datasets",
}
MODES = ("pretok", "text", "mix")
MODE_TITLES = {
    "pretok": "(1) Pre-tokenized documents, packed to seq_len (tokens/s)",
    "text": "(2) Online tokenization + packing from text (tokens/s)",
    "mix": "(3) Two-source mixing 0.7/0.3 (tokens/s, per-batch share of source A)",
}

PROFILES = {
    # corpus (docs per source, files per source, sources), seq_len, global batch, workers of the
    # issue 6 runs, repeats, seconds per throughput window and its cap in passes over the corpus,
    # the busy trainer (GIL-holding ms, sleeping ms, timed steps / seconds, warm-up steps),
    # resume (seq_len, global batch, steps, deadline), elasticity steps, timeout of one run
    "quick": dict(num_docs=20000, files_per_source=10, sources=("web", "caps"), seq_len=2048, global_batch=8,
                  num_workers=0, repeats=1, seconds=1.0, replay_epochs=2.0,
                  busy_ms=1.0, sleep_ms=4.0, trainer_steps=150, trainer_seconds=1.0, trainer_warmup=10,
                  resume_seq_len=64, resume_batch=2, resume_steps=(10, 1000, 100000), resume_deadline=40.0,
                  elastic_steps=6, timeout=180.0),
    # >= 100 M tokens (400,000 documents, ~115 M tokens), web only: the issue 16 runs have no mix
    "full": dict(num_docs=400000, files_per_source=10, sources=("web",), seq_len=2048, global_batch=8,
                 num_workers=0, repeats=3, seconds=3.0, replay_epochs=3.0, text_window_factor=1.5,
                 busy_ms=1.0, sleep_ms=4.0, trainer_steps=600, trainer_seconds=2.5, trainer_warmup=20,
                 resume_seq_len=64, resume_batch=2, resume_steps=(10, 1000, 100000), resume_deadline=600.0,
                 elastic_steps=20, timeout=300.0),
}


# --------------------------------------------------------------------------------------
# Subprocesses.


class Runner:
    def __init__(self, python: str, log_path: str) -> None:
        self.python = python
        self.log = open(log_path, "a")
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = REPO + os.pathsep + self.env.get("PYTHONPATH", "")
        self.env.setdefault("TOKENIZERS_PARALLELISM", "true")

    def start(self, task: str, payload: dict) -> subprocess.Popen:
        return self.start_command([self.python, "-m", "bench.peers.run", task, json.dumps(payload)])

    def start_command(self, cmd: list[str], cwd: str = REPO, env: Optional[dict] = None) -> subprocess.Popen:
        """Any command in a fresh process group (``bench.before_after`` runs other trees' scripts)."""
        self.log.write(f"\n$ {' '.join(shlex.quote(c) for c in cmd)}\n")
        self.log.flush()
        # Output goes to files, not pipes: worker processes a peer leaves behind would keep a
        # pipe open after the measured process has exited.
        out = tempfile.TemporaryFile(mode="w+")
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env if env is None else env, stdout=out, stderr=err,
                                text=True, start_new_session=True)
        proc._bench_files = (out, err)  # type: ignore[attr-defined]
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float, prefix: str = "RESULT_JSON: ") -> dict:
        out_f, err_f = proc._bench_files  # type: ignore[attr-defined]
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        try:  # the measured process and anything it left behind: our own process group only
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
        out_f.close()
        err_f.close()
        self.log.write(err[-4000:])
        self.log.write(out[-2000:])
        self.log.flush()
        if timed_out:
            return {"error": f"timed out after {timeout:.0f} s"}
        for line in reversed(out.splitlines()):
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
        tail = (err or out).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}

    def run(self, task: str, payload: dict, timeout: float) -> dict:
        return self.finish(self.start(task, payload), timeout)

    def run_command(self, cmd: list[str], timeout: float, cwd: str = REPO, env: Optional[dict] = None,
                    prefix: str = "RESULT_JSON: ") -> dict:
        """The result dict the command printed after ``prefix`` (last such line), or ``{"error": ...}``."""
        return self.finish(self.start_command(cmd, cwd, env), timeout, prefix)


# --------------------------------------------------------------------------------------
# Steps.


def prepare_data(r: Runner, work: str, prof: dict, loaders: list[str], tokenizer: Optional[str],
                 beam_python: str) -> dict:
    info_path = os.path.join(work, "corpus", "info.json")
    status: dict[str, Any] = {}
    stamp = os.path.join(work, "prepared.json")
    prepared = json.load(open(stamp)) if os.path.exists(stamp) else {}
    want = {"num_docs": prof["num_docs"], "tokenizer": tokenizer, "files_per_source": prof["files_per_source"],
            "sources": list(prof["sources"])}
    if prepared.get("corpus") != want or not os.path.exists(info_path):
        prepared = {"corpus": want}
        cmd = [r.python, "-m", "bench.peers.corpus", work, "--num-docs", str(prof["num_docs"]),
               "--files-per-source", str(prof["files_per_source"]), "--sources", ",".join(prof["sources"])]
        if tokenizer:
            cmd += ["--tokenizer", tokenizer]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=r.env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"corpus generation failed:\n{proc.stderr[-3000:]}")
        status["corpus"] = {"seconds": round(time.perf_counter() - t0, 1)}
    for name in loaders:
        if name in THROUGHPUT_ONLY:
            continue  # reads the datasets of DATA_OF[name]
        if prepared.get(name, {}).get("ok") and (name not in PACKED or prepared[name].get("seq_len") == prof["seq_len"]):
            status[name] = prepared[name]
            continue
        options = {"beam_python": beam_python} if name == "zephon" else {}
        if name in PACKED:
            options = {"seq_len": prof["seq_len"]}
        res = r.run("prepare", {"loader": name, "data_dir": work, "options": options}, timeout=1800)
        res["ok"] = "error" not in res
        if name in PACKED:
            res["seq_len"] = prof["seq_len"]
        prepared[name] = status[name] = res
        print(f"  prepare {name}: {res.get('error') or str(res.get('seconds')) + ' s'}", flush=True)
    with open(stamp, "w") as fh:
        json.dump(prepared, fh)
    return status


def spec(loader: str, mode: str, work: str, prof: dict, **kw) -> dict:
    d = dict(loader=loader, mode=mode, data_dir=work, seq_len=prof["seq_len"], global_batch=prof["global_batch"],
             num_workers=prof["num_workers"], seed=0, weights=[0.7, 0.3])
    d.update(kw)
    return d


def measure_throughput(r: Runner, work: str, prof: dict, loaders: list[str]) -> dict:
    out: dict = {}
    for mode in MODES:
        for name in loaders:
            if name in PACKED and mode != "pretok":
                continue
            runs = []
            for rep in range(prof["repeats"]):
                res = r.run("throughput", {"spec": spec(name, mode, work, prof), "seconds": prof["seconds"]},
                            timeout=prof["timeout"])
                runs.append(res)
                if "error" in res:
                    break
            out[(name, mode)] = summarize(runs)
            s = out[(name, mode)]
            print(f"  {mode:6s} {name:12s} " + (s["error"] if "error" in s else f"{s['tokens_per_s'] / 1e6:8.2f} M tok/s"),
                  flush=True)
    return out


def summarize(runs: list[dict]) -> dict:
    errors = [x["error"] for x in runs if "error" in x]
    if errors:
        return {"error": errors[0]}
    med = lambda k: statistics.median(x[k] for x in runs)  # noqa: E731
    s = {"tokens_per_s": med("tokens_per_s"), "first_batch_s": med("first_batch_s"), "repeats": len(runs),
         "e2e_tokens_per_s": med("e2e_tokens_per_s") if all("e2e_tokens_per_s" in x for x in runs) else None,
         "all_tokens_per_s": [x["tokens_per_s"] for x in runs],
         "rss_mb": max(x["rss_mb"] for x in runs), "children_rss_mb": max(x["children_rss_mb"] for x in runs)}
    if "share_mean" in runs[0]:
        s.update({k: med(k) for k in ("share_mean", "dev_mean", "dev_max")})
    return s


def measure_floors(r: Runner, work: str, prof: dict) -> dict:
    out = {}
    for kind in ("scan", "tokenize"):
        runs = [r.run("floor", {"data_dir": work, "kind": kind, "seconds": prof["seconds"]}, timeout=prof["timeout"])
                for _ in range(prof["repeats"])]
        ok = [x["tokens_per_s"] for x in runs if "error" not in x]
        out[kind] = {"tokens_per_s": statistics.median(ok), "runs": ok} if ok else {"error": runs[0]["error"]}
        print(f"  floor {kind}: {out[kind]}", flush=True)
    return out


def measure_resume(r: Runner, work: str, prof: dict, loaders: list[str]) -> dict:
    out = {}
    for name in loaders:
        sdir = os.path.join(work, "_states", name)
        os.makedirs(sdir, exist_ok=True)
        sp = spec(name, "pretok", work, prof, seq_len=prof["resume_seq_len"], global_batch=prof["resume_batch"])
        saved = r.run("resume_save", {"spec": sp, "steps": list(prof["resume_steps"]), "out_dir": sdir,
                                      "deadline_s": prof["resume_deadline"]},
                      timeout=prof["resume_deadline"] + prof["timeout"])
        per = {}
        for step in prof["resume_steps"]:
            if "error" in saved:
                per[step] = {"error": saved["error"]}
                continue
            entry = saved["steps"].get(str(step))
            if entry is None:
                per[step] = {"error": "not reached (an earlier step failed)"}
            elif "error" in entry:
                per[step] = entry
            else:
                loaded = r.run("resume_load", {"spec": sp, "state": entry["state"], "expect_fps": entry["next_fps"]},
                               timeout=prof["timeout"])
                per[step] = {**entry, **{k: v for k, v in loaded.items() if k != "rss_mb"}}
        out[name] = per
        print(f"  resume {name}: " + ", ".join(
            f"{s}: " + (v["error"][:60] if "error" in v else f"{v['pickle_bytes']} B, {v['load_to_first_batch_s']:.3f} s,"
                        f" same={v['same_next_batches']}") for s, v in per.items()), flush=True)
    return out


def _fingerprints(r: Runner, sp: dict, steps: int, path: str, world: int, timeout: float):
    procs = []
    for rank in range(world):
        s = dict(sp, rank=rank, world_size=world)
        procs.append((r.start("fingerprints", {"spec": s, "steps": steps, "out": f"{path}-r{rank}.npy"}), rank))
    results = [r.finish(p, timeout) for p, _ in procs]
    errors = [x["error"] for x in results if "error" in x]
    if errors:
        return {"error": errors[0]}
    return {"files": [f"{path}-r{rank}.npy" for rank in range(world)]}


def measure_elasticity(r: Runner, work: str, prof: dict, loaders: list[str]) -> dict:
    """Runs fingerprints in the peers venv (numpy) and compares them there too."""
    out = {}
    edir = os.path.join(work, "_elastic")
    os.makedirs(edir, exist_ok=True)
    steps = prof["elastic_steps"]
    for name in loaders:
        sp = spec(name, "pretok", work, prof)
        runs = {
            "base": _fingerprints(r, dict(sp, num_workers=0), steps, os.path.join(edir, f"{name}-base"), 1, prof["timeout"]),
            "world2": _fingerprints(r, dict(sp, num_workers=0), steps, os.path.join(edir, f"{name}-w2"), 2, prof["timeout"]),
            "workers2": _fingerprints(r, dict(sp, num_workers=2), steps, os.path.join(edir, f"{name}-k2"), 1, prof["timeout"]),
        }
        out[name] = compare_fingerprints(r, name, runs)
        print(f"  elastic {name}: {out[name]}", flush=True)
    return out


_COMPARE = r"""
import hashlib, json, sys, numpy as np
from bench.peers.run import adapter
name, runs = sys.argv[1], json.loads(sys.argv[2])
merge = getattr(adapter(name), "merge_ranks", None) or (lambda parts: np.concatenate(parts))
def glob_batches(files):
    parts = [np.load(f) for f in files]
    return [merge([p[t] for p in parts]) for t in range(parts[0].shape[0])]
def fp(b): return hashlib.sha256(np.ascontiguousarray(b, dtype="<i8").tobytes()).hexdigest()
def mfp(b): return hashlib.sha256(b"".join(sorted(np.ascontiguousarray(r, dtype="<i8").tobytes() for r in b))).hexdigest()
base = glob_batches(runs["base"]["files"])
out = {"base_fp0": fp(base[0])[:16], "distinct_batches": len({fp(b) for b in base}) == len(base)}
for key in ("world2", "workers2"):
    if "error" in runs[key]:
        out[key] = {"error": runs[key]["error"]}; continue
    other = glob_batches(runs[key]["files"])
    out[key] = {"same": all(fp(a) == fp(b) for a, b in zip(base, other)),
                "same_rows_any_order": all(mfp(a) == mfp(b) for a, b in zip(base, other)),
                "first_diff_step": next((t for t, (a, b) in enumerate(zip(base, other)) if fp(a) != fp(b)), None)}
print("RESULT_JSON: " + json.dumps(out))
"""


def compare_fingerprints(r: Runner, name: str, runs: dict) -> dict:
    if "error" in runs["base"]:
        return {"error": runs["base"]["error"]}
    proc = subprocess.run([r.python, "-c", _COMPARE, name, json.dumps(runs)], cwd=REPO, env=r.env,
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON: "):
            return json.loads(line[len("RESULT_JSON: "):])
    return {"error": (proc.stderr.strip().splitlines() or ["compare failed"])[-1]}


# --------------------------------------------------------------------------------------
# Report.


def machine_line(load: bool = False) -> str:
    from bench.machine import machine_line as line

    return line(load)


def peer_versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m\nout={}\n"
            "for d in ['zephon','mosaicml-streaming','litdata','grain','megatron-energon','torchdata','datasets',"
            "'torch','numpy','pyarrow','tokenizers','transformers','huggingface-hub','matplotlib','array-record']:\n"
            "    try: out[d]=m.version(d)\n    except Exception as e: out[d]='not installed'\nprint(json.dumps(out))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": proc.stderr[-300:]}


def fmt_rate(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.2f} M"


def fmt_ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def cell_error(s: dict) -> str:
    return "FAILED: " + s["error"].replace("|", "/")[:160]


def render(results: dict, prof: dict, loaders: list[str], command: str, versions: dict, work: str,
           elapsed: float, chart: Optional[str]) -> str:
    tp, floors = results["throughput"], results["floors"]
    info = json.load(open(os.path.join(work, "corpus", "info.json")))
    lines = [SECTION, ""]
    lines.append(f"Generated by `{command}` in {elapsed / 60:.1f} min. Do not edit by hand; rerun the command.")
    lines.append("")
    lines.append(f"- Machine: {machine_line()}")
    lines.append("- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    src = info["sources"]
    lines.append(
        f"- Corpus: generated by `bench/peers/corpus.py` (seed {info['seed']}): two sources of "
        f"{info['num_docs_per_source']} documents each, `web` (lowercase, {src['web']['tokens']:,} tokens) and `caps` "
        f"(capitals, {src['caps']['tokens']:,} tokens), same per-document token-length distribution (median ~200, "
        f"mean {src['web']['mean_doc_tokens']:.0f}); tokenizer `{os.path.relpath(info['tokenizer'], REPO)}` "
        f"(vocab {info['vocab_size']}), EOS id {info['eos_id']} after every document. "
        "`loader.samples.corpus.make_sample` was not used: the mixing measurement needs two sources whose word "
        "tokens are disjoint, so the share of each source can be read back from the delivered ids for every loader.")
    lines.append(
        f"- Same for every loader: seq_len {prof['seq_len']}, global batch {prof['global_batch']} rows, "
        f"{prof['num_workers']} worker processes (FIELD-NOTES: on 2 cores workers are slower for every peer), "
        "world size 1, seed 0, documents shuffled by each loader's own shuffle. Consuming loop: take the batch, view it "
        "as an int64 array [batch, seq_len], count its tokens; nothing else (the floors do the same). Mix: the source share is read back from "
        "the batches after the timed window (as many as it held, up to 2,000), so the measurement's own work is "
        "not charged to the loader. "
        "The peers deliver token ids only, and so does the 'Zephon' row (`batch_fields=[\"input_ids\"]`); "
        "'Zephon, full batch' also builds labels, position ids and cu_seqlens (the default), "
        "which the loop does not read.")
    lines.append(
        f"- Each number is the median of {prof['repeats']} runs of {prof['seconds']} s (after the first batch and 3 "
        "warm-up batches), each run in a fresh process of the peers venv. 'End to end' divides every token "
        "delivered by the time from constructing the loader (libraries already imported) to the end of the run, "
        "so work a loader does ahead of its first batch (e.g. tokenizing whole row groups) is charged; with a "
        "short timed window it is the fairer number. 'First batch s' is construction to first batch.")
    lines.append("- Packing where a peer has none of its own: " + PACKING_NOTE)
    lines.append("- Per-peer setup (formats, options): see the docstring at the top of each `bench/peers/<peer>.py`; "
                 "a summary is under the tables.")
    lines.append("")

    peers = [n for n in loaders if n not in ZEPHON_LOADERS]

    def best_peer(mode: str) -> Optional[float]:
        vals = [tp[(n, mode)]["tokens_per_s"] for n in peers if "error" not in tp.get((n, mode), {"error": 1})]
        return max(vals) if vals else None

    floor_for = {"pretok": floors.get("scan"), "text": floors.get("tokenize"), "mix": floors.get("scan")}
    floor_name = {"pretok": "pyarrow scan", "text": "tokenizers encode_batch", "mix": "pyarrow scan"}
    for mode in MODES:
        lines += [f"### {MODE_TITLES[mode]}", ""]
        fl = floor_for[mode] or {}
        flv = fl.get("tokens_per_s")
        bp = best_peer(mode)
        head = ("| loader | tokens/s (median) | runs (M tok/s) | vs best peer | vs floor | end to end tokens/s "
                "| first batch s | peak RSS MB |")
        sep = "|---|---:|---|---:|---:|---:|---:|---:|"
        if mode == "mix":
            head += " share of A (target 0.70) | mean abs dev per batch | max dev |"
            sep += "---:|---:|---:|"
        lines += [head, sep]
        for name in loaders:
            s = tp.get((name, mode), {"error": "not run"})
            if "error" in s:
                row = f"| {PEER_LABELS[name]} | {cell_error(s)} | | | | | | |"
                if mode == "mix":
                    row += " | | |"
            else:
                runs = " / ".join(f"{x / 1e6:.2f}" for x in s["all_tokens_per_s"])
                rss = f"{s['rss_mb']:.0f}" + (f" (+workers {s['children_rss_mb']:.0f})" if s["children_rss_mb"] else "")
                row = (f"| {PEER_LABELS[name]} | {fmt_rate(s['tokens_per_s'])} | {runs} | {fmt_ratio(s['tokens_per_s'], bp)} "
                       f"| {fmt_ratio(s['tokens_per_s'], flv)} | {fmt_rate(s.get('e2e_tokens_per_s'))} "
                       f"| {s['first_batch_s']:.2f} | {rss} |")
                if mode == "mix":
                    row += f" {s['share_mean']:.3f} | {s['dev_mean']:.3f} | {s['dev_max']:.3f} |"
            lines.append(row)
        lines.append(f"| floor: {floor_name[mode]} | {fmt_rate(flv) if flv else cell_error(fl) if fl else '-'} | | | 1.00x | | | |"
                     + (" | | |" if mode == "mix" else ""))
        lines.append("")
        if mode == "mix":
            lines.append(
                f"Share of A: the fraction of a batch's tokens that came from source `web`, read back from the ids "
                f"(words of `web` and `caps` tokenize to disjoint ids; shared ids such as spaces, punctuation and EOS "
                f"are left out and each source's count is divided by the fraction of its tokens that are exclusive, "
                f"{info['share']['a_coverage']:.3f} and {info['share']['b_coverage']:.3f}). With "
                f"{prof['global_batch']} rows a batch mixed per sequence can only hit multiples of "
                f"1/{prof['global_batch']}; mixing per document spreads sources inside rows.")
            lines.append("")

    # resume
    steps = prof["resume_steps"]
    lines += [f"### (4) Resume (pre-tokenized, seq_len {prof['resume_seq_len']}, global batch {prof['resume_batch']})", ""]
    lines.append("State size: bytes of the state object pickled (JSON bytes where it is JSON-able). Time: from "
                 "`load_state_dict` in a fresh process (loader already constructed) to the 1st and to the 10th batch "
                 "(the 1st can come straight out of a restored packer buffer). Exact: the 10 batches after the "
                 "restore equal those the uninterrupted run delivered there. A step not reached within the deadline "
                 f"({prof['resume_deadline']:.0f} s of iterating, tiny batches) is reported as such.")
    lines.append("")
    head = "| loader | " + " | ".join(f"step {s:,}: state bytes (pickle / JSON) | restore to 1st / 10th batch s | exact" for s in steps) + " |"
    lines += [head, "|---|" + "---:|---:|---|" * len(steps)]
    for name in [n for n in loaders if n not in THROUGHPUT_ONLY]:
        per = results["resume"].get(name, {})
        cells = []
        for s in steps:
            v = per.get(s) or per.get(str(s)) or {"error": "not run"}
            if "error" in v:
                cells += [cell_error(v), "", ""]
            else:
                js = "-" if v.get("json_bytes") is None else f"{v['json_bytes']:,}"
                cells += [f"{v['pickle_bytes']:,} / {js}",
                          f"{v['load_to_first_batch_s']:.3f} / {v['load_to_tenth_batch_s']:.3f}",
                          "yes" if v.get("same_next_batches") else "no"]
        lines.append(f"| {PEER_LABELS[name]} | " + " | ".join(cells) + " |")
    lines.append("")

    # elasticity
    lines += ["### (5) Elasticity: the global batch stream under a different topology", ""]
    lines.append(
        f"The first {prof['elastic_steps']} global batches (pre-tokenized mode) of a run with world size 1 and 0 workers "
        "are compared, by SHA-256 of each global batch's int64 token ids, with (a) world size 2 (ranks 0 and 1 as two "
        "concurrent processes, each given rank/world through the loader's own arguments or environment variables; the "
        "global batch is the ranks' batches merged in the loader's documented order: rank-major concatenation, Zephon "
        "interleaves by global index) and (b) 2 worker processes. 'same rows' compares each global batch as a "
        "multiset of rows (order inside the batch ignored).")
    lines.append("")
    lines += ["| loader | world 2 -> 1: same stream | same rows | workers 2 -> 0: same stream | same rows |",
              "|---|---|---|---|---|"]
    for name in [n for n in loaders if n not in THROUGHPUT_ONLY]:
        e = results["elastic"].get(name, {"error": "not run"})
        if "error" in e:
            lines.append(f"| {PEER_LABELS[name]} | {cell_error(e)} | | | |")
            continue
        cells = []
        for key in ("world2", "workers2"):
            v = e.get(key, {"error": "not run"})
            if "error" in v:
                cells += [cell_error(v), ""]
            else:
                diff = "" if v["same"] else f" (first differs at step {v['first_diff_step']})"
                cells += [("yes" if v["same"] else "no") + diff, "yes" if v["same_rows_any_order"] else "no"]
        lines.append(f"| {PEER_LABELS[name]} | " + " | ".join(cells) + " |")
    lines.append("")

    # notes
    lines += ["### How each loader was set up", ""]
    for name in loaders:
        lines.append(f"- **{PEER_LABELS[name]}**: {SETUP_NOTES[name]}")
    prep = results.get("prepare", {})
    failed = {k: v for k, v in prep.items() if isinstance(v, dict) and v.get("error")}
    if failed:
        lines.append("")
        lines.append("Data preparation failures: " + "; ".join(f"{k}: {v['error']}" for k, v in failed.items()))
    if chart:
        lines += ["", f"![throughput per loader]({os.path.relpath(chart, os.path.dirname(os.path.abspath(results['out'])))})"]
    lines.append("")
    return "\n".join(lines)


PACKING_NOTE = (
    "`bench/peers/common.py` `ConcatPacker`: each document's ids + one EOS are appended to a carry buffer, full "
    "seq_len rows are cut from its front and the remainder carries over; its state (the carry and rows not yet "
    "batched) is saved next to the peer's own state. Text is tokenized one document at a time with tokenizers' "
    "`Tokenizer.encode` in the consuming process. Used for Streaming, Energon, torchdata and LitData (text); "
    "LitData (pre-tokenized, `TokensLoader`), Grain (`ConcatThenSplitIterDataset`), HF datasets (`map(group_texts, "
    "batched=True)`) and Zephon (`packing=\"concat\"`) pack with their own facility.")

SETUP_NOTES = {
    "zephon": "lane-sharded Parquet from `python -m beam_jobs.shard --num-lanes 16 --seed 0 --id-field id` (offline "
              "tokenization for `web-ids`/`caps-ids`, none for `web-text`); `ZephonLoader(LoaderConfig(packing=\"concat\", "
              "micro_batch_size=global batch / world size, batch_fields=[\"input_ids\"]))` (the default `prefetch`); mixing by "
              "dataset weights.",
    "zephon_full": "as Zephon, with the default `batch_fields` (input_ids, labels, position_ids, cu_seqlens).",
    "streaming": "MDS shards (`MDSWriter`, 8 MB, `ndarray:int32` / `str` columns); `StreamingDataset(shuffle=True, "
                 "num_canonical_nodes=1, batch_size=documents per packed batch, predownload=4096)` iterated through a torch "
                 "`DataLoader(batch_size=None)`; state `StreamingDataset.state_dict(documents consumed x world, False)` "
                 "as the stock StreamingDataLoader computes it; mixing `Stream(proportion=...)`. `streaming.vision` is "
                 "stubbed before import (it imports torchvision, kept out of the venv). With the default predownload "
                 "(8 x batch_size) and batch_size 1 it delivered ~1000 documents/s (its ready thread polls every 7 ms).",
    "litdata": "`litdata.optimize` with `TokensLoader()` (chunks of 2^18 tokens) read by `StreamingDataset(item_loader="
               "TokensLoader(block_size=seq_len), shuffle=True)` + `StreamingDataLoader(batch_size=rows)`; text via "
               "`{\"text\": str}` items + the common packer; mixing `CombinedStreamingDataset(weights, "
               "iterate_over_all=False)` over packed rows.",
    "grain": "ArrayRecord files (4 per source); `MapDataset.source(ArrayRecordDataSource).shuffle(seed).repeat()[rank::world]"
             ".map(decode or tokenize).to_iter_dataset()` [`.mp_prefetch`] then `ConcatThenSplitIterDataset` and "
             "`.batch`; mixing `MapDataset.mix(weights)` of documents; state `get_state()/set_state()`.",
    "energon": "WebDataset tar shards (2000 documents each) prepared with `energon prepare --non-interactive "
               "--split-ratio 1,0,0 --sample-type CrudeWebdataset` and a `Cooker`; `get_train_dataset(batch_size=None, "
               "shuffle_buffer_size=100, max_samples_per_sequence=100)` + `get_savable_loader`, `WorkerConfig(rank, "
               "world_size, num_workers)`; mixing: `MetadatasetV2` blend; state `save_state_rank()`.",
    "torchdata": "map-style dataset over the memory-mapped flat token file (or the Parquet text), "
                 "`DistributedSampler(shuffle=True)` and `StatefulDataLoader(batch_size=None)`; state = loader state + "
                 "sampler epoch; mixing `torchdata.nodes.MultiNodeWeightedSampler` over `SamplerWrapper`->`Mapper` "
                 "per source under `nodes.Loader`.",
    "hf_datasets": "`load_dataset(\"parquet\", streaming=True).shuffle(buffer_size=1000)`, `split_dataset_by_node`, "
                   "batched `map` with `encode_batch` for text, `map(group_texts, batched=True, batch_size=1000)` "
                   "(drops < seq_len tokens per 1000 documents), `with_format(\"numpy\")` (the torch format was 3x slower), "
                   "`StatefulDataLoader(batch_size=rows)`; mixing `interleave_datasets(probabilities)`.",
}


def write_section(path: str, section: str) -> None:
    """Replace the section whose heading is ``section``'s first line (or append it)."""
    heading = section.splitlines()[0]
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    with open(path, "w") as fh:
        fh.write(text.rstrip("\n") + "\n")


# --------------------------------------------------------------------------------------


def render_only(a, work: str, loaders: list[str], r: Runner) -> int:
    with open(os.path.join(work, "results.json")) as fh:
        saved = json.load(fh)
    results = dict(saved)
    results["throughput"] = {tuple(k.split("|")): v for k, v in saved["throughput"].items()}
    results["out"] = a.out
    # results.json of a run by an older version of this file may lack these: fall back to the
    # profile, the default command and the span between corpus generation and results.json.
    prof = dict(saved.get("profile") or PROFILES["quick" if a.quick else "full"])
    prof["resume_steps"] = tuple(prof["resume_steps"])
    command = saved.get("command") or ("python -m bench.compare" + (" --quick" if a.quick else "")
                                       + f" --out {os.path.relpath(a.out, REPO)}")
    elapsed = saved.get("elapsed") or (os.path.getmtime(os.path.join(work, "results.json"))
                                       - os.path.getmtime(os.path.join(work, "corpus", "info.json")))
    versions = saved.get("versions") or peer_versions(a.python)
    chart = saved.get("chart", a.chart if os.path.exists(a.chart) else None)
    section = render(results, prof, loaders, command, versions, work, elapsed, chart)
    write_section(a.out, section)
    print(f"[compare] rewrote {a.out} from {work}/results.json", flush=True)
    return 0


def default_beam_python() -> str:
    try:
        import apache_beam  # noqa: F401

        return sys.executable
    except ImportError:
        return "python3"


ISSUE6 = ("throughput", "resume", "elastic")
TRAINER_TIMEOUT_S = 150.0  # one busy-trainer run: a hung peer (seen once: HF datasets + 2 workers) costs this


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small corpus, short runs, one repeat: a smoke test")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "RESULTS.md"))
    p.add_argument("--chart", default=None, help="chart PNG (default bench/compare_throughput.png for the "
                                                  "issue 6 run, bench/workers_overhead.png for issue 16; "
                                                  "--quick: in the work dir)")
    p.add_argument("--python", default=os.path.join(REPO, "bench", "_work", "peers-venv", "bin", "python"),
                   help="interpreter of the peers venv (bench/setup_peers.sh)")
    p.add_argument("--beam-python", default=None, help="interpreter with apache-beam for beam_jobs.shard")
    p.add_argument("--work", default=None, help="data/work dir (default bench/_work/compare-<profile>)")
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--only", default=",".join(workers_report.MEASUREMENTS),
                   help="which measurements to run: issue 16 " + ",".join(workers_report.MEASUREMENTS)
                        + " (the default); issue 6 " + ",".join(ISSUE6))
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the shipped one)")
    p.add_argument("--num-docs", type=int, default=None, help="override the profile's documents per source")
    p.add_argument("--seconds", type=float, default=None, help="override the timed seconds per run")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--resume-steps", default=None, help="comma-separated steps (default 10,1000,100000)")
    p.add_argument("--resume-deadline", type=float, default=None, help="seconds allowed to reach the last step")
    p.add_argument("--elastic-steps", type=int, default=None)
    p.add_argument("--render-only", action="store_true",
                   help="rewrite the section(s) from the work dir's saved results without measuring")
    p.add_argument("--cases", default=None,
                   help="issue 16: re-measure only these cases (comma-separated keys such as zephon|pretok|k2, "
                        "as in the log) and merge them into the work dir's saved results (every other figure "
                        "is kept; the section names the re-measured cases)")
    a = p.parse_args(argv)

    name = "quick" if a.quick else "full"
    prof = dict(PROFILES[name])
    for k in ("num_docs", "seconds", "repeats", "resume_deadline", "elastic_steps"):
        if getattr(a, k) is not None:
            prof[k] = getattr(a, k)
    if a.resume_steps:
        prof["resume_steps"] = tuple(int(x) for x in a.resume_steps.split(","))
    if not os.path.exists(a.python):
        raise SystemExit(f"{a.python} does not exist: run `bash bench/setup_peers.sh` first (or pass --python)")
    loaders = [x for x in a.loaders.split(",") if x]
    unknown = set(loaders) - set(LOADERS)
    if unknown:
        raise SystemExit(f"unknown loaders {sorted(unknown)}; known: {LOADERS}")
    only = set(a.only.split(","))
    bad = only - set(ISSUE6) - set(workers_report.MEASUREMENTS)
    if bad:
        raise SystemExit(f"unknown measurements {sorted(bad)}; known: {ISSUE6 + workers_report.MEASUREMENTS}")
    work = os.path.abspath(a.work or os.path.join(REPO, "bench", "_work", f"compare-{name}"))
    os.makedirs(work, exist_ok=True)
    r = Runner(a.python, os.path.join(work, "compare.log"))
    command = "python -m bench.compare" + "".join(" " + shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    if a.render_only:
        if only & set(ISSUE6):
            a.chart = a.chart or os.path.join(REPO, "bench", "compare_throughput.png")
            render_only(a, work, loaders, r)
        if only & set(workers_report.MEASUREMENTS):
            render_issue16(work, a.out, r)
        return 0
    t0 = time.perf_counter()
    print(f"[compare] profile {name}, work dir {work}, log {r.log.name}", flush=True)
    print("[compare] " + machine_line(load=True), flush=True)
    print("[compare] preparing data", flush=True)
    prepare_status = prepare_data(r, work, prof, loaders, a.tokenizer, a.beam_python or default_beam_python())
    ok = [n for n in loaders if not prepare_status.get(DATA_OF.get(n, n), {}).get("error")]
    if only & set(workers_report.MEASUREMENTS):
        # the quick profile is a smoke test: its chart stays in the (git-ignored) work dir
        chart16 = a.chart or (os.path.join(work, "workers_quick.png") if a.quick
                              else os.path.join(REPO, "bench", "workers_overhead.png"))
        run_issue16(r, work, prof, ok, only, command, a.out, chart16, prepare_status, t0,
                    cases_filter=set(a.cases.split(",")) if a.cases else None)
    if only & set(ISSUE6):
        run_issue6(r, work, prof, loaders, ok, only, command, a.out,
                   a.chart or os.path.join(REPO, "bench", "compare_throughput.png"), prepare_status, name, t0)
    return 0


def run_issue6(r: Runner, work: str, prof: dict, loaders: list[str], ok: list[str], only: set, command: str,
               out: str, chart_path: str, prepare_status: dict, name: str, t0: float) -> None:
    """The issue 6 comparison: throughput of three modes, resume, elasticity."""
    loaders = [n for n in loaders if n not in PACKED]  # its tables predate the pre-packed rows
    ok = [n for n in ok if n not in PACKED]
    results: dict = {"out": out, "prepare": prepare_status}
    for n in loaders:
        if n not in ok:
            err = {"error": "data preparation failed: " + results["prepare"][DATA_OF.get(n, n)]["error"]}
            results.setdefault("throughput", {}).update({(n, m): err for m in MODES})
    print("[compare] floors", flush=True)
    results["floors"] = measure_floors(r, work, prof)
    results.setdefault("throughput", {})
    if "throughput" in only:
        print("[compare] throughput", flush=True)
        results["throughput"].update(measure_throughput(r, work, prof, ok))
    stream_loaders = [n for n in ok if n not in THROUGHPUT_ONLY]
    results["resume"] = {n: {s: {"error": "data preparation failed"} for s in prof["resume_steps"]} for n in loaders if n not in ok}
    if "resume" in only:
        print("[compare] resume", flush=True)
        results["resume"].update(measure_resume(r, work, prof, stream_loaders))
    results["elastic"] = {n: {"error": "data preparation failed"} for n in loaders if n not in ok}
    if "elastic" in only:
        print("[compare] elasticity", flush=True)
        results["elastic"].update(measure_elasticity(r, work, prof, stream_loaders))
    rows = [{"loader": PEER_LABELS[n], **{m: results["throughput"].get((n, m), {}).get("tokens_per_s") for m in MODES}}
            for n in loaders]
    title = (f"tokens/s per loader, seq_len {prof['seq_len']}, global batch {prof['global_batch']}, "
             f"{prof['num_workers']} workers, {machine_line().split(',')[0]} ({name} profile)")
    chart_res = r.run("chart", {"kind": "throughput_chart", "kwargs": {"rows": rows, "out": chart_path, "title": title}},
                      timeout=120)
    chart = chart_path if "error" not in chart_res else None
    if chart is None:
        print(f"[compare] chart failed: {chart_res['error']}", flush=True)
    versions = peer_versions(r.python)
    elapsed = time.perf_counter() - t0
    saved = {k: ({"|".join(kk): vv for kk, vv in v.items()} if k == "throughput" else v) for k, v in results.items()}
    saved.update({"profile": prof, "command": command, "elapsed": elapsed, "chart": chart, "versions": versions})
    with open(os.path.join(work, "results.json"), "w") as fh:
        json.dump(saved, fh, indent=1, default=str)
    section = render(results, prof, loaders, command, versions, work, elapsed, chart)
    write_section(out, section)
    print(f"[compare] wrote {out} and {chart_path} in {elapsed / 60:.1f} min", flush=True)


# --------------------------------------------------------------------------------------
# Issue 16.


def run_issue16(r: Runner, work: str, prof: dict, ok: list[str], only: set, command: str, out: str,
                chart_path: str, prepare_status: dict, t0: float, cases_filter: Optional[set] = None) -> None:
    """Floors, busy-trainer overhead, replay throughput and RSS (``bench/workers_report.py``);
    the section is rewritten after every stage, so an interrupted run still records what it has.
    ``cases_filter``: re-measure only those cases, merged into the saved results."""
    info = json.load(open(os.path.join(work, "corpus", "info.json")))
    corpus_tokens = info["sources"]["web"]["tokens"]
    path = os.path.join(work, "results16.json")
    results: dict = {"profile": prof, "command": command, "corpus_tokens": corpus_tokens,
                     "load_start": machine_line(load=True), "loaders": ok, "chart": chart_path,
                     "prepare_errors": {k: v["error"] for k, v in prepare_status.items()
                                        if isinstance(v, dict) and v.get("error")}}
    if cases_filter:
        with open(path) as fh:
            saved = json.load(fh)
        saved.setdefault("reruns", []).append({"command": command, "cases": sorted(cases_filter),
                                               "load_start": machine_line(load=True), "code": code_version()})
        results = saved
        only = only - {"floors"}
        t0 -= results.get("elapsed", 0.0)  # elapsed: the first run's plus this one's

    def chosen(cases: dict) -> dict:
        return cases if not cases_filter else {k: v for k, v in cases.items() if k in cases_filter}

    def mk(loader: str, mode: str, **kw) -> dict:
        return spec(loader, mode, work, prof, **kw)

    def stage_done() -> None:
        results["elapsed"] = time.perf_counter() - t0
        results["load_end" if not cases_filter else "load_end_reruns"] = machine_line(load=True)
        workers_report.save(path, results)
        render_issue16(work, out, r)

    if not cases_filter:
        results["versions"] = peer_versions(r.python)
        results["code"] = code_version()
    loaders = [n for n in ok if n not in THROUGHPUT_ONLY]

    def replay() -> None:
        cases = chosen(workers_report.replay_cases(loaders, mk, prof, corpus_tokens))
        results.setdefault("replay", {}).update(workers_report.run_rounds(
            r.run, "throughput", cases, prof["repeats"], prof["timeout"],
            lambda k, x: f"{x['tokens_per_s'] / 1e6:8.2f} M tok/s ({x['tokens'] / corpus_tokens:.2f} epochs)"))

    def rss() -> None:
        if "zephon" not in loaders:
            return
        small = sum(f["tokens"] or 0 for f in json.load(open(os.path.join(
            work, "formats", "zephon", workers_report.RSS_DATASETS["N"], "manifest.json")))["files"])
        results.setdefault("rss", {}).update(workers_report.run_rounds(
            r.run, "throughput", chosen(workers_report.rss_cases(mk, prof, small)), prof["repeats"], prof["timeout"],
            lambda k, x: f"{x['tree_rss_mb']:.0f} MB ({x['descendants']} workers)"))

    def trainer(modes: tuple[str, ...]) -> None:
        if "calibration" not in results:
            cal = r.run("calibrate", {"busy_ms": prof["busy_ms"]}, timeout=120)
            if "error" in cal:
                raise SystemExit(f"calibration failed: {cal['error']}")
            results["calibration"] = cal
        cal = results["calibration"]
        print(f"[compare] trainer {'/'.join(modes)} (busy loop: {cal['busy_iters']} iterations = "
              f"{cal['busy_ms_median']:.2f} ms median)", flush=True)
        cases = chosen(workers_report.trainer_cases(loaders, mk, prof, cal["busy_iters"], modes))
        nominal = prof["busy_ms"] + prof["sleep_ms"]
        results.setdefault("trainer", {}).update(workers_report.run_rounds(
            r.run, "trainer", cases, prof["repeats"], TRAINER_TIMEOUT_S,
            lambda k, x: f"{(x['step_ms'] - nominal) * 1e3:+7.0f} us/step, next p99 {x['next_p99_ms']:.3f} ms, "
                         f"{x['tokens_per_s'] / 1e6:.2f} M tok/s, first {x['first_batch_s']:.2f} s, "
                         f"restore {x.get('restore_new_s', float('nan')):.2f} s"))

    # The goals' cases first (pre-tokenized with the busy trainer, replay, RSS), the text cases of
    # the busy trainer last: an interrupted run has recorded what the goals need.
    stages = [("floors", lambda: results.__setitem__("floors", measure_floors(r, work, prof))),
              ("trainer", lambda: trainer(("pretok",))), ("replay", replay), ("rss", rss),
              ("trainer", lambda: trainer(("text",)))]
    for name, stage in stages:
        if name in only:
            started = time.perf_counter()
            if name in ("floors", "replay", "rss"):
                print(f"[compare] {name}", flush=True)
            stage()
            results.setdefault("stage_minutes", []).append([name, round((time.perf_counter() - started) / 60, 2)])
            stage_done()
    print(f"[compare] wrote {out} in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


def code_version() -> str:
    """The commit measured, and whether the working tree had changes (other engineers' too)."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else "?"

    dirty = git("status", "--porcelain", "--", "loader")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in loader/" if dirty else "")


def render_issue16(work: str, out: str, r: Optional[Runner] = None) -> None:
    with open(os.path.join(work, "results16.json")) as fh:
        results = json.load(fh)
    prof = results["profile"]
    info = json.load(open(os.path.join(work, "corpus", "info.json")))
    chart = results.get("chart")
    if r is not None and chart:
        res = r.run("chart", {"kind": "workers_chart", "kwargs": {
            "panels": workers_report.chart_rows(results, prof), "out": chart,
            "title": f"seq_len {prof['seq_len']}, batch {prof['global_batch']}, {machine_line().split(',')[0]}, "
                     f"{results['corpus_tokens'] / 1e6:.0f} M-token corpus"}}, timeout=120)
        if "error" in res:
            print(f"[compare] chart failed: {res['error']}", flush=True)
            chart = None
    elif chart and not os.path.exists(chart):
        chart = None
    src = info["sources"]["web"]
    header = [
        f"Generated by `{results['command']}` in {results.get('elapsed', 0) / 60:.1f} min (every figure below; "
        "do not edit by hand, rerun the command, or `--render-only` to redraw from the saved results).",
        "",
        f"- Machine: {machine_line()}. Load average (1 / 5 / 15 min) at the start: "
        f"{results['load_start'].rsplit('load average ', 1)[-1]}, at the end: {results.get('load_end', '').rsplit('load average ', 1)[-1]}"
        " (the machine is shared with other work; each case runs once per round, the rounds interleaved).",
        f"- Code: Zephon at {results.get('code', '?')}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items()),
        f"- Corpus: `bench/peers/corpus.py` (seed {info['seed']}), source `web`: {src['docs']:,} documents, "
        f"{src['tokens']:,} tokens (mean {src['mean_doc_tokens']:.0f} per document, EOS after each), "
        f"{info.get('files_per_source', 4)} JSONL files; tokenizer `{os.path.relpath(info['tokenizer'], REPO)}` "
        f"(vocab {info['vocab_size']}). Zephon reads it sharded by `python -m beam_jobs.shard --num-lanes 16` "
        "(`web-ids` pre-tokenized, `web-text` text, `web-ids-tenth` = the first JSONL file of ten, for the RSS pair).",
        f"- Every loader: seq_len {prof['seq_len']}, batch {prof['global_batch']} rows, world size 1, seed 0, each "
        f"case in a fresh process of the peers venv, medians of {prof['repeats']} repeat(s). Peers are set up as "
        "their docs recommend: batched tokenization (`encode_batch_fast`, 64 documents per call, in the workers "
        "where the peer's loader has a collate step: Streaming, LitData, torchdata; HF `map(batched=True)`; "
        "Energon and Grain hand out single documents and are batched in the consuming process), their "
        "pre-packed format as separate rows (LitData `optimize` + `TokensLoader`; MDS rows as llm-foundry's "
        "`concat_tokens`; ArrayRecord rows for Grain; a `.npy` of rows for torchdata; an Arrow dataset of "
        "`group_texts` rows for HF datasets), their own worker processes (`num_workers=2`: torch "
        "`DataLoader`/`StatefulDataLoader`/`StreamingDataLoader` workers, Grain `mp_prefetch`, Energon "
        "`WorkerConfig`; Zephon's own workers). Setup per peer: the docstring of each `bench/peers/<peer>.py`.",
    ]
    for rerun in results.get("reruns", []):
        header.append(f"- Re-measured after the run and merged in (every other figure is the run's): "
                      f"{', '.join('`' + c + '`' for c in rerun['cases'])}, by `{rerun['command']}` (Zephon at "
                      f"{rerun['code']}; load average at its start {rerun['load_start'].rsplit('load average ', 1)[-1]}).")
    if results.get("prepare_errors"):
        header.append("- Left out (data preparation failed): " + "; ".join(
            f"{k}: {v}" for k, v in results["prepare_errors"].items()))
    section = workers_report.render(results, prof, header, chart, out)
    write_section(out, section)


if __name__ == "__main__":
    raise SystemExit(main())
