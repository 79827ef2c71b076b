"""LitData: ``litdata.optimize`` chunks read by ``StreamingDataset`` / ``StreamingDataLoader``.

Pre-tokenized: each document's ids + EOS are written with ``item_loader=TokensLoader()`` (one
contiguous token stream per chunk), and ``TokensLoader(block_size=seq_len)`` cuts it into
rows at read time: LitData's own packing. Chunks hold 2**18 tokens, a multiple of every
seq_len used here, so no tokens are dropped at chunk ends.
Text: one ``{"text": str}`` item per document, ``TOKENIZE_BATCH`` per loader batch, tokenized by
the ``collate_fn`` with ``encode_batch_fast`` (in the workers, if any); the concat packer from
common.py packs.
Mixing: ``CombinedStreamingDataset([web, caps], weights=(0.7, 0.3))`` over packed rows.
Ranks: LitData reads WORLD_SIZE / GLOBAL_RANK from the environment.
"""

from __future__ import annotations

import os

from bench.peers.common import (
    TOKENIZE_BATCH, Layout, PackedBatches, Spec, TokenizeTexts, eos_id, flatten, load_flat,
)

CHUNK_TOKENS = 1 << 18


def version() -> str:
    from importlib.metadata import version as v

    return v("litdata")


def imports() -> None:
    import litdata  # noqa: F401


def _doc_ranges(n: int, per: int = 2000) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


class _TokenDocs:
    def __init__(self, base: str, eos: int) -> None:
        self.base, self.eos = base, eos

    def __call__(self, rng):
        import numpy as np
        import torch

        tokens = np.load(self.base + ".tokens.npy", mmap_mode="r")
        offsets = np.load(self.base + ".offsets.npy")
        for i in range(rng[0], rng[1]):
            ids = np.append(tokens[offsets[i]:offsets[i + 1]].astype(np.int32), np.int32(self.eos))
            yield torch.from_numpy(ids)


class _TextDocs:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, rng):
        import json

        with open(self.path) as fh:
            for i, line in enumerate(fh):
                if rng[0] <= i < rng[1]:
                    yield {"text": json.loads(line)["text"]}


def prepare(layout: Layout) -> dict:
    from litdata import TokensLoader, optimize

    root = layout.formats("litdata")
    eos = eos_id(layout)
    for source in layout.sources():
        _, offsets = load_flat(layout, source)
        optimize(fn=_TokenDocs(layout.flat(source), eos), inputs=_doc_ranges(len(offsets) - 1),
                 output_dir=os.path.join(root, f"{source}-ids"), chunk_size=CHUNK_TOKENS,
                 item_loader=TokensLoader(), num_workers=1, reorder_files=False, verbose=False,
                 mode="overwrite", start_method="fork")
    # text: one jsonl with all web documents, read back by line ranges
    text_path = os.path.join(root, "web.jsonl")
    from bench.peers.common import iter_docs_jsonl
    import json

    os.makedirs(root, exist_ok=True)
    n = 0
    with open(text_path, "w") as fh:
        for doc in iter_docs_jsonl(layout, "web"):
            fh.write(json.dumps({"text": doc["text"]}) + "\n")
            n += 1
    optimize(fn=_TextDocs(text_path), inputs=_doc_ranges(n), output_dir=os.path.join(root, "web-text"),
             chunk_bytes="8MB", num_workers=1, reorder_files=False, verbose=False, mode="overwrite",
             start_method="fork")
    os.remove(text_path)
    return {}


class Session:
    def __init__(self, spec: Spec, layout: Layout) -> None:
        os.environ.update({"WORLD_SIZE": str(spec.world_size), "GLOBAL_RANK": str(spec.rank), "NNODES": "1"})
        from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset, TokensLoader

        root = layout.formats("litdata")
        cache = os.path.join(layout.root, "_cache", "litdata", f"r{spec.rank}")
        self.packed = None
        if spec.mode == "text":
            ds = StreamingDataset(os.path.join(root, "web-text"), shuffle=True, seed=spec.seed,
                                  cache_dir=cache)
            self.dl = StreamingDataLoader(ds, batch_size=TOKENIZE_BATCH, num_workers=spec.num_workers,
                                          collate_fn=TokenizeTexts(layout.info()["tokenizer"], key="text"))
            self.packed = PackedBatches(lambda: flatten(_forever(self.dl)), spec.seq_len,
                                        spec.rank_batch, eos_id(layout), self.dl.state_dict, self.dl.load_state_dict)
            return

        def tokens_ds(source: str):
            return StreamingDataset(os.path.join(root, f"{source}-ids"), item_loader=TokensLoader(block_size=spec.seq_len),
                                    shuffle=True, seed=spec.seed, cache_dir=cache + source)

        if spec.mode == "pretok":
            ds = tokens_ds("web")
        else:
            ds = CombinedStreamingDataset([tokens_ds(s) for s in layout.sources()], seed=spec.seed,
                                          weights=list(spec.weights), iterate_over_all=False)
        self.dl = StreamingDataLoader(ds, batch_size=spec.rank_batch, num_workers=spec.num_workers)
        self._it = None

    def __iter__(self):
        return self.packed if self.packed is not None else self

    def __next__(self):
        if self._it is None:
            self._it = _forever(self.dl)
        return next(self._it)

    def state_dict(self):
        return self.packed.state_dict() if self.packed is not None else self.dl.state_dict()

    def load_state_dict(self, state) -> None:
        if self.packed is not None:
            self.packed.load_state_dict(state)
        else:
            self.dl.load_state_dict(state)
            self._it = None

    def close(self) -> None:
        pass


def _forever(dl):
    while True:  # epochs: StreamingDataLoader advances its epoch on each new iteration
        for item in dl:
            yield item


def open_session(spec: Spec, layout: Layout) -> Session:
    return Session(spec, layout)
