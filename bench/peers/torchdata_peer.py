"""torchdata: ``StatefulDataLoader`` over a map-style dataset of documents.

The dataset is what a user would write: document i of the pre-tokenized corpus from a
memory-mapped flat token array + offsets (``corpus/flat``), or the text of row i of the
Parquet text files. ``DistributedSampler(num_replicas=W, rank=r, shuffle=True, seed)``
orders and shards documents; ``StatefulDataLoader(batch_size=None, num_workers)`` delivers
them one by one and the concat packer from common.py packs. State: the loader's
``state_dict()`` (it fast-forwards the sampler on restore) + the sampler epoch + the packer.
Mixing: ``torchdata.nodes.MultiNodeWeightedSampler`` over one ``SamplerWrapper`` ->
``Mapper`` chain per source, under a ``nodes.Loader`` (whose ``state_dict`` is used).
"""

from __future__ import annotations

import glob
import os

import numpy as np

from bench.peers.common import SOURCES, Layout, PackedBatches, PackedSession, Spec, eos_id, load_tokenizer


def version() -> str:
    from importlib.metadata import version as v

    return v("torchdata")


def imports() -> None:
    import torchdata.nodes  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401


def prepare(layout: Layout) -> dict:
    return {"note": "reads corpus/flat (npy) and corpus/parquet directly"}


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
            to_ids = _as_ids
        else:
            ds = TextDocs(sorted(glob.glob(os.path.join(layout.corpus, "parquet", "web", "text-*.parquet"))))
            tok = load_tokenizer(layout)
            to_ids = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        self.sampler = DistributedSampler(ds, num_replicas=spec.world_size, rank=spec.rank, shuffle=True,
                                          seed=spec.seed, drop_last=True)
        self.dl = StatefulDataLoader(ds, batch_size=None, sampler=self.sampler, num_workers=spec.num_workers)

        def docs():
            while True:
                self.sampler.set_epoch(self.epoch)
                for doc in self.dl:
                    yield to_ids(doc)
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


def open_session(spec: Spec, layout: Layout) -> Session:
    return Session(spec, layout)
