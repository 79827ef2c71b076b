"""Megatron-Energon: WebDataset tar shards prepared with ``energon prepare``.

Each tar sample is one document: ``<key>.ids`` (int32 bytes) and ``<key>.txt``. The folders
are prepared non-interactively as ``CrudeWebdataset`` (``energon prepare DIR
--non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset``), and a ``Cooker`` in
the task encoder turns the raw dict into a sample. ``get_train_dataset(batch_size=None,
shuffle_buffer_size=100, max_samples_per_sequence=100)`` + ``get_savable_loader`` deliver
documents; the concat packer from common.py packs them. Energon's own packing
(``select_samples_to_pack``) packs whole samples into bins and does not split documents,
so it is not the same operation. Mixing: a ``MetadatasetV2`` ``blend`` with weights 0.7/0.3.
Ranks and workers: ``WorkerConfig(rank, world_size, num_workers)``. State:
``save_state_rank()`` / ``restore_state_rank()``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile

import numpy as np

from bench.peers.common import (
    Layout, PackedBatches, PackedSession, Spec, TokenizeTexts, eos_id, iter_docs_jsonl, load_flat,
    tokenized_in_batches,
)

DOCS_PER_SHARD = 2000


def version() -> str:
    from importlib.metadata import version as v

    return v("megatron-energon")


def imports() -> None:
    import megatron.energon  # noqa: F401


def _write_shards(out: str, records) -> None:
    os.makedirs(out, exist_ok=True)
    tf = None
    for i, (key, ext, data) in enumerate(records):
        if i % DOCS_PER_SHARD == 0:
            if tf:
                tf.close()
            tf = tarfile.open(os.path.join(out, f"shard-{i // DOCS_PER_SHARD:05d}.tar"), "w")
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    if tf:
        tf.close()


def _energon_prepare(path: str) -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "energon")
    cmd = [exe, "prepare", path, "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
           "CrudeWebdataset", "--no-progress", "--num-workers", "1", "--force-overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"energon prepare {path} failed: {(proc.stderr or proc.stdout)[-400:]}")


def prepare(layout: Layout) -> dict:
    root = layout.formats("energon")
    for source in layout.sources():
        tokens, offsets = load_flat(layout, source)
        out = os.path.join(root, f"{source}-ids")
        _write_shards(out, ((f"{source}{i:08d}", "ids", tokens[offsets[i]:offsets[i + 1]].astype("<i4").tobytes())
                            for i in range(len(offsets) - 1)))
        _energon_prepare(out)
    out = os.path.join(root, "web-text")
    _write_shards(out, ((f"web{i:08d}", "txt", d["text"].encode()) for i, d in enumerate(iter_docs_jsonl(layout, "web"))))
    _energon_prepare(out)
    with open(os.path.join(root, "mix.yaml"), "w") as fh:
        fh.write("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                 "      - weight: {w0}\n        path: web-ids\n      - weight: {w1}\n        path: caps-ids\n"
                 .format(w0="{W0}", w1="{W1}"))
    return {}


def _mix_yaml(layout: Layout, weights) -> str:
    root = layout.formats("energon")
    with open(os.path.join(root, "mix.yaml")) as fh:
        text = fh.read().replace("{W0}", repr(float(weights[0]))).replace("{W1}", repr(float(weights[1])))
    path = os.path.join(root, f"mix-{weights[0]:g}-{weights[1]:g}.yaml")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def _task_encoder(text: bool):
    from bench.peers import _energon_types as t

    return t.TextEncoder() if text else t.IdsEncoder()


class Session(PackedSession):
    def __init__(self, spec: Spec, layout: Layout) -> None:
        from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

        self.spec, self.layout = spec, layout
        root = layout.formats("energon")
        if spec.mode == "mix":
            path = _mix_yaml(layout, spec.weights)
        else:
            path = os.path.join(root, "web-ids" if spec.mode == "pretok" else "web-text")
        wc = WorkerConfig(rank=spec.rank, world_size=spec.world_size, num_workers=spec.num_workers,
                          seed_offset=spec.seed)
        ds = get_train_dataset(path, worker_config=wc, batch_size=None, shuffle_buffer_size=100,
                               max_samples_per_sequence=100, task_encoder=_task_encoder(spec.mode == "text"))
        self.loader = get_savable_loader(ds)
        if spec.mode == "text":  # batched in this process: the loader hands out single documents
            tokenize = TokenizeTexts(layout.info()["tokenizer"])
            docs = lambda: tokenized_in_batches((s.doc for s in self.loader), tokenize)  # noqa: E731
        else:
            docs = lambda: (s.doc for s in self.loader)  # noqa: E731
        self.packed = PackedBatches(docs, spec.seq_len, spec.rank_batch,
                                    eos_id(layout), self.loader.save_state_rank, self.loader.restore_state_rank)


def open_session(spec: Spec, layout: Layout) -> Session:
    return Session(spec, layout)
