"""Grain: ArrayRecord files read with ``grain.MapDataset`` and Grain's own packing.

Records: one per document, the ids + EOS as int32 bytes (``*-ids``), or the UTF-8 text
(``web-text``). Pipeline, following Grain's advice to keep stateful steps after
``mp_prefetch`` so the output does not depend on the worker count::

    MapDataset.source(ArrayRecordDataSource) .shuffle(seed) .repeat() [rank::world]
      .map(decode | tokenize) .to_iter_dataset() [.mp_prefetch(workers)]
      -> ConcatThenSplitIterDataset({"ids": seq_len}) -> .batch(rank_batch)

Mixing: ``MapDataset.mix([web, caps], weights)`` of the two shuffled, repeated sources, then
the same packing. State: the iterator's ``get_state()`` / ``set_state()``.
"""

from __future__ import annotations

import os

import numpy as np

from bench.peers.common import SOURCES, Layout, Spec, eos_id, iter_docs_jsonl, load_flat

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
    for source in SOURCES:
        tokens, offsets = load_flat(layout, source)
        _write(_paths(root, f"{source}-ids"),
               (np.concatenate([tokens[offsets[i]:offsets[i + 1]], eos]).astype("<i4").tobytes()
                for i in range(len(offsets) - 1)))
    _write(_paths(root, "web-text"), (d["text"].encode() for d in iter_docs_jsonl(layout, "web")))
    return {}


class _DecodeIds:
    def __call__(self, record: bytes) -> dict:
        return {"ids": np.frombuffer(record, dtype="<i4").astype(np.int32)}


class _Tokenize:
    def __init__(self, tokenizer_path: str, eos: int) -> None:
        self.path, self.eos, self.tok = tokenizer_path, eos, None

    def __call__(self, record: bytes) -> dict:
        if self.tok is None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(self.path)
        ids = self.tok.encode(record.decode(), add_special_tokens=False).ids
        ids.append(self.eos)
        return {"ids": np.asarray(ids, dtype=np.int32)}

    def __getstate__(self):
        return {"path": self.path, "eos": self.eos, "tok": None}


class Session:
    def __init__(self, spec: Spec, layout: Layout) -> None:
        import grain
        from grain.experimental import ConcatThenSplitIterDataset

        root = layout.formats("grain")

        def source(name: str, seed: int):
            ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(_paths(root, name)))
            return ds.shuffle(seed=seed).repeat()

        if spec.mode == "mix":
            ds = grain.MapDataset.mix([source(f"{s}-ids", spec.seed + i) for i, s in enumerate(SOURCES)],
                                      weights=list(spec.weights))
        else:
            ds = source("web-ids" if spec.mode == "pretok" else "web-text", spec.seed)
        ds = ds[spec.rank::spec.world_size]
        if spec.mode == "text":
            ds = ds.map(_Tokenize(layout.info()["tokenizer"], eos_id(layout)))
        else:
            ds = ds.map(_DecodeIds())
        it_ds = ds.to_iter_dataset()
        if spec.num_workers > 0:
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec.num_workers))
        it_ds = ConcatThenSplitIterDataset(it_ds, length_struct={"ids": spec.seq_len})
        self.ds = it_ds.batch(spec.rank_batch)
        self.it = iter(self.ds)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)["ids"]

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


