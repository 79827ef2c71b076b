"""Where Zephon's pre-tokenized replay spends its CPU (issue 6 profile), per thread.

    python bench/thread_profile.py [--steps 5000] [--loader zephon|zephon_full] [--mode pretok|mix]
        [--read-ahead-threads N] [--work bench/_work/compare-quick]

Uses the Zephon datasets of ``python -m bench.compare --quick`` (run that first) and the
same loader setup as its measurement (1) (``--mode mix``: (3)): seq_len 1024, global batch
16, 0 workers. Prints,
per global step, the wall time, the CPU time of the trainer's thread (and of it the batch
builder, ``ZephonLoader._collate``), the CPU time of the read-ahead threads, the time the
trainer's thread waited for a block, and the wall / CPU time of one block read on the
read-ahead thread compared with the same reads on an otherwise idle thread.

    python bench/thread_profile.py --workers 2 [--batches 1500] [--pace-ms 5] [--drain-s 3]
        [--no-read-ahead] [--work bench/_work/compare-full]

Issue 16, with worker processes (the full profile's shape: seq_len 2048, batch 8, the
``bench.compare`` full corpus): the longest waits inside ``next()`` and at which micro-batch
they happen (with ``--pace-ms`` of sleep after each batch, a trainer that leaves the workers
time), and the CPU the worker processes and the trainer process spend per micro-batch,
consumed as fast as possible (for ``--drain-s`` seconds, with the tokens/s) and paced.

    python bench/thread_profile.py --workers 2 --mode text --timeline 12 [--pace-ms 4]

The first seconds of a busy trainer (1 ms holding the GIL + ``--pace-ms`` of sleep per batch, as
``bench.compare``'s trainer rows) with workers, second by second: tokens/s, the longest wait in
``next()``, the trainer process's CPU per step, and who produces (the trainer's own lanes during
the warm start, with or without a lead after the hand-over, or the workers alone).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--loader", default="zephon", choices=("zephon", "zephon_full"),
                        help="zephon: input_ids only, as in the comparison's 'Zephon' row; zephon_full: "
                             "the default full batch")
    parser.add_argument("--mode", default="pretok", choices=("pretok", "mix", "text"),
                        help="pretok: measurement (1) of the comparison; mix: (3), the 0.7/0.3 two-source mix; "
                             "text: tokenized online (--workers only)")
    parser.add_argument("--read-ahead-threads", type=int, default=None,
                        help="LoaderConfig.read_ahead_threads (default: the loader's default)")
    parser.add_argument("--work", default=None, help="bench.compare work dir (default: compare-quick, with "
                                                        "--workers compare-full)")
    parser.add_argument("--workers", type=int, default=0, help="> 0: the worker-process profile (issue 16)")
    parser.add_argument("--batches", type=int, default=1500)
    parser.add_argument("--pace-ms", type=float, default=5.0)
    parser.add_argument("--drain-s", type=float, default=3.0,
                        help="with --workers: seconds consumed as fast as possible (after the paced batches)")
    parser.add_argument("--no-read-ahead", action="store_true")
    parser.add_argument("--timeline", type=float, default=0.0,
                        help="with --workers: seconds of a busy trainer, reported second by second")
    args = parser.parse_args(argv)
    if args.workers > 0:
        return worker_profile(args)
    args.work = args.work or str(REPO_ROOT / "bench" / "_work" / "compare-quick")

    from bench.machine import cpu_model, load_average
    from bench.peers import zephon
    from bench.peers.common import Layout, Spec
    from loader.io import lane_reader
    from loader import pipeline

    reads: list[tuple[str, float, float]] = []  # (thread, wall s, cpu s) per block read
    waits = [0.0]
    collate_cpu = [0.0]
    read_block, settle, collate = (lane_reader.LaneTokenStream._read_block,
                                   lane_reader.LaneTokenStream._settle_read_ahead, pipeline.ZephonLoader._collate)

    def timed_read(self, *a, **k):
        wall, cpu = time.perf_counter(), time.thread_time()
        block = read_block(self, *a, **k)
        reads.append((threading.current_thread().name, time.perf_counter() - wall, time.thread_time() - cpu))
        return block

    def timed_settle(self, wanted=None):
        start = time.perf_counter()
        try:
            return settle(self, wanted)
        finally:
            waits[0] += time.perf_counter() - start

    def timed_collate(self, items):
        start = time.thread_time()
        try:
            return collate(self, items)
        finally:
            collate_cpu[0] += time.thread_time() - start

    lane_reader.LaneTokenStream._read_block = timed_read
    lane_reader.LaneTokenStream._settle_read_ahead = timed_settle
    pipeline.ZephonLoader._collate = timed_collate

    layout = Layout(args.work)
    spec = Spec(loader=args.loader, mode=args.mode, data_dir=layout.root, seq_len=1024, global_batch=16)
    overrides = {} if args.read_ahead_threads is None else {"read_ahead_threads": args.read_ahead_threads}
    session = zephon.open_session(spec, layout, **overrides)
    threads = session.cfg.read_ahead_threads
    batches = iter(session)
    for _ in range(50):  # start-up: every lane has read its first blocks
        next(batches)
    reads.clear()
    waits[0] = collate_cpu[0] = 0.0
    wall, main_cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(args.steps):
        next(batches)
    wall, main_cpu = time.perf_counter() - wall, time.thread_time() - main_cpu
    process_cpu = time.process_time() - process_cpu
    session.close()
    background = [r for r in reads if r[0] != "MainThread"]

    # The same kind of reads on an idle thread: 3 epochs of every lane, read directly.
    manifest_path = Path(layout.formats("zephon")) / "web-ids"
    from loader.io.blocks import TokenFormat
    from loader.io.lane_reader import LaneTokenStream
    from loader.io.manifest import read_manifest

    manifest = read_manifest(str(manifest_path))
    reads.clear()
    for lane in range(manifest.num_lanes):
        stream = LaneTokenStream(dataset_path=str(manifest_path), manifest=manifest, source_name="web",
                                 lane_id=lane, seed=0, token_format=TokenFormat(None, 0))
        for epoch in (1, 2, 3):
            for file_ordinal, row_group in stream.blocks_of_epoch(epoch):
                stream._read_block(epoch, file_ordinal, row_group)
        stream.close()
    idle = list(reads)

    per_step = 1e6 / args.steps
    mean = lambda rs, k: sum(r[k] for r in rs) / max(1, len(rs)) * 1e3  # noqa: E731  ms
    print(f"python bench/thread_profile.py --steps {args.steps} --loader {args.loader} --mode {args.mode}"
          + ("" if args.read_ahead_threads is None else f" --read-ahead-threads {args.read_ahead_threads}")
          + f"  (read_ahead_threads={threads})")
    print(f"nproc {os.cpu_count()}, {cpu_model()}; load average {load_average()}")
    print(f"per global step (16 x 1024 tokens): wall {wall * per_step:.0f} us; trainer thread CPU "
          f"{main_cpu * per_step:.0f} us (batch builder {collate_cpu[0] * per_step:.0f} us); other threads CPU "
          f"{(process_cpu - main_cpu) * per_step:.0f} us; trainer waited for blocks {waits[0] * per_step:.0f} us")
    print(f"tokens/s {args.steps * 16 * 1024 / wall / 1e6:.1f} M; process CPU / wall {process_cpu / wall:.2f}")
    print(f"block read on the read-ahead thread: {mean(background, 1):.2f} ms wall, {mean(background, 2):.2f} ms CPU "
          f"({len(background)} reads); on an idle thread: {mean(idle, 1):.2f} ms wall, {mean(idle, 2):.2f} ms CPU "
          f"({len(idle)} reads)")
    return 0


def worker_profile(args) -> int:
    import numpy as np

    from bench.machine import machine_line
    from bench.peers import zephon
    from bench.peers.common import Layout, Spec
    from bench.peers.run import tree_cpu_s

    layout = Layout(args.work or str(REPO_ROOT / "bench" / "_work" / "compare-full"))
    options = {"read_ahead": False} if args.no_read_ahead else {}
    spec = Spec(loader=args.loader, mode="text" if args.mode == "text" else "pretok", data_dir=layout.root,
                seq_len=2048, global_batch=8, num_workers=args.workers, options=options)
    if args.timeline:
        return busy_timeline(args, spec, layout)
    print(f"python bench/thread_profile.py --workers {args.workers} --loader {args.loader} --batches {args.batches} "
          f"--pace-ms {args.pace_ms:g} --drain-s {args.drain_s:g}"
          + (" --no-read-ahead" if args.no_read_ahead else "") + f"\n{machine_line()}")
    started = time.perf_counter()
    session = zephon.open_session(spec, layout)
    batches = iter(session)
    waits = []
    for _ in range(args.batches):
        t = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - t)
        time.sleep(args.pace_ms / 1e3)
    w = np.array(waits) * 1e3
    top = np.argsort(w)[::-1][:6]
    print(f"{args.batches} micro-batches in {time.perf_counter() - started:.1f} s; longest next() waits "
          "(micro-batch: ms): " + ", ".join(f"{int(i)}: {w[i]:.1f}" for i in top)
          + f"; p50 {np.percentile(w, 50):.3f} ms, p99 {np.percentile(w, 99):.3f} ms")
    # Flat out for --drain-s seconds (a few hundred micro-batches would mostly be the ones the
    # workers had ready), then paced.
    # The trainer process's CPU from process_time (clock ticks of /proc are 10 ms: a tenth of a
    # paced window's), the workers' from /proc; next()'s wall p99 per window.
    for label, pace in (("as fast as possible", 0.0), (f"paced {args.pace_ms:g} ms", args.pace_ms / 1e3)):
        n, before, own, t, waits = 0, tree_cpu_s(), time.process_time(), time.perf_counter(), []
        while (time.perf_counter() - t < args.drain_s) if pace == 0 else n < 300:
            a = time.perf_counter()
            next(batches)
            waits.append(time.perf_counter() - a)
            n += 1
            if pace:
                time.sleep(pace)
        after, own, seconds = tree_cpu_s(), time.process_time() - own, time.perf_counter() - t
        print(f"{label}: {n} micro-batches in {seconds:.2f} s ({n * 8 * 2048 / seconds / 1e6:.1f} M tok/s); CPU per "
              f"micro-batch: workers {(after['workers_cpu_s'] - before['workers_cpu_s']) / n * 1e3:.3f} ms, trainer "
              f"process {own / n * 1e3:.3f} ms; next() p99 {np.percentile(waits, 99) * 1e3:.3f} ms")
    session.close()
    return 0


def busy_timeline(args, spec, layout) -> int:
    """``--timeline``: a busy trainer's first seconds with workers (see the module docstring)."""
    from bench.machine import machine_line
    from bench.peers import zephon
    from bench.peers.run import busy_loop, task_calibrate

    print(f"python bench/thread_profile.py --workers {args.workers} --mode {spec.mode} --timeline {args.timeline:g} "
          f"--pace-ms {args.pace_ms:g}\n{machine_line()}")
    busy_iters = task_calibrate({"busy_ms": 1.0})["busy_iters"]  # the comparison's simulated trainer step
    session = zephon.open_session(spec, layout)
    batches = iter(session)
    tokens_per_batch = spec.global_batch * spec.seq_len
    started = last = time.perf_counter()
    steps, longest, cpu = 0, 0.0, time.process_time()
    while time.perf_counter() - started < args.timeline:
        busy_loop(busy_iters)
        time.sleep(args.pace_ms / 1e3)
        t = time.perf_counter()
        next(batches)
        longest = max(longest, time.perf_counter() - t)
        steps += 1
        if time.perf_counter() - last >= 1.0:
            run = session.loader._run
            who = ("trainer (warm start)" if run.warm_start else "workers + trainer's lead" if run.lead is not None
                   else "workers")
            elapsed = time.perf_counter() - last
            print(f"t={time.perf_counter() - started:5.1f} s: {steps * tokens_per_batch / elapsed / 1e6:5.2f} M tok/s, "
                  f"longest next() {longest * 1e3:4.0f} ms, trainer process CPU "
                  f"{(time.process_time() - cpu) / steps * 1e3:5.1f} ms/step, producing at the end: {who}")
            last, steps, longest, cpu = time.perf_counter(), 0, 0.0, time.process_time()
    session.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
