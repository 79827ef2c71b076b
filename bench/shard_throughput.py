"""Throughput of the Beam sharding job against a plain single-process script doing the same.

    python bench/shard_throughput.py [--docs 20000] [--repeats 3]

Both sides read the same generated sample corpus (:mod:`loader.samples.corpus`, JSONL),
key each document with :mod:`loader.order.hashing`, group rows by (lane, file bucket), sort by
order key, optionally tokenize with ``tokenizers`` (``encode_batch_fast`` per row group),
and write zstd Parquet with the same settings. The baseline's files are checked to be
byte-identical to the Beam job's, so the comparison is like for like.

Every measurement runs in a fresh Python process (imports excluded from the timing), the
configurations take turns (round-robin) so background load hits them alike, and the median
of ``--repeats`` is reported: documents/s and MB/s of valid text, and the ratio
Beam / baseline. The issue's goal: with tokenization, Beam >= 0.5x the baseline.
``beam_in_memory_dedup`` (issue 19) is the in-memory job with ``--dedup exact``, its ratio
taken against ``beam_in_memory`` (the job without it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_DIR = REPO_ROOT / "bench" / "_work" / "shard_throughput"
NUM_LANES = 64
SEED = 0

# name -> (kind, pre-tokenize, extra Beam pipeline args)
CONFIGS = {
    "baseline": ("baseline", False, []),
    "beam_in_memory": ("beam", False, ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]),
    "baseline_tok": ("baseline", True, []),
    "beam_in_memory_tok": ("beam", True, ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]),
    "beam_multi_processing_tok": ("beam", True, ["--runner=FnApiRunner", "--direct_running_mode=multi_processing",
                                                 "--direct_num_workers=2"]),
    # Issue 19: --dedup exact (a shuffle by text hash), compared with the same job without it.
    "beam_in_memory_dedup": ("beam", False, ["--runner=FnApiRunner", "--direct_running_mode=in_memory",
                                             "--dedup", "exact"]),
}
DEDUP_BASE = {"beam_in_memory_dedup": "beam_in_memory"}  # compared with the job without --dedup


def tokenizer_path() -> str:
    return str(REPO_ROOT / "beam_jobs" / "assets" / "tokenizer.json")


# ---------------------------------------------------------------------------------------
# The plain baseline: one process, pyarrow + tokenizers, no Beam.


def run_baseline(input_dir: str, output: str, tokenize: bool) -> dict:
    import glob

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from beam_jobs.lane_files import (INPUT_IDS_TYPE, ROW_GROUP_MAX_ROWS, ROW_GROUP_TEXT_BYTES,
                                      parquet_write_options, tokenize_texts)
    from loader.order.hashing import file_bucket, lane_of_key, order_key_of

    tokenizer = Tokenizer.from_file(tokenizer_path()) if tokenize else None
    documents, total_text_bytes = [], 0
    for path in sorted(glob.glob(os.path.join(input_dir, "*", "*.jsonl"))):
        with open(path, "rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                record = json.loads(line.decode("utf-8"))
                text = record.get("text")
                if not isinstance(text, str) or not text.strip():
                    continue
                documents.append((record["id"], text))
                total_text_bytes += len(text.encode("utf-8"))
    per_lane = -(-total_text_bytes // NUM_LANES)
    files_per_lane = max(1, -(-per_lane // (64 << 20)))
    groups: dict[tuple[int, int], list] = {}
    for key, text in documents:
        order_key = order_key_of(SEED, key)
        lane = lane_of_key(SEED, key, NUM_LANES)
        groups.setdefault((lane, file_bucket(order_key, files_per_lane)), []).append((order_key, key, text))

    fields = [pa.field("key", pa.string()), pa.field("order_key", pa.uint64()), pa.field("text", pa.string())]
    if tokenize:
        fields += [pa.field("input_ids", INPUT_IDS_TYPE), pa.field("num_tokens", pa.int32())]
    schema = pa.schema(fields)
    options = parquet_write_options(schema)
    checksums = {}
    for (lane, part), rows in sorted(groups.items()):
        rows.sort()
        bounds, start, size = [], 0, 0
        for i, (_, _, text) in enumerate(rows):
            size += len(text.encode("utf-8"))
            if i + 1 - start == ROW_GROUP_MAX_ROWS or size >= ROW_GROUP_TEXT_BYTES:
                bounds.append((start, i + 1))
                start, size = i + 1, 0
        if start < len(rows):
            bounds.append((start, len(rows)))
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, schema, **options) as writer:
            for start, stop in bounds:
                chunk = rows[start:stop]
                texts = [r[2] for r in chunk]
                arrays = [pa.array([r[1] for r in chunk], pa.string()),
                          pa.array(np.array([r[0] for r in chunk], dtype=np.uint64)), pa.array(texts, pa.string())]
                if tokenize:
                    input_ids, num_tokens = tokenize_texts(tokenizer, texts)
                    arrays += [input_ids, pa.array(num_tokens)]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=stop - start)
        data = sink.getvalue().to_pybytes()
        relative = f"lane={lane:05d}/part-{part:05d}.parquet"
        os.makedirs(os.path.join(output, os.path.dirname(relative)), exist_ok=True)
        with open(os.path.join(output, relative), "wb") as fh:
            fh.write(data)
        checksums[relative] = hashlib.sha256(data).hexdigest()
    return {"documents": len(documents), "text_bytes": total_text_bytes, "checksums": checksums}


def run_beam(input_dir: str, output: str, tokenize: bool, pipeline_args: list[str]) -> dict:
    from beam_jobs.shard import run

    argv = ["--input", os.path.join(input_dir, "*", "*.jsonl"), "--output", output, "--id-field", "id",
            "--num-lanes", str(NUM_LANES), "--seed", str(SEED), "--overwrite", *pipeline_args]
    if tokenize:
        argv += ["--tokenizer", tokenizer_path()]
    manifest = run(argv)
    return {"documents": manifest.documents, "checksums": {f.path: f.sha256 for f in manifest.files}}


def _one(config: str, input_dir: str, output: str) -> None:
    """Child process: run one configuration, print its timing as JSON."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    kind, tokenize, pipeline_args = CONFIGS[config]
    shutil.rmtree(output, ignore_errors=True)
    start = time.perf_counter()
    if kind == "baseline":
        result = run_baseline(input_dir, output, tokenize)
    else:
        result = run_beam(input_dir, output, tokenize, pipeline_args)
    result["seconds"] = time.perf_counter() - start
    print("RESULT " + json.dumps(result))


