"""The two floors every loader is compared with, at their fastest, on the files Zephon reads.

* scan floor: a bare pyarrow read of the ``input_ids`` column of every row group of the
  pre-tokenized lane files (the same files, in file order), the ids viewed as numpy without
  a copy; ``use_threads=False`` and ``pre_buffer=False``, how the loader reads one column of
  a local file (faster than the defaults for one column).
* tokenizer floor: ``Tokenizer.encode_batch_fast`` (batched, no offsets, the tokenizer's own
  thread pool on every core) over the text of the text lane files, one call per row group,
  the texts already in memory.
* chat floor: the chat template's plain render of every conversation of an online chat
  dataset's row group, then ``encode_batch_fast`` of the renders, one call per row group,
  the conversations already parsed (what online chat costs at the least: the loader also
  tracks the assistant spans, tokenizes with offsets, masks, guards and packs).

Used by ``bench.peers.run`` (task ``floor``) and ``bench/loader_throughput.py``.
"""

from __future__ import annotations

import json
import os
import time


def lane_files(dataset: str) -> list[str]:
    """The dataset's lane files that hold rows, in manifest order."""
    with open(os.path.join(dataset, "manifest.json")) as fh:
        manifest = json.load(fh)
    return [os.path.join(dataset, f["path"]) for f in manifest["files"] if f["rows"] > 0]


def scan_pass(files: list[str], page_checksums: bool = False) -> int:
    """Tokens of one pass over ``files`` (every row group's ``input_ids``, flattened)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = 0
    for path in files:
        parquet = pq.ParquetFile(path, page_checksum_verification=page_checksums, pre_buffer=False)
        for group in range(parquet.metadata.num_row_groups):
            table = parquet.read_row_group(group, columns=["input_ids"], use_threads=False)
            column = table.column(0).combine_chunks()
            if column.type == pa.binary():  # what the Beam job writes: int32 ids as bytes, zero-copy
                ends = np.frombuffer(column.buffers()[1], dtype=np.int32)[column.offset:column.offset + len(column) + 1]
                tokens += len(np.frombuffer(column.buffers()[2], dtype="<i4", count=int(ends[-1] - ends[0]) // 4,
                                            offset=int(ends[0])))
            else:  # list<int32> (datasets written before the binary column)
                tokens += len(column.flatten().to_numpy(zero_copy_only=False))
    return tokens


def scan_floor(files: list[str], min_seconds: float, page_checksums: bool = False) -> dict:
    """Whole passes over ``files`` until ``min_seconds`` have passed: tokens and seconds."""
    start = time.perf_counter()
    tokens = passes = 0
    while passes == 0 or time.perf_counter() - start < min_seconds:
        tokens += scan_pass(files, page_checksums)
        passes += 1
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "passes": passes}


def text_row_groups(files: list[str], max_docs: int, column: str = "text") -> list[list[str]]:
    """The ``text`` (or ``column``) of the files' row groups, in order, up to about ``max_docs`` documents."""
    import pyarrow.parquet as pq

    groups: list[list[str]] = []
    docs = 0
    for path in files:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            if docs >= max_docs:
                return groups
            groups.append(parquet.read_row_group(group, columns=[column]).column(0).to_pylist())
            docs += len(groups[-1])
    return groups


def tokenizer_floor(tokenizer_path: str, groups: list[list[str]], min_seconds: float) -> dict:
    """``encode_batch_fast`` over ``groups`` (one call each), whole passes until ``min_seconds``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    start = time.perf_counter()
    tokens = passes = 0
    while passes == 0 or time.perf_counter() - start < min_seconds:
        for texts in groups:
            tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        passes += 1
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "passes": passes}


def chat_row_groups(files: list[str], max_docs: int) -> list[list[dict]]:
    """The conversations (parsed ``conversation`` JSON) of an online chat dataset's row groups."""
    import json

    return [[json.loads(v) for v in group] for group in text_row_groups(files, max_docs, column="conversation")]


def chat_floor(tokenizer_path: str, template_path: str, groups: list[list[dict]], min_seconds: float) -> dict:
    """Chat floor: a bare loop of the same render (the template's plain ``render``, one per
    conversation, without the copy of the messages: ``from_json``) and ``encode_batch_fast`` of
    each row group's renders (no offsets, no mask), the conversations already parsed in memory;
    whole passes until ``min_seconds``."""
    from tokenizers import Tokenizer

    from loader.chat import load_chat_template

    tokenizer = Tokenizer.from_file(tokenizer_path)
    template = load_chat_template(template_path)
    start, cpu_start = time.perf_counter(), time.process_time()  # after the set-up, as the loader is timed
    tokens = passes = 0
    while passes == 0 or time.perf_counter() - start < min_seconds:
        for conversations in groups:
            # from_json: the messages are json.loads output (the job validated them), so the render
            # skips transformers' defensive copy, as the loader's does (the same text either way).
            texts = [template.render(c["messages"], tools=c.get("tools"), from_json=True).text for c in conversations]
            tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        passes += 1
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start,
            "passes": passes}
