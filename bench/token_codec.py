"""Token column codec and lane file access: what the Beam job's and the loader's defaults cost.

    python bench/token_codec.py [--docs 20000] [--repeats 3] [--seconds 3]

Data: the sample corpus (:mod:`loader.samples.corpus`, JSONL, ``--docs`` documents) sharded by
the Beam job three times, pre-tokenized into 16 lanes, with ``--token-compression`` lz4 (the
default), zstd and none; cached under ``bench/_work/token_codec/``. For each codec:

* storage: bytes of the ``input_ids`` column chunks (compressed, as stored) per token;
* decode: ``read_row_group(columns=["input_ids"])`` of every row group with page checksums
  verified and ``pre_buffer=False``, as the loader reads local files (best of 3 passes, one
  thread), in ns per token and us per row group; and per row group with pyarrow's default
  ``pre_buffer=True`` (an I/O thread-pool hand-off and an fadvise per read);
* loader: tokens/s of ``ZephonLoader`` (concat, seq_len 1024, global batch 16, 0 workers,
  read-ahead on) for ``--seconds`` after 50 warm-up steps, delivering ``input_ids`` only
  and the full batch, with lane files opened as native Arrow files (``pa.OSFile``, what
  ``loader.io.storage`` does), as Python file objects (what it did before) or memory-mapped
  (both patched in for the comparison; lz4 only). Every loader
  run is a fresh process; the runs of one repeat go round-robin over all setups and the
  table gives the median and each ratio to the lz4 + native file setup of the same repeat.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "token_codec"
TOKENIZER = str(REPO_ROOT / "beam_jobs" / "assets" / "tokenizer.json")
CODECS = ("lz4", "zstd", "none")
FILE_ACCESS = ("native", "python_file", "mmap")
FIELDS = ("input_ids", "full")
ACCESS_LABELS = {"native": "pa.OSFile (loader)", "python_file": "Python file", "mmap": "pa.memory_map"}


def build(docs: int) -> dict[str, Path]:
    from loader.samples.corpus import make_sample

    corpus = WORK_DIR / f"corpus_{docs}"
    if not (corpus / "done").exists():
        make_sample(str(corpus), num_docs=docs, seed=0, formats=("jsonl",))
        (corpus / "done").write_text("")
    out = {}
    for codec in CODECS:
        dataset = WORK_DIR / f"pre_{docs}_{codec}"
        if not (dataset / "manifest.json").exists():
            print(f"sharding {dataset.name} ...", flush=True)
            subprocess.run([sys.executable, "-m", "beam_jobs.shard", "--input", str(corpus / "*" / "*.jsonl"),
                            "--output", str(dataset), "--num-lanes", "16", "--seed", "0", "--id-field", "id",
                            "--tokenizer", TOKENIZER, "--token-compression", codec, "--overwrite",
                            "--max-reject-fraction", "0.05"], cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
        out[codec] = dataset
    return out


def storage_and_decode(dataset: Path) -> dict:
    import pyarrow.parquet as pq

    stored = groups = 0
    files = sorted(glob.glob(str(dataset / "lane=*" / "*.parquet")))
    for path in files:
        metadata = pq.ParquetFile(path).metadata
        column = metadata.schema.names.index("input_ids")
        groups += metadata.num_row_groups
        for g in range(metadata.num_row_groups):
            stored += metadata.row_group(g).column(column).total_compressed_size
    out = {"groups": groups}
    for label, pre_buffer in (("decode", False), ("decode_pre_buffer", True)):
        best = float("inf")
        for _ in range(3):
            start, tokens = time.perf_counter(), 0
            for path in files:
                parquet = pq.ParquetFile(path, page_checksum_verification=True, pre_buffer=pre_buffer)
                for g in range(parquet.metadata.num_row_groups):
                    column = parquet.read_row_group(g, columns=["input_ids"], use_threads=False).column(0)
                    tokens += sum(len(chunk.buffers()[2] or b"") for chunk in column.chunks) // 4
            best = min(best, time.perf_counter() - start)
        out[f"{label}_ns_per_token"] = best / tokens * 1e9
        out[f"{label}_us_per_group"] = best / groups * 1e6
    return {"bytes_per_token": stored / tokens, "tokens": tokens, **out}


def child(spec: dict) -> dict:
    """One loader run in this (fresh) process."""
    sys.path.insert(0, str(REPO_ROOT))
    from loader.io import storage
    from loader.config import BATCH_FIELDS, LoaderConfig
    from loader.pipeline import ZephonLoader

    if spec["access"] != "native":
        import pyarrow as pa

        native = storage.open_lane_file
        reopen = (lambda path: open(path, "rb")) if spec["access"] == "python_file" else pa.memory_map

        def patched(dataset_path, entry, options=storage.StorageOptions()):
            native(dataset_path, entry, options).close()  # the same checks, then the other kind
            return reopen(storage.join(dataset_path, entry.path))

        storage.open_lane_file = patched
    config = LoaderConfig(datasets=[{"path": spec["dataset"]}], seq_len=1024, global_batch_size=16,
                          micro_batch_size=16, seed=0, tokenizer=TOKENIZER, packing="concat",
                          batch_fields=BATCH_FIELDS if spec["fields"] == "full" else ("input_ids",))
    with ZephonLoader(config) as loader:
        for _ in range(50):
            next(loader)
        tokens, start = 0, time.perf_counter()
        while time.perf_counter() - start < spec["seconds"]:
            tokens += next(loader)["input_ids"].numel()
        elapsed = time.perf_counter() - start
    return {"tokens_per_s": tokens / elapsed}


def run_child(spec: dict) -> float:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    sys.path.insert(0, str(REPO_ROOT))
    from bench.machine import cpu_model, load_average

    datasets = build(args.docs)
    static = {codec: storage_and_decode(path) for codec, path in datasets.items()}
    setups = [(codec, access, fields) for fields in FIELDS for codec in CODECS for access in FILE_ACCESS
              if access == "native" or codec == "lz4"]
    runs: dict[tuple, list[float]] = {s: [] for s in setups}
    ratios: dict[tuple, list[float]] = {s: [] for s in setups}
    wall = time.perf_counter()
    for repeat in range(args.repeats):
        for setup in setups:
            codec, access, fields = setup
            runs[setup].append(run_child({"dataset": str(datasets[codec]), "access": access, "fields": fields,
                                          "seconds": args.seconds}))
            print(f"repeat {repeat}: {codec:4s} {access:11s} {fields:9s} {runs[setup][-1] / 1e6:6.1f} M tok/s",
                  flush=True)
        for setup in setups:
            ratios[setup].append(runs[setup][-1] / runs[("lz4", "native", setup[2])][-1])

    command = "python bench/token_codec.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    lines = [f"Command: `{command}` ({(time.perf_counter() - wall) / 60:.1f} min of loader runs). nproc {os.cpu_count()}, {cpu_model()}, Python {sys.version.split()[0]}; "
             f"load average at the end {load_average()}.",
             f"{static['lz4']['tokens']:,} tokens ({args.docs:,} sample documents, 16 lanes).", "",
             "| codec | input_ids bytes / token | decode ns / token (vs lz4) | us per row group | "
             "with pyarrow's pre_buffer: us per row group |", "|---|---:|---:|---:|---:|"]
    for codec in CODECS:
        s = static[codec]
        lines.append(f"| {codec} | {s['bytes_per_token']:.2f} | {s['decode_ns_per_token']:.2f} "
                     f"({s['decode_ns_per_token'] / static['lz4']['decode_ns_per_token']:.2f}x) | "
                     f"{s['decode_us_per_group']:.0f} | {s['decode_pre_buffer_us_per_group']:.0f} |")
    lines += ["", "| batch | codec | lane files | loader tokens/s (median) | runs (M tok/s) | vs lz4 + native file (median of same-repeat ratios) |",
              "|---|---|---|---:|---|---:|"]
    for setup in setups:
        codec, access, fields = setup
        label = "input_ids only" if fields == "input_ids" else "full (labels, position ids, cu_seqlens)"
        lines.append(f"| {label} | {codec} | {ACCESS_LABELS[access]} | "
                     f"{statistics.median(runs[setup]) / 1e6:.1f} M | "
                     f"{' / '.join(f'{x / 1e6:.1f}' for x in runs[setup])} | {statistics.median(ratios[setup]):.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
