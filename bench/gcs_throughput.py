"""Reading lane files from gs:// (local GCS emulator) against local disk, in one run.

    python bench/gcs_throughput.py [--files 6] [--file-mb 8] [--repeats 3] [--only files|loader|all]

Generates a lane-file set (zstd Parquet, page checksums, ~1 MiB row groups, poorly
compressible text), writes it to a local directory and uploads it to an in-memory
``gcp-storage-emulator`` on 127.0.0.1, then reads every row group of every file the way the
loader does (``storage.open_lane_file`` -> ``pq.ParquetFile(page_checksum_verification=True)``
-> ``read_row_group(i, columns=["text"])``) in four setups:

* ``local``        local disk (the files were just written: in the OS page cache)
* ``gcs_nocache``  ranged GETs through ``RangedReader`` (8 MiB read-ahead)
* ``gcs_cold``     ``cache_dir`` set, empty: download + sha256, then read the copy
* ``gcs_warm``     ``cache_dir`` set, filled: sha256 check of the copy, then read it
* ``gcs_warm_nosha`` the same with ``verify_checksums=False`` (size check only): the cost
  of re-hashing a cached copy on every open

It prints the median of ``--repeats`` as file MB/s and rows/s, and each setup's ratio to
``local``. The emulator is a single-threaded Python HTTP server: the gs:// numbers measure
this client plus that server on loopback, a floor rather than a forecast for real GCS
(higher latency per request, more bandwidth per stream).

Loader level (``--only loader``, also part of the default run): tokens/s through
``ZephonLoader`` (``num_workers=0``, W=1, pre-tokenized, concat packing) over one
generated dataset, on local disk and from the emulator, in the same run:

* ``loader_local``          the dataset on local disk (page cache)
* ``loader_gcs_nocache``    ``cache_dir`` unset: files over 4 MiB through ``RangedReader``
* ``loader_gcs_cold``       ``cache_dir`` emptied before each repeat
* ``loader_gcs_warm``       ``cache_dir`` filled by the cold runs (sha256 of each copy on open)
* ``loader_gcs_warm_nosha`` the same with ``verify_checksums=False``

Each repeat builds a new loader and consumes ``--loader-steps`` global batches (default:
about 95% of the smallest lane, so every lane file is opened once and no lane wraps into a
second epoch). Repeats go round-robin over the setups; medians, with each setup's fastest
and slowest run, and ratios to ``loader_local``.

:func:`time_callable` is the generic part: give it any callable returning counts
(``{"tokens": n}`` for a loader run) to get medians and rates in the same format.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from loader.io import gcs, storage  # noqa: E402
from loader.order.hashing import sha256_hex  # noqa: E402
from loader.io.manifest import FileEntry, lane_file_path  # noqa: E402
from loader.io.storage import StorageOptions  # noqa: E402

log = logging.getLogger("bench.gcs_throughput")
BUCKET = "zephon-bench"
TOKENIZER = str(REPO_ROOT / "beam_jobs" / "assets" / "tokenizer.json")


@dataclass(frozen=True)
class Timing:
    """Median wall time of a callable over repeats, and its counts per second."""

    label: str
    seconds: list[float]
    counts: dict[str, float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def rate(self, unit: str) -> float:
        return self.counts[unit] / self.median_s

    def line(self, baseline: "Timing | None" = None) -> str:
        parts = [f"{self.label:<22} {self.median_s:7.3f} s"]
        for unit, value in self.counts.items():
            scale, shown = (1e6, "MB/s") if unit == "bytes" else (1.0, f"{unit}/s")
            parts.append(f"{self.rate(unit) / scale:12,.1f} {shown}")
        if baseline is not None:
            parts.append(f"x{self.median_s and baseline.median_s / self.median_s:.2f} of {baseline.label}")
        return "  ".join(parts)


def time_callable(label: str, fn: Callable[[], dict[str, float]], repeats: int,
                  setup: Callable[[], None] = lambda: None) -> Timing:
    """Run ``setup(); fn()`` ``repeats`` times, timing only ``fn``. ``fn`` returns its counts
    (e.g. ``{"bytes": b, "rows": r}`` or ``{"tokens": t}``), which must not vary between runs."""
    seconds, counts = [], None
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
        if counts is not None and result != counts:
            raise RuntimeError(f"{label}: counts changed between repeats ({counts} then {result})")
        counts = result
    return Timing(label, seconds, dict(counts or {}))


# -- data -------------------------------------------------------------------------------
def make_lane_file(target_bytes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    rows = max(1000, target_bytes // 230)  # ~230 compressed bytes per row of hex noise
    noise = rng.integers(0, 2**63, size=(rows, 24), dtype=np.int64)
    table = pa.table({
        "key": pa.array([f"doc-{seed}-{k:08d}" for k in range(rows)]),
        "order_key": pa.array(np.sort(rng.integers(0, 2**63, size=rows)).astype(np.uint64)),
        "text": pa.array([" ".join(format(int(v), "x") for v in row) for row in noise]),
    })
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=max(1, rows // max(1, target_bytes >> 20)),
                   write_page_checksum=True)
    return sink.getvalue()


def build_dataset(local_dir: str, remote_dir: str, files: int, file_mb: float) -> list[FileEntry]:
    entries = []
    for k in range(files):
        data = make_lane_file(int(file_mb * (1 << 20)), seed=k)
        rel = lane_file_path(k, 0)
        os.makedirs(os.path.join(local_dir, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(local_dir, rel), "wb") as fh:
            fh.write(data)
        gcs.write_bytes(storage.join(remote_dir, rel), data)
        metadata = pq.ParquetFile(io.BytesIO(data)).metadata
        entries.append(FileEntry(path=rel, lane=k, part=0, rows=metadata.num_rows, bytes=len(data),
                                 sha256=sha256_hex(data), row_groups=metadata.num_row_groups))
    return entries


def read_all(dataset: str, entries: list[FileEntry], options: StorageOptions) -> dict[str, float]:
    """Every row group of every file, as the loader reads them; returns bytes and rows."""
    rows = 0
    for entry in entries:
        with storage.open_lane_file(dataset, entry, options) as handle:
            parquet = pq.ParquetFile(handle, page_checksum_verification=True)
            for group in range(parquet.num_row_groups):
                rows += parquet.read_row_group(group, columns=["text"]).num_rows
    return {"bytes": float(sum(e.bytes for e in entries)), "rows": float(rows)}


# -- loader level -----------------------------------------------------------------------
class _FixedIds:
    """Stands in for a ``tokenizers.Tokenizer`` in ``write_dataset``: ``encode_batch`` returns
    pre-drawn ids (tokenizing millions of tokens would dominate a short run on 2 cores); every
    other attribute, the fingerprint the loader checks included, is the real tokenizer's."""

    class _Encoding:
        def __init__(self, ids) -> None:
            self.ids = ids

    def __init__(self, tokenizer, ids_of_text: dict) -> None:
        self._tokenizer, self._ids_of_text = tokenizer, ids_of_text

    def encode_batch(self, texts, add_special_tokens: bool = False) -> list:
        return [self._Encoding(self._ids_of_text[text]) for text in texts]

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def build_pretokenized_dataset(out_dir: str, tokens: int, num_lanes: int, seed: int = 0):
    """A pre-tokenized lane dataset (one file per lane) in the Beam job's format.

    Documents: lognormal lengths (median ~400 tokens); ids Zipf-distributed over the shipped
    tokenizer's vocabulary; a ``text`` column of ~4 skewed random letters per token stored
    beside them, as the Beam job stores the text of pre-tokenized documents (the loader does
    not read it, but downloads and caches move it). Returns ``(manifest, tokens)``.
    """
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from dataset_factory import write_dataset
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(TOKENIZER)
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(6.0, 1.0, size=tokens // 300 + 16).astype(np.int64) + 8, 16_000)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    total = int(lengths.sum())
    vocab = rng.permutation(np.arange(256, tokenizer.get_vocab_size())).astype(np.int32)
    ids = vocab[(rng.zipf(1.3, total) - 1) % len(vocab)]
    alphabet = np.frombuffer(b"etaoinsrhdlucmfwygpbvkxqjz     ", np.uint8)  # skewed to the front: ~4.5 bits/char
    chars = alphabet[(rng.random(total * 4) ** 1.6 * len(alphabet)).astype(np.int64)]
    ids_of_text, texts, start = {}, [], 0
    for n, length in enumerate(lengths.tolist()):
        text = f"doc{n} " + chars[4 * start:4 * (start + length)].tobytes().decode("ascii")
        ids_of_text[text] = ids[start:start + length]
        texts.append(text)
        start += length
    manifest = write_dataset(out_dir, texts, num_lanes=num_lanes, seed=seed, source_name="bench",
                             tokenizer=_FixedIds(tokenizer, ids_of_text), row_group_rows=512)
    return manifest, total


def loader_config(dataset: str, seq_len: int, global_batch: int, **storage):
    from loader.config import LoaderConfig

    return LoaderConfig(datasets=[{"path": dataset}], seq_len=seq_len, global_batch_size=global_batch,
                        micro_batch_size=global_batch, seed=1, tokenizer=TOKENIZER, packing="concat",
                        num_workers=0, **storage)


def loader_tokens(config, steps: int) -> dict[str, float]:
    """Consume ``steps`` global batches through a fresh ``ZephonLoader``; returns the tokens."""
    from loader.pipeline import ZephonLoader

    with ZephonLoader(config, rank=0, world_size=1) as loader:
        for _ in range(steps):
            batch = next(loader)
    assert batch["step"] == steps - 1
    return {"tokens": float(steps * config.global_batch_size * config.seq_len)}


def run_loader_bench(work: str, args) -> None:
    local_dir, remote_dir = os.path.join(work, "loader-local"), f"gs://{BUCKET}/loader"
    manifest, total = build_pretokenized_dataset(local_dir, int(args.loader_mtokens * 1e6), args.loader_lanes)
    for entry in manifest.files:
        with open(os.path.join(local_dir, entry.path), "rb") as fh:
            gcs.write_bytes(storage.join(remote_dir, entry.path), fh.read())
    with open(os.path.join(local_dir, "manifest.json"), "rb") as fh:  # last, as the Beam job does
        gcs.write_bytes(storage.join(remote_dir, "manifest.json"), fh.read())
    steps = loader_steps(manifest, args)
    print("\n" + describe_loader_run(manifest, total, steps, args))
    cache_dir = os.path.join(work, "loader-cache")
    size = dict(seq_len=args.seq_len, global_batch=args.global_batch)
    local_cfg = loader_config(local_dir, **size)
    setups = [
        ("loader_gcs_nocache", loader_config(remote_dir, **size), lambda: None),
        ("loader_gcs_cold", loader_config(remote_dir, cache_dir=cache_dir, **size),
         lambda: shutil.rmtree(cache_dir, ignore_errors=True)),
        ("loader_gcs_warm", loader_config(remote_dir, cache_dir=cache_dir, **size), lambda: None),
        ("loader_gcs_warm_nosha", loader_config(remote_dir, cache_dir=cache_dir, verify_checksums=False, **size),
         lambda: None),
    ]
    setups.insert(0, ("loader_local", local_cfg, lambda: None))
    loader_tokens(local_cfg, min(steps, 2))  # warm-up: imports, tokenizer, pyarrow pools, page cache
    print_round_robin([(label, functools.partial(loader_tokens, config, steps), setup)
                       for label, config, setup in setups], args.repeats)


def loader_steps(manifest, args) -> int:
    """``--loader-steps``, or ~95% of the smallest lane: every file opened once, no epoch wrap."""
    per_lane_step = args.seq_len * args.global_batch // manifest.num_lanes
    smallest_lane = min(sum(e.tokens for e in manifest.files if e.lane == lane) for lane in range(manifest.num_lanes))
    return args.loader_steps or max(1, int(0.95 * smallest_lane / per_lane_step))


def describe_loader_run(manifest, total: int, steps: int, args) -> str:
    return (f"loader: pre-tokenized, {total:,} tokens in {len(manifest.files)} lane files of "
            f"{min(e.bytes for e in manifest.files) / 1e6:.1f}-{max(e.bytes for e in manifest.files) / 1e6:.1f} MB "
            f"({sum(e.bytes for e in manifest.files) / total:.2f} bytes/token); seq_len={args.seq_len}, "
            f"global batch {args.global_batch}, {steps} steps, num_workers=0; median of {args.repeats}")


def print_round_robin(setups: list[tuple[str, Callable[[], dict[str, float]], Callable[[], None]]],
                      repeats: int, seconds_format: str = ".2f") -> None:
    """Time ``(label, fn, setup)`` setups ``repeats`` times each and print medians, spreads and
    ratios to the first. Repeats go round-robin over the setups (not setup after setup), so a
    burst of load from other work on a shared machine hits every setup alike instead of
    skewing one ratio."""
    rounds = [[time_callable(label, fn, 1, setup=setup) for label, fn, setup in setups] for _ in range(repeats)]
    timings = [Timing(runs[0].label, [t for run in runs for t in run.seconds], runs[0].counts)
               for runs in zip(*rounds)]
    for timing in timings:
        spread = f"  (runs {min(timing.seconds):{seconds_format}}-{max(timing.seconds):{seconds_format}} s)"
        print((timing.line() if timing is timings[0] else timing.line(timings[0])) + spread)


# -- emulator ---------------------------------------------------------------------------
def _die_with_parent() -> None:
    try:  # Linux: the emulator gets SIGTERM if this process dies without cleaning up
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


def start_local_server(command: Callable[[int], list[str]], probe_path: str, name: str) -> tuple[subprocess.Popen, str]:
    """``command(port)`` started on a free port of 127.0.0.1, once ``probe_path`` answers."""
    import requests

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(endpoint + probe_path, timeout=1).ok:
                return proc, endpoint
        except requests.RequestException:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} did not start")


