"""One measurement of one loader, in this (fresh) process: ``python -m bench.peers.run TASK SPEC_JSON``.

Prints one line ``RESULT_JSON: {...}`` at the end; on failure ``{"error": "..."}`` and exit 1.
Tasks:

``prepare``      convert the corpus into the loader's own format
``throughput``   warm up, then run the consuming loop for ``seconds`` (or ``max_steps``)
``fingerprints`` save the first ``steps`` per-rank batches to ``out`` (.npy) for the
                 elasticity check (the parent merges ranks and hashes)
``resume_save``  run to each step in ``steps``, pickle the state there, record the next 10 batches
``resume_load``  construct, ``load_state_dict`` a saved state, time until the 1st and 10th batch
``calibrate``    pure-Python loop iterations that hold the GIL for ``busy_ms`` (run once per run)
``trainer``      the busy-trainer measurement (issue 16): per batch a simulated training step
                 that holds the GIL for ``busy_ms`` (``busy_iters`` of the calibrated loop) and
                 then sleeps ``sleep_ms`` (GIL released, as a trainer waiting on the device);
                 reports the wall time per step, the time inside ``next()`` (p50/p99/max),
                 tokens/s, the first batch from construction and after a restore (into the
                 running loader and into a new one), and the peak RSS of the process tree

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
    "streaming_packed": "bench.peers.streaming_mds",  # pre-packed rows (pre-tokenized only)
    "litdata": "bench.peers.litdata_peer",
    "grain": "bench.peers.grain_peer",
    "grain_packed": "bench.peers.grain_peer",
    "energon": "bench.peers.energon_peer",
    "torchdata": "bench.peers.torchdata_peer",
    "torchdata_packed": "bench.peers.torchdata_peer",
    "hf_datasets": "bench.peers.hf_datasets_peer",
    "hf_packed": "bench.peers.hf_datasets_peer",
}
PACKED = tuple(name for name in ADAPTERS if name.endswith("_packed"))  # prepared per seq_len


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


def tree_peak_rss_mb() -> dict:
    """Peak RSS (``VmHWM``) of this process plus that of every live descendant (worker
    processes), in MB, and how many descendants there were. Read while the loader runs:
    ``RUSAGE_CHILDREN`` only covers children already reaped, and only the largest one.
    Shared memory mapped by several processes counts in each (an upper bound)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    parents[int(name)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = [os.getpid()], [os.getpid()]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    total = 0.0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) / 1024.0
        except OSError:
            pass
    return {"tree_rss_mb": round(total, 1), "descendants": len(tree) - 1}


def check_shape(rows: np.ndarray, spec: Spec) -> None:
    if rows.shape != (spec.rank_batch, spec.seq_len):
        raise AssertionError(f"batch shape {rows.shape} != {(spec.rank_batch, spec.seq_len)}")


def task_prepare(args: dict) -> dict:
    layout = Layout(args["data_dir"])
    mod = adapter(args["loader"])
    t0 = time.perf_counter()
    prepare = mod.prepare_packed if args["loader"] in PACKED else mod.prepare
    out = prepare(layout, **args.get("options", {})) or {}
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
    # max_tokens: one corpus' worth (or a few), so that no loader replays its data many times
    # inside a window however fast it is
    max_tokens = int(args.get("max_tokens", 10**15))
    start = time.perf_counter()
    while True:
        rows = as_rows(next(it))
        tokens += rows.size
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget or steps >= max_steps or tokens >= max_tokens:
            break
    total = time.perf_counter() - t0
    tree = tree_peak_rss_mb()
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
    out.update(tree)
    return out


def tree_cpu_s() -> dict:
    """CPU seconds (user + system) so far of this process and of its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    me, kids = os.getpid(), 0.0
    own = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if int(name) == me:
            own = cpu
        elif int(fields[1]) == me or _descends(int(fields[1]), me):
            kids += cpu
    return {"own_cpu_s": own, "workers_cpu_s": kids}


def _descends(pid: int, ancestor: int) -> bool:
    for _ in range(8):  # a few generations: the loaders' workers are children or grandchildren
        if pid <= 1:
            return False
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def busy_loop(iters: int) -> int:
    """The simulated trainer's Python work: holds the GIL for as long as it runs."""
    x = 0
    for i in range(iters):
        x += i
    return x


