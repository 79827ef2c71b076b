"""Small lane-sharded datasets for loader tests, written without Beam (fast).

It follows the dataset format of :mod:`loader.io.manifest` with the same hashing functions as
the Beam job, so the loader cannot tell the difference; the Beam job's own tests check that
real job output has this layout.
"""

from __future__ import annotations

import io
import os
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from beam_jobs.lane_files import parquet_write_options
from loader.order.hashing import file_bucket, lane_of_key, order_key_of, sha256_hex
from loader.io.manifest import FileEntry, Manifest, lane_file_path
from loader.stages.tokenizer import describe


def synthetic_texts(count: int, seed: int = 0, *, max_words: int = 300) -> list[str]:
    """Documents of varied length (a few very long), from a fixed word list."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "data", "model", "token", "lane", "zephon", "batch",
             "the", "of", "and", "a", "to", "in", "is", "train", "loss", "step", "über", "数据", "🙂"]
    lengths = np.minimum(rng.lognormal(3.5, 1.2, size=count).astype(int) + 1, max_words * 10)
    texts = []
    for n, length in enumerate(lengths):
        picks = rng.integers(0, len(words), size=int(length))
        texts.append(f"doc{n} " + " ".join(words[p] for p in picks))
    return texts


def write_dataset(
    out_dir: str,
    texts: Sequence[str],
    *,
    num_lanes: int,
    seed: int = 0,
    source_name: str = "synthetic",
    tokenizer=None,
    files_per_lane: int = 1,
    row_group_rows: int = 16,
    keys: Optional[Sequence[str]] = None,
    token_encoding: str = "binary",
    loss_masks: Optional[Sequence] = None,
) -> Manifest:
    """``loss_masks`` (pre-tokenized only): one mask per document (0/1 per id of the
    tokenizer's ``encode(text, add_special_tokens=False)``), written as the ``loss_mask``
    column (binary, one byte per token; ``list<uint8>`` with ``token_encoding="list"``)."""
    keys = list(keys) if keys is not None else [f"doc-{k:07d}" for k in range(len(texts))]
    masks = list(loss_masks) if loss_masks is not None else [None] * len(texts)
    rows_by_file: dict[tuple[int, int], list[tuple]] = {}
    for key, text, mask in zip(keys, texts, masks):
        lane = lane_of_key(seed, key, num_lanes)
        order_key = order_key_of(seed, key)
        bucket = file_bucket(order_key, files_per_lane)
        rows_by_file.setdefault((lane, bucket), []).append((order_key, key, text, mask))
    entries = []
    for (lane, part), rows in sorted(rows_by_file.items()):
        rows.sort()
        columns = {
            "key": pa.array([r[1] for r in rows], pa.string()),
            "order_key": pa.array([r[0] for r in rows], pa.uint64()),
            "text": pa.array([r[2] for r in rows], pa.string()),
        }
        tokens = None
        if tokenizer is not None:
            ids = [e.ids for e in tokenizer.encode_batch([r[2] for r in rows], add_special_tokens=False)]
            if token_encoding == "binary":  # what the Beam job writes
                columns["input_ids"] = pa.array([np.asarray(i, dtype="<i4").tobytes() for i in ids], pa.binary())
            else:  # "list": list<int32>, which the loader also reads
                columns["input_ids"] = pa.array(ids, pa.list_(pa.int32()))
            columns["num_tokens"] = pa.array([len(i) for i in ids], pa.int32())
            tokens = sum(len(i) for i in ids)
            if loss_masks is not None:
                row_masks = [np.asarray(r[3], dtype=np.uint8) for r in rows]
                if token_encoding == "binary":
                    columns["loss_mask"] = pa.array([m.tobytes() for m in row_masks], pa.binary())
                else:
                    columns["loss_mask"] = pa.array([m.tolist() for m in row_masks], pa.list_(pa.uint8()))
        table = pa.table(columns)
        sink = io.BytesIO()
        # The Beam job's writer settings (lz4 token column, no dictionary, statistics only on
        # the small columns, page checksums): a factory file reads like a job's file.
        pq.write_table(table, sink, row_group_size=row_group_rows, **parquet_write_options(table.schema))
        data = sink.getvalue()
        rel = lane_file_path(lane, part)
        os.makedirs(os.path.join(out_dir, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(out_dir, rel), "wb") as fh:
            fh.write(data)
        entries.append(FileEntry(
            path=rel, lane=lane, part=part, rows=len(rows), bytes=len(data), sha256=sha256_hex(data),
            tokens=tokens, row_groups=pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups,
        ))
    schema = [{"name": f.name, "type": str(f.type)} for f in table.schema]
    manifest = Manifest(
        seed=seed, num_lanes=num_lanes, source_name=source_name, schema=schema, files=entries,
        documents=len(texts), tokenizer=describe(tokenizer).to_dict() if tokenizer is not None else None,
        files_per_lane=files_per_lane,
    ).with_fingerprint()
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        fh.write(manifest.to_json())
    return manifest
