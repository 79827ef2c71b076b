"""Grain: ArrayRecord files read with ``grain.MapDataset`` and Grain's own packing.

Records: one per document, the ids + EOS as int32 bytes (``*-ids``), or the UTF-8 text
(``web-text``). Pipeline, following Grain's advice to keep stateful steps after
``mp_prefetch`` so the output does not depend on the worker count::

    MapDataset.source(ArrayRecordDataSource) .shuffle(seed) .repeat() [rank::world]
      .map(decode | tokenize) .to_iter_dataset() [.mp_prefetch(workers)]
      -> ConcatThenSplitIterDataset({"ids": seq_len}) -> .batch(rank_batch)

Mixing: ``MapDataset.mix([web, caps], weights)`` of the two shuffled, repeated sources, then
the same packing. State: the iterator's ``get_state()`` / ``set_state()``. Text: records are
tokenized with ``encode_batch_fast``, ``TOKENIZE_BATCH`` documents per call: ``.batch(64)``
then a map over the batch before ``mp_prefetch`` (in the workers), flattened back into
documents for the packing by ``FlatMapIterDataset``.

``grain_packed`` (pre-tokenized only): ArrayRecord records of pre-packed ``seq_len`` rows
(documents + EOS concatenated offline), ``MapDataset.source .shuffle .repeat [rank::world]
.map(decode) .batch(rows) .to_iter_dataset() [.mp_prefetch]``: batches made before the
workers hand them over, as Grain's docs put batching.
"""

from __future__ import annotations

import os

import numpy as np

from bench.peers.common import (
    SOURCES, TOKENIZE_BATCH, Layout, Spec, TokenizeTexts, eos_id, iter_docs_jsonl, load_flat, packed_rows,
)

FILES_PER_SOURCE = 4


def version() -> str:
    from importlib.metadata import version as v

    return v("grain")


def imports() -> None:
    import grain  # noqa: F401


def _paths(root: str, name: str) -> list[str]:
    return [os.path.join(root, f"{name}-{i:05d}-of-{FILES_PER_SOURCE:05d}.array_record") for i in range(FILES_PER_SOURCE)]


def _write(paths: list[str], records) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    records = list(records)
    per = -(-len(records) // len(paths))
    for i, path in enumerate(paths):
        w = ArrayRecordWriter(path, "group_size:1")
        for r in records[i * per:(i + 1) * per]:
            w.write(r)
        w.close()


def prepare(layout: Layout) -> dict:
    root = layout.formats("grain")
    os.makedirs(root, exist_ok=True)
    eos = np.array([eos_id(layout)], dtype=np.int32)
    for source in layout.sources():
        tokens, offsets = load_flat(layout, source)
        _write(_paths(root, f"{source}-ids"),
               (np.concatenate([tokens[offsets[i]:offsets[i + 1]], eos]).astype("<i4").tobytes()
                for i in range(len(offsets) - 1)))
    _write(_paths(root, "web-text"), (d["text"].encode() for d in iter_docs_jsonl(layout, "web")))
    return {}


def prepare_packed(layout: Layout, seq_len: int) -> dict:
    rows = packed_rows(layout, "web", seq_len)
    root = layout.formats("grain_packed")
    os.makedirs(root, exist_ok=True)
    _write(_paths(root, f"web-{seq_len}"), (rows[i].astype("<i4").tobytes() for i in range(len(rows))))
    return {"rows": len(rows)}


class _DecodeRow:
    def __call__(self, record: bytes) -> np.ndarray:
        return np.frombuffer(record, dtype="<i4")


class _TokenizeRecords:
    """A batch of UTF-8 records -> their ids + EOS, one ``encode_batch_fast`` call."""

    def __init__(self, tokenizer_path: str, eos: int) -> None:
        self.tokenize, self.eos = TokenizeTexts(tokenizer_path), np.array([eos], dtype=np.int32)

    def __call__(self, records) -> list:
        return [{"ids": np.concatenate([ids, self.eos])} for ids in self.tokenize([r.decode() for r in records])]


def _flat_map_class():
    from grain.experimental import FlatMapTransform

    class Unbatch(FlatMapTransform):
        max_fan_out = 4 * TOKENIZE_BATCH

        def flat_map(self, element):
            return element

    return Unbatch


class _DecodeIds:
    def __call__(self, record: bytes) -> dict:
        return {"ids": np.frombuffer(record, dtype="<i4").astype(np.int32)}


class Session:
    def __init__(self, spec: Spec, layout: Layout) -> None:
        import grain
        from grain.experimental import ConcatThenSplitIterDataset

        root = layout.formats("grain")

        def source(name: str, seed: int):
            ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(_paths(root, name)))
            return ds.shuffle(seed=seed).repeat()

        def prefetch(it_ds):
            if spec.num_workers > 0:
                return it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec.num_workers))
            return it_ds

        if spec.loader == "grain_packed":
            root = layout.formats("grain_packed")
            ds = source(f"web-{spec.seq_len}", spec.seed)[spec.rank::spec.world_size]
            self.ds = prefetch(ds.map(_DecodeRow()).batch(spec.rank_batch).to_iter_dataset())
            self.it = iter(self.ds)
            self.packed_rows = True
            return
        self.packed_rows = False
        if spec.mode == "mix":
            ds = grain.MapDataset.mix([source(f"{s}-ids", spec.seed + i) for i, s in enumerate(SOURCES)],
                                      weights=list(spec.weights))
        else:
            ds = source("web-ids" if spec.mode == "pretok" else "web-text", spec.seed)
        ds = ds[spec.rank::spec.world_size]
        if spec.mode == "text":  # batched tokenization in the workers, then one document per element again
            from grain.experimental import FlatMapIterDataset

            ds = ds.batch(TOKENIZE_BATCH, batch_fn=list).map(_TokenizeRecords(layout.info()["tokenizer"], eos_id(layout)))
            it_ds = FlatMapIterDataset(prefetch(ds.to_iter_dataset()), _flat_map_class()())
        else:
            it_ds = prefetch(ds.map(_DecodeIds()).to_iter_dataset())
        it_ds = ConcatThenSplitIterDataset(it_ds, length_struct={"ids": spec.seq_len})
        self.ds = it_ds.batch(spec.rank_batch)
        self.it = iter(self.ds)

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        return batch if self.packed_rows else batch["ids"]

    def state_dict(self):
        return self.it.get_state()

    def load_state_dict(self, state) -> None:
        self.it.set_state(state)

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close:
            close()


def open_session(spec: Spec, layout: Layout) -> Session:
    return Session(spec, layout)