def task_calibrate(args: dict) -> dict:
    """Iterations of :func:`busy_loop` that take ``busy_ms``: the fastest of many timings
    (the machine is shared: the fastest is the loop's own cost, the rest is other work)."""
    probe = 20000
    best = min(_timed(busy_loop, probe) for _ in range(200))
    iters = max(1, round(probe * float(args["busy_ms"]) / 1e3 / best))
    check = sorted(_timed(busy_loop, iters) for _ in range(200))
    return {"busy_iters": iters, "busy_ms_min": check[0] * 1e3, "busy_ms_median": check[100] * 1e3}


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


class _NoLoader:
    """Baseline of the trainer measurement: ``next()`` returns one prepared batch (the
    trainer's own cost: sleep overshoot, the busy loop under load, the loop itself)."""

    def __init__(self, spec: Spec) -> None:
        self.batch = np.zeros((spec.rank_batch, spec.seq_len), dtype=np.int64)

    def __iter__(self):
        return self

    def __next__(self):
        return self.batch

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass

    def close(self) -> None:
        pass


def _open(spec: Spec, layout: Layout):
    return _NoLoader(spec) if spec.loader == "none" else adapter(spec.loader).open_session(spec, layout)


class _ZephonTimers:
    """``breakdown``: where Zephon's ``next()`` spends its time, by wrapping (in this process
    only) the worker pool's ``receive`` (waiting on the pipe + reading a message), the
    message reader, and the batch builder ``ZephonLoader._collate``. Totals in seconds."""

    def __init__(self) -> None:
        from loader import pipeline
        from loader.workers import pool

        self.totals = {"receive_s": 0.0, "read_message_s": 0.0, "collate_s": 0.0, "receives": 0}
        receive, read_message, collate = pool.WorkerPool.receive, pool.read_message, pipeline.ZephonLoader._collate
        totals = self.totals

        def timed(fn, name):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    totals[name] += time.perf_counter() - t
                    if name == "receive_s":
                        totals["receives"] += 1
            return wrapper

        pool.WorkerPool.receive = timed(receive, "receive_s")
        pool.read_message = timed(read_message, "read_message_s")
        pipeline.ZephonLoader._collate = timed(collate, "collate_s")

    def snapshot(self) -> dict:
        return dict(self.totals)