# ---------------------------------------------------------------------------------------
# Driver.


def run_once(config: str, input_dir: str) -> dict:
    output = str(WORK_DIR / f"out_{config}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, "--one", config, "--input-dir", input_dir, "--output", output],
                          capture_output=True, text=True, env=env, check=False)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def measure(configs: list[str], input_dir: str, repeats: int) -> dict[str, dict]:
    """Round-robin over the configurations, so load from other processes hits all alike."""
    runs: dict[str, list[dict]] = {config: [] for config in configs}
    for _ in range(repeats):
        for config in configs:
            runs[config].append(run_once(config, input_dir))
    results = {}
    for config, config_runs in runs.items():
        result = dict(config_runs[0])
        result["seconds"] = statistics.median(r["seconds"] for r in config_runs)
        result["all_seconds"] = [round(r["seconds"], 2) for r in config_runs]
        results[config] = result
        print(f"{config}: {result['all_seconds']} s", file=sys.stderr)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=20000, help="sample documents to generate (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; median reported (default: %(default)s)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--input-dir", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args.one, args.input_dir, args.output)
        return 0

    sys.path.insert(0, str(REPO_ROOT))
    from loader.samples.corpus import make_sample

    input_dir = str(WORK_DIR / f"sample_{args.docs}")
    if not os.path.isdir(input_dir):
        make_sample(input_dir, num_docs=args.docs, formats=("jsonl",))
    results = measure(args.configs.split(","), input_dir, args.repeats)

    text_mb = next(r["text_bytes"] for r in results.values() if "text_bytes" in r) / 1e6 if any(
        "text_bytes" in r for r in results.values()) else float("nan")
    documents = next(iter(results.values()))["documents"]
    print(f"\n{documents} valid documents, {text_mb:.1f} MB of text, {NUM_LANES} lanes, "
          f"median of {args.repeats} runs, each in a fresh process\n")
    print("| configuration | seconds | documents/s | MB/s | vs baseline | lane files identical to baseline |")
    print("|---|---:|---:|---:|---:|---|")
    for config, result in results.items():
        tokenized = CONFIGS[config][1]
        baseline = results.get(DEDUP_BASE.get(config) or ("baseline_tok" if tokenized else "baseline"))
        ratio = f"{baseline['seconds'] / result['seconds']:.2f}x" if baseline else "n/a"
        same = "n/a" if baseline is None or config.startswith("baseline") or config in DEDUP_BASE else (
            "yes" if result["checksums"] == baseline["checksums"] else "NO")
        vs = f" (vs {DEDUP_BASE[config]})" if config in DEDUP_BASE else ""
        print(f"| {config} | {result['seconds']:.2f} | {documents / result['seconds']:,.0f} | "
              f"{text_mb / result['seconds']:.2f} | {ratio}{vs} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
