"""One measurement of one loader, in this (fresh) process: ``python -m bench.peers.run TASK SPEC_JSON``.

Prints one line ``RESULT_JSON: {...}`` at the end; on failure ``{"error": "..."}`` and exit 1.
Tasks:

``prepare``      convert the corpus into the loader's own format
``throughput``   warm up, then run the consuming loop for ``seconds`` (or ``max_steps``)
``fingerprints`` save the first ``steps`` per-rank batches to ``out`` (.npy) for the
                 elasticity check (the parent merges ranks and hashes)
``resume_save``  run to each step in ``steps``, pickle the state there, record the next 10 batches
``resume_load``  construct, ``load_state_dict`` a saved state, time until the 1st and 10th batch

The consuming loop is the same for every loader: take the batch, view it as an int64 numpy
array of shape [rank_batch, seq_len], count its tokens. For the mix, the source share is
measured on the batches after the timed window. Nothing is copied to a device.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import pickle
import resource
import sys
import time
import traceback
from typing import Any

import numpy as np

from bench.peers.common import Layout, ShareMeter, Spec, batch_fingerprint

ADAPTERS = {
    "zephon": "bench.peers.zephon",
    "zephon_full": "bench.peers.zephon",  # the full trainer batch (throughput only)
    "streaming": "bench.peers.streaming_mds",
    "litdata": "bench.peers.litdata_peer",
    "grain": "bench.peers.grain_peer",
    "energon": "bench.peers.energon_peer",
    "torchdata": "bench.peers.torchdata_peer",
    "hf_datasets": "bench.peers.hf_datasets_peer",
}


def adapter(name: str):
    if name not in ADAPTERS:
        raise ValueError(f"unknown loader {name!r}; known: {sorted(ADAPTERS)}")
    return importlib.import_module(ADAPTERS[name])


def as_rows(batch: Any) -> np.ndarray:
    if hasattr(batch, "numpy"):  # torch tensor
        batch = batch.numpy()
    return np.asarray(batch, dtype=np.int64)


def rss() -> dict:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    return {"rss_mb": round(own, 1), "children_rss_mb": round(kids, 1)}


def check_shape(rows: np.ndarray, spec: Spec) -> None:
    if rows.shape != (spec.rank_batch, spec.seq_len):
        raise AssertionError(f"batch shape {rows.shape} != {(spec.rank_batch, spec.seq_len)}")


def task_prepare(args: dict) -> dict:
    layout = Layout(args["data_dir"])
    mod = adapter(args["loader"])
    t0 = time.perf_counter()
    out = mod.prepare(layout, **args.get("options", {})) or {}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["version"] = mod.version()
    return out


SHARE_BATCHES = 2000  # mix: batches whose source share is measured, after the timed window


def task_throughput(args: dict) -> dict:
    t_import = time.perf_counter()
    spec = Spec(**args["spec"])
    layout = Layout(spec.data_dir)
    mod = adapter(spec.loader)
    meter = ShareMeter(layout) if spec.mode == "mix" else None
    getattr(mod, "imports", lambda: None)()
    t0 = time.perf_counter()
    sess = mod.open_session(spec, layout)
    it = iter(sess)
    first = as_rows(next(it))
    t_first = time.perf_counter() - t0
    check_shape(first, spec)
    warm_tokens = first.size
    for _ in range(args.get("warmup", 3)):
        warm_tokens += as_rows(next(it)).size
    shares: list[float] = []
    tokens = steps = 0
    budget, max_steps = float(args["seconds"]), int(args.get("max_steps", 10**9))
    start = time.perf_counter()
    while True:
        rows = as_rows(next(it))
        tokens += rows.size
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget or steps >= max_steps:
            break
    total = time.perf_counter() - t0
    if meter is not None:
        # The source shares are read back from the batches that follow the timed window (as
        # many as it held, up to SHARE_BATCHES): metering inside the window would charge the
        # measurement's work to the loader, and subtracting its time would credit loaders
        # whose background threads keep working meanwhile.
        for rows in itertools.islice(it, min(steps, SHARE_BATCHES)):  # a finite loader may end first
            shares.append(meter.share_a(as_rows(rows)))
    # steady state: the timed window only; end to end: everything from open_session() on,
    # which also charges work a loader front-loads before its first batch (e.g. tokenizing ahead)
    out = {"tokens_per_s": tokens / elapsed, "e2e_tokens_per_s": (tokens + warm_tokens) / total, "steps": steps,
           "tokens": tokens, "seconds": elapsed, "first_batch_s": t_first, "import_s": t0 - t_import}
    if meter is not None:
        s = np.asarray(shares)
        target = spec.weights[0] / sum(spec.weights)
        out.update({"share_mean": float(np.nanmean(s)), "dev_mean": float(np.nanmean(np.abs(s - target))),
                    "dev_max": float(np.nanmax(np.abs(s - target))), "target": target})
    sess.close()
    out.update(rss())
    return out


def task_fingerprints(args: dict) -> dict:
    spec = Spec(**args["spec"])
    mod = adapter(spec.loader)
    sess = mod.open_session(spec, Layout(spec.data_dir))
    it = iter(sess)
    batches = []
    for _ in range(int(args["steps"])):
        rows = as_rows(next(it))
        check_shape(rows, spec)
        batches.append(rows)
    sess.close()
    np.save(args["out"], np.stack(batches))
    return {"steps": len(batches), **rss()}


def _state_size(state: Any) -> dict:
    out = {"pickle_bytes": len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))}
    try:
        out["json_bytes"] = len(json.dumps(state, separators=(",", ":")).encode())
    except (TypeError, ValueError):
        out["json_bytes"] = None
    return out


def task_resume_save(args: dict) -> dict:
    spec = Spec(**args["spec"])
    mod = adapter(spec.loader)
    sess = mod.open_session(spec, Layout(spec.data_dir))
    it = iter(sess)
    targets = sorted(int(s) for s in args["steps"])
    deadline = time.perf_counter() + float(args.get("deadline_s", 1e9))
    done: dict = {}
    step = 0
    t0 = time.perf_counter()
    for target in targets:
        while step < target:
            next(it)
            step += 1
            if step % 256 == 0 and time.perf_counter() > deadline:
                break
        if step < target:
            done[str(target)] = {"error": f"did not reach step {target} within {args['deadline_s']} s "
                                          f"(stopped at step {step})"}
            break
        state = sess.state_dict()
        path = os.path.join(args["out_dir"], f"state-{target}.pkl")
        with open(path, "wb") as fh:
            pickle.dump(state, fh, protocol=pickle.HIGHEST_PROTOCOL)
        nxt = [batch_fingerprint(as_rows(next(it))) for _ in range(RESUME_CHECK_BATCHES)]
        step += RESUME_CHECK_BATCHES
        done[str(target)] = {"state": path, "next_fps": nxt,
                             "reached_after_s": time.perf_counter() - t0, **_state_size(state)}
    sess.close()
    return {"steps": done, **rss()}


def task_resume_load(args: dict) -> dict:
    spec = Spec(**args["spec"])
    mod = adapter(spec.loader)
    getattr(mod, "imports", lambda: None)()
    t0 = time.perf_counter()
    sess = mod.open_session(spec, Layout(spec.data_dir))
    t1 = time.perf_counter()
    with open(args["state"], "rb") as fh:
        state = pickle.load(fh)
    t2 = time.perf_counter()
    sess.load_state_dict(state)
    it = iter(sess)
    fps = [batch_fingerprint(as_rows(next(it)))]
    t3 = time.perf_counter()
    fps += [batch_fingerprint(as_rows(next(it))) for _ in range(RESUME_CHECK_BATCHES - 1)]
    t4 = time.perf_counter()
    sess.close()
    return {"construct_s": t1 - t0, "load_to_first_batch_s": t3 - t2, "load_to_tenth_batch_s": t4 - t2,
            "same_next_batches": fps == args["expect_fps"], **rss()}


def task_floor(args: dict) -> dict:
    """Floors: a bare pyarrow scan of the pre-tokenized Parquet, bare ``encode_batch`` on its text."""
    import glob

    layout = Layout(args["data_dir"])
    pdir = os.path.join(layout.corpus, "parquet", "web")
    budget = float(args["seconds"])
    tokens = 0
    if args["kind"] == "scan":
        import pyarrow.parquet as pq

        start = time.perf_counter()
        files = sorted(glob.glob(os.path.join(pdir, "ids-*.parquet")))
        while time.perf_counter() - start < budget:
            for f in files:
                for rb in pq.ParquetFile(f).iter_batches(columns=["input_ids"], batch_size=1024):
                    flat = rb.column(0).values.to_numpy()  # int32 ids of the batch, zero-copy
                    tokens += len(flat)
    else:
        import pyarrow.parquet as pq
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(layout.info()["tokenizer"])
        files = sorted(glob.glob(os.path.join(pdir, "text-*.parquet")))
        texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < budget:
            chunk = texts[i:i + 256] or texts[:256]
            i = i + 256 if i + 256 < len(texts) else 0
            tokens += sum(len(e.ids) for e in tok.encode_batch(chunk, add_special_tokens=False))
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed, **rss()}


def task_chart(args: dict) -> dict:
    from bench.peers.chart import throughput_chart

    throughput_chart(args["rows"], args["out"], args["title"])
    return {"out": args["out"]}


RESUME_CHECK_BATCHES = 10

TASKS = {"floor": task_floor, "chart": task_chart, "prepare": task_prepare, "throughput": task_throughput, "fingerprints": task_fingerprints,
         "resume_save": task_resume_save, "resume_load": task_resume_load}


def main(argv: list[str]) -> int:
    task, payload = argv[0], json.loads(argv[1])
    try:
        out = TASKS[task](payload)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, never swallowed
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        last = f"{type(exc).__name__}: {exc}".strip().splitlines()
        out = {"error": (last[0] if last else type(exc).__name__)[:300]}
        code = 1
    sys.stdout.write("\nRESULT_JSON: " + json.dumps(out) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # some peers leave non-daemon threads/pools behind; do not hang on them