def task_trainer(args: dict) -> dict:
    spec = Spec(**args["spec"])
    layout = Layout(spec.data_dir)
    if spec.loader != "none":
        getattr(adapter(spec.loader), "imports", lambda: None)()
    timers = _ZephonTimers() if args.get("breakdown") and spec.loader.startswith("zephon") else None
    busy_iters, sleep_s = int(args["busy_iters"]), float(args["sleep_ms"]) / 1e3
    steps, warmup = int(args["steps"]), int(args.get("warmup", 20))
    t0 = time.perf_counter()
    sess = _open(spec, layout)
    it = iter(sess)
    check_shape(as_rows(next(it)), spec)
    first_batch_s = time.perf_counter() - t0
    waits = np.zeros(steps)
    busy = np.zeros(steps)
    tokens = 0
    max_seconds = float(args.get("max_seconds", 1e9))  # a slow loader ends its window early
    start = time.perf_counter()
    before = timers.snapshot() if timers else None
    cpu_before = tree_cpu_s()
    second_batch_wait_s = None
    done = 0
    warmup_deadline = time.perf_counter() + float(args.get("max_warmup_seconds", 1e9))
    step = -warmup
    while step < steps:
        if step < -1 and time.perf_counter() > warmup_deadline:
            step = -1  # a slow loader: its last warm-up step now (the same rule for every loader)
        a = time.perf_counter()
        batch = next(it)
        b = time.perf_counter()
        n = as_rows(batch).size  # what a trainer does first: take the batch as a tensor
        c = time.perf_counter()
        busy_loop(busy_iters)  # the step's Python work (kernel launches), GIL held
        d = time.perf_counter()
        time.sleep(sleep_s)  # the device computing, GIL released
        if step == -warmup:  # the second batch: with lanes split over workers it needs the other worker
            second_batch_wait_s = b - a
        if step == -1:
            start = time.perf_counter()
            before = timers.snapshot() if timers else None
            cpu_before = tree_cpu_s()
        elif step >= 0:
            waits[step] = b - a
            busy[step] = d - c
            tokens += n
            done = step + 1
            if time.perf_counter() - start >= max_seconds:
                break
        step += 1
    wall = time.perf_counter() - start
    cpu_after = tree_cpu_s()
    waits, busy = waits[:done], busy[:done]
    out = {"steps": done, "tokens": tokens, "seconds": wall, "step_ms": wall / done * 1e3,
           "tokens_per_s": tokens / wall, "first_batch_s": first_batch_s, "second_batch_wait_s": second_batch_wait_s,
           "next_p50_ms": float(np.percentile(waits, 50) * 1e3), "next_p99_ms": float(np.percentile(waits, 99) * 1e3),
           "next_max_ms": float(waits.max() * 1e3), "next_mean_ms": float(waits.mean() * 1e3),
           "busy_ms_mean": float(busy.mean() * 1e3), "next_max_at_step": int(waits.argmax()),
           # CPU per timed step: the trainer process (all its threads, the busy loop included)
           # and its worker processes (those alive at both ends of the window)
           "own_cpu_ms_per_step": (cpu_after["own_cpu_s"] - cpu_before["own_cpu_s"]) * 1e3 / done,
           "workers_cpu_ms_per_step": (cpu_after["workers_cpu_s"] - cpu_before["workers_cpu_s"]) * 1e3 / done}
    if timers is not None:  # per timed step, in ms
        after = timers.snapshot()
        out["breakdown_ms_per_step"] = {k: (after[k] - before[k]) * (1e3 if k.endswith("_s") else 1) / done
                                        for k in after}
    out.update(tree_peak_rss_mb())
    out.update(rss())
    # Restores, timed to the first batch: into the running loader, then into a new loader
    # (built, restored, first batch: what a resumed job does once its imports are done).
    # Each on its own: some loaders refuse the first (Energon: not while its workers run).
    state = sess.state_dict()
    try:
        a = time.perf_counter()
        sess.load_state_dict(state)
        next(iter(sess))
        out["restore_inplace_s"] = time.perf_counter() - a
    except Exception as exc:  # noqa: BLE001 - a loader that cannot restore still has its other numbers
        out["restore_inplace_error"] = f"{type(exc).__name__}: {exc}"[:200]
    sess.close()
    try:
        a = time.perf_counter()
        sess = _open(spec, layout)
        sess.load_state_dict(state)
        next(iter(sess))
        out["restore_new_s"] = time.perf_counter() - a
        sess.close()
    except Exception as exc:  # noqa: BLE001
        out["restore_new_error"] = f"{type(exc).__name__}: {exc}"[:200]
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
    """The floors (:mod:`bench.floors`) on the lane files Zephon reads: a bare pyarrow scan of
    ``formats/zephon/web-ids``, ``encode_batch_fast`` on the text of ``formats/zephon/web-text``."""
    from bench import floors

    layout = Layout(args["data_dir"])
    budget = float(args["seconds"])
    if args["kind"] == "scan":
        out = floors.scan_floor(floors.lane_files(os.path.join(layout.formats("zephon"), "web-ids")), budget)
    else:
        groups = floors.text_row_groups(floors.lane_files(os.path.join(layout.formats("zephon"), "web-text")),
                                        int(args.get("max_docs", 40000)))
        out = floors.tokenizer_floor(layout.info()["tokenizer"], groups, budget)
    return {"tokens_per_s": out["tokens"] / out["seconds"], **out, **rss()}


def task_chart(args: dict) -> dict:
    from bench.peers import chart

    getattr(chart, args.get("kind", "throughput_chart"))(**args["kwargs"])
    return {"out": args["kwargs"]["out"]}


RESUME_CHECK_BATCHES = 10

TASKS = {"floor": task_floor, "chart": task_chart, "prepare": task_prepare, "throughput": task_throughput,
         "fingerprints": task_fingerprints, "resume_save": task_resume_save, "resume_load": task_resume_load,
         "calibrate": task_calibrate, "trainer": task_trainer}


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