@contextlib.contextmanager
def serving(start: Callable[[], tuple[subprocess.Popen, str]], env: Callable[[str], dict[str, str]],
            prefix: str) -> Iterator[str]:
    """A local storage server for one benchmark: started, its endpoint exported through
    ``env(endpoint)``, and a scratch directory (yielded); both are gone on the way out."""
    proc, endpoint = start()
    os.environ.update(env(endpoint))
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        yield work
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def add_loader_args(parser: argparse.ArgumentParser) -> None:
    """The loader half's options, shared by the GCS and S3 benchmarks."""
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-mtokens", type=float, default=6.0, help="loader dataset size, millions of tokens")
    parser.add_argument("--loader-lanes", type=int, default=4, help="loader dataset lanes (one file each)")
    parser.add_argument("--loader-steps", type=int, default=0, help="global batches per repeat (0: ~95%% of a lane)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=16)


def start_emulator() -> tuple[subprocess.Popen, str]:
    return start_local_server(lambda port: [sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1",
                                            f"--port={port}", "--in-memory", "-q"], "/", "gcp-storage-emulator")


def run_file_bench(work: str, args) -> None:
    """Storage level: every row group of every file, as the loader reads them."""
    local_dir, remote_dir = os.path.join(work, "local"), f"gs://{BUCKET}/ds"
    entries = build_dataset(local_dir, remote_dir, args.files, args.file_mb)
    total_mb = sum(e.bytes for e in entries) / 1e6
    print(f"{len(entries)} lane files, {total_mb:.1f} MB, "
          f"{sum(e.row_groups for e in entries)} row groups, {sum(e.rows for e in entries):,} rows; "
          f"median of {args.repeats}")
    cache_dir = os.path.join(work, "cache")
    cached = StorageOptions(cache_dir=cache_dir)
    unverified = StorageOptions(cache_dir=cache_dir, verify_checksums=False)

    def empty_cache() -> None:
        shutil.rmtree(cache_dir, ignore_errors=True)

    read_all(local_dir, entries, StorageOptions())  # warm-up: imports, pyarrow pools, page cache
    local = time_callable("local", lambda: read_all(local_dir, entries, StorageOptions()), args.repeats)
    results = [
        time_callable("gcs_nocache", lambda: read_all(remote_dir, entries, StorageOptions()), args.repeats),
        time_callable("gcs_cold", lambda: read_all(remote_dir, entries, cached), args.repeats, setup=empty_cache),
        time_callable("gcs_warm", lambda: read_all(remote_dir, entries, cached), args.repeats),
        time_callable("gcs_warm_nosha", lambda: read_all(remote_dir, entries, unverified), args.repeats),
    ]
    print(local.line())
    for timing in results:
        print(timing.line(local))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--file-mb", type=float, default=8.0)
    parser.add_argument("--only", choices=("files", "loader", "all"), default="all",
                        help="files: storage-level reads only; loader: ZephonLoader tokens/s only")
    add_loader_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    with serving(start_emulator, lambda endpoint: {"STORAGE_EMULATOR_HOST": endpoint}, "zephon-gcs-bench-") as work:
        gcs.client().create_bucket(BUCKET, project="bench")
        if args.only in ("files", "all"):
            run_file_bench(work, args)
        if args.only in ("loader", "all"):
            run_loader_bench(work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
