"""torchdata: ``StatefulDataLoader`` over a map-style dataset of documents.

The dataset is what a user would write: document i of the pre-tokenized corpus from a
memory-mapped flat token array + offsets (``corpus/flat``), or the text of row i of the
Parquet text files. ``DistributedSampler(num_replicas=W, rank=r, shuffle=True, seed)``
orders and shards documents; ``StatefulDataLoader(batch_size=None, num_workers)`` delivers
them one by one and the concat packer from common.py packs. State: the loader's
``state_dict()`` (it fast-forwards the sampler on restore) + the sampler epoch + the packer.
Mixing: ``torchdata.nodes.MultiNodeWeightedSampler`` over one ``SamplerWrapper`` ->
``Mapper`` chain per source, under a ``nodes.Loader`` (whose ``state_dict`` is used).
Text: ``TOKENIZE_BATCH`` documents per loader batch, tokenized by the ``collate_fn`` with
``encode_batch_fast`` (in the workers when there are workers).

``torchdata_packed`` (pre-tokenized only): the nanoGPT-style path, a map-style dataset of
pre-packed ``seq_len`` rows (one ``.npy`` of [rows, seq_len] int32, memory-mapped: documents
+ EOS concatenated offline), ``DistributedSampler(shuffle=True)`` and
``StatefulDataLoader(batch_size=rows)`` with the default collate (torch tensors).
"""

from __future__ import annotations

import glob
import os

import numpy as np

from bench.peers.common import (
    SOURCES, TOKENIZE_BATCH, Layout, PackedBatches, PackedSession, SampledRowsSession, Spec, TokenizeTexts, eos_id,
    flatten, packed_rows,
)


def version() -> str:
    from importlib.metadata import version as v

    return v("torchdata")


def imports() -> None:
    import torchdata.nodes  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401


def prepare(layout: Layout) -> dict:
    return {"note": "reads corpus/flat (npy) and corpus/parquet directly"}


def prepare_packed(layout: Layout, seq_len: int) -> dict:
    return {"rows": len(packed_rows(layout, "web", seq_len))}


class PackedRows:
    """Map-style dataset: pre-packed row i (a copy out of the memory-mapped rows file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = None
        self.n = np.load(path, mmap_mode="r").shape[0]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.rows is None:  # opened lazily so that worker processes map it themselves
            self.rows = np.load(self.path, mmap_mode="r")
        return np.array(self.rows[i])

    def __getstate__(self):
        return {"path": self.path, "rows": None, "n": self.n}


class TokenDocs:
    """Map-style dataset: ids of document i (a copy out of the memory-mapped flat file)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.offsets = np.load(base + ".offsets.npy")
        self.tokens = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if self.tokens is None:  # opened lazily so that worker processes map it themselves
            self.tokens = np.load(self.base + ".tokens.npy", mmap_mode="r")
        return np.array(self.tokens[self.offsets[i]:self.offsets[i + 1]])

    def __getstate__(self):
        return {"base": self.base, "offsets": self.offsets, "tokens": None}


class TextDocs:
    """Map-style dataset: text of row i of the Parquet files (loaded into an Arrow table)."""

    def __init__(self, files: list[str]) -> None:
        import pyarrow.parquet as pq
        import pyarrow as pa

        self.text = pa.concat_tables([pq.read_table(f, columns=["text"]) for f in files]).column("text")

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, i: int) -> str:
        return self.text[i].as_py()


def _as_ids(x):
    return x.numpy() if hasattr(x, "numpy") else x


class Session(PackedSession):
    def __init__(self, spec: Spec, layout: Layout) -> None:
        from torch.utils.data.distributed import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.epoch = 0
        if spec.mode == "mix":
            self._init_mix(spec, layout)
            return
        if spec.mode == "pretok":
            ds = TokenDocs(layout.flat("web"))
        else:
            ds = TextDocs(sorted(glob.glob(os.path.join(layout.corpus, "parquet", "web", "text-*.parquet"))))
        self.sampler = DistributedSampler(ds, num_replicas=spec.world_size, rank=spec.rank, shuffle=True,
                                          seed=spec.seed, drop_last=True)
        if spec.mode == "pretok":
            self.dl = StatefulDataLoader(ds, batch_size=None, sampler=self.sampler, num_workers=spec.num_workers)
        else:  # batched tokenization in the collate function (in the workers, if any)
            self.dl = StatefulDataLoader(ds, batch_size=TOKENIZE_BATCH, sampler=self.sampler,
                                         num_workers=spec.num_workers,
                                         collate_fn=TokenizeTexts(layout.info()["tokenizer"]))
        text = spec.mode == "text"

        def docs():
            while True:
                self.sampler.set_epoch(self.epoch)
                yield from (flatten(self.dl) if text else (_as_ids(doc) for doc in self.dl))
                self.epoch += 1

        self.packed = PackedBatches(docs, spec.seq_len, spec.rank_batch, eos_id(layout),
                                    lambda: {"epoch": self.epoch, "dl": self.dl.state_dict()}, self._load)

    def _load(self, state) -> None:
        self.epoch = state["epoch"]
        self.sampler.set_epoch(self.epoch)
        self.dl.load_state_dict(state["dl"])

    def _init_mix(self, spec: Spec, layout: Layout) -> None:
        from torch.utils.data.distributed import DistributedSampler
        from torchdata.nodes import Loader, Mapper, MultiNodeWeightedSampler, SamplerWrapper

        nodes = {}
        for i, source in enumerate(SOURCES):
            ds = TokenDocs(layout.flat(source))
            sampler = DistributedSampler(ds, num_replicas=spec.world_size, rank=spec.rank, shuffle=True,
                                         seed=spec.seed + i, drop_last=True)
            nodes[source] = Mapper(SamplerWrapper(sampler), map_fn=ds.__getitem__)
        mixed = MultiNodeWeightedSampler(nodes, dict(zip(SOURCES, spec.weights)), stop_criteria="CYCLE_FOREVER",
                                         rank=spec.rank, world_size=spec.world_size, seed=spec.seed)
        self.dl = Loader(mixed)
        self.packed = PackedBatches(lambda: iter(self.dl), spec.seq_len, spec.rank_batch, eos_id(layout),
                                    self.dl.state_dict, self.dl.load_state_dict)


def open_session(spec: Spec, layout: Layout):
    if spec.loader == "torchdata_packed":  # default collate: torch tensors
        return SampledRowsSession(PackedRows(os.path.join(layout.corpus, "packed", f"web-{spec.seq_len}.npy")), spec)
    return Session(spec, layout)
