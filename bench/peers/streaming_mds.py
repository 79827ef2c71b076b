"""MosaicML Streaming: MDS shards (``MDSWriter``) read by ``StreamingDataset``.

Documents are samples (``ids``: ``ndarray:int32`` or ``text``: ``str``), shuffled by
Streaming (``py1e``, seed 0); the concat packer from common.py packs them. Text is read
``TOKENIZE_BATCH`` documents per ``DataLoader`` batch whose ``collate_fn`` tokenizes them
with ``encode_batch_fast`` (in the worker processes when there are workers).

``streaming_packed`` (pre-tokenized only) is the LLM path of MosaicML's llm-foundry
(``convert_dataset_hf --concat_tokens``): MDS samples of ``seq_len`` tokens already
concatenated with EOS (column ``tokens``: ``bytes``, decoded with ``np.frombuffer`` as
llm-foundry's ``StreamingTextDataset`` does), batched by ``DataLoader(batch_size=rows)``. The state is
``StreamingDataset.state_dict(samples consumed x world size, False)`` - the count the stock
``StreamingDataLoader`` keeps - plus the packer carry. Mixing uses ``Stream(proportion=...)``.
Ranks come from Streaming's own environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), so a two-rank run is two concurrent processes, as in training.
"""

from __future__ import annotations

import os

from bench.peers.common import (
    SOURCES,
    Layout,
    PackedBatches,
    PackedSession,
    Spec,
    TokenizeTexts,
    TOKENIZE_BATCH,
    eos_id,
    load_flat,
    packed_rows,
    stub_streaming_vision,
)

SHARD_BYTES = 8 << 20


def version() -> str:
    from importlib.metadata import version as v

    return v("mosaicml-streaming")


def imports() -> None:
    stub_streaming_vision()
    import streaming  # noqa: F401
    from torch.utils.data import DataLoader  # noqa: F401


def prepare(layout: Layout) -> dict:
    stub_streaming_vision()
    from streaming import MDSWriter

    from bench.peers.common import iter_docs_jsonl

    root = layout.formats("streaming")
    for source in layout.sources():
        tokens, offsets = load_flat(layout, source)
        with MDSWriter(out=os.path.join(root, f"{source}-ids"), columns={"ids": "ndarray:int32"},
                       size_limit=SHARD_BYTES) as w:
            for i in range(len(offsets) - 1):
                w.write({"ids": tokens[offsets[i]:offsets[i + 1]].copy()})
        with MDSWriter(out=os.path.join(root, f"{source}-text"), columns={"text": "str"},
                       size_limit=SHARD_BYTES) as w:
            for doc in iter_docs_jsonl(layout, source):
                w.write({"text": doc["text"]})
    return {}


def prepare_packed(layout: Layout, seq_len: int) -> dict:
    stub_streaming_vision()
    from streaming import MDSWriter

    rows = packed_rows(layout, "web", seq_len)
    with MDSWriter(out=os.path.join(layout.formats("streaming_packed"), f"web-{seq_len}"),
                   columns={"tokens": "bytes"}, size_limit=SHARD_BYTES) as w:
        for i in range(len(rows)):
            w.write({"tokens": rows[i].tobytes()})
    return {"rows": len(rows)}


def _mean_doc_tokens(layout: Layout) -> float:
    return float(layout.info()["sources"]["web"]["mean_doc_tokens"]) + 1.0


def _set_env(spec: Spec) -> None:
    os.environ.update({"RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(spec.rank),
                       "LOCAL_WORLD_SIZE": str(spec.world_size), "NODE_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577"})


def _stack(rows):
    import numpy as np

    return np.stack(rows)


def _packed_dataset_class():
    from streaming import StreamingDataset

    class PackedTokens(StreamingDataset):
        """llm-foundry's StreamingTextDataset for concat_tokens: decode the sample's bytes."""

        def __getitem__(self, idx):
            import numpy as np

            return np.frombuffer(super().__getitem__(idx)["tokens"], dtype=np.int32)

    return PackedTokens


class PackedRowsSession:
    """``streaming_packed``: pre-packed rows, one sample each, batched by the DataLoader."""

    def __init__(self, spec: Spec, layout: Layout) -> None:
        _set_env(spec)
        stub_streaming_vision()
        from streaming.base.util import clean_stale_shared_memory
        from torch.utils.data import DataLoader

        clean_stale_shared_memory()
        self.ds = _packed_dataset_class()(local=os.path.join(layout.formats("streaming_packed"), f"web-{spec.seq_len}"),
                                          shuffle=True, shuffle_seed=spec.seed, batch_size=spec.rank_batch,
                                          num_canonical_nodes=1)
        self.dl = DataLoader(self.ds, batch_size=spec.rank_batch, num_workers=spec.num_workers, collate_fn=_stack,
                             drop_last=True, persistent_workers=spec.num_workers > 0)
        self.world, self.rows = spec.world_size, spec.rank_batch
        self.consumed = 0
        self._it = None

    def _batches(self):
        while True:
            for batch in self.dl:
                self.consumed += self.rows
                yield batch
            self.consumed = 0

    def __iter__(self):
        if self._it is None:
            self._it = self._batches()
        return self._it

    def state_dict(self):
        return self.ds.state_dict(self.consumed * self.world, False)

    def load_state_dict(self, state) -> None:
        self.ds.load_state_dict(state)
        self.consumed = 0
        self._it = None

    def close(self) -> None:
        pass


class Session(PackedSession):
    def __init__(self, spec: Spec, layout: Layout) -> None:
        _set_env(spec)
        stub_streaming_vision()
        from streaming import Stream, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory
        from torch.utils.data import DataLoader

        clean_stale_shared_memory()
        root = layout.formats("streaming")
        # batch_size is in samples (documents): about the documents one packed batch needs.
        # predownload (default 8 x batch_size) bounds how far the ready thread runs ahead; it
        # polls every 7 ms, so a small value caps throughput at ~predownload/7ms samples/s.
        docs_per_batch = max(1, round(spec.rank_batch * spec.seq_len / _mean_doc_tokens(layout)))
        common = dict(shuffle=True, shuffle_seed=spec.seed, batch_size=docs_per_batch,
                      predownload=4096, num_canonical_nodes=1)
        if spec.mode == "mix":
            streams = [Stream(local=os.path.join(root, f"{s}-ids"), proportion=w)
                       for s, w in zip(SOURCES, spec.weights)]
            self.ds = StreamingDataset(streams=streams, **common)
        else:
            kind = "ids" if spec.mode in ("pretok",) else "text"
            self.ds = StreamingDataset(local=os.path.join(root, f"web-{kind}"), **common)
        self.text = spec.mode == "text"
        if self.text:  # batched tokenization in the collate function (in the workers, if any)
            self.dl = DataLoader(self.ds, batch_size=TOKENIZE_BATCH, num_workers=spec.num_workers,
                                 collate_fn=TokenizeTexts(layout.info()["tokenizer"], key="text"))
        else:
            self.dl = DataLoader(self.ds, batch_size=None, num_workers=spec.num_workers,
                                 persistent_workers=False)
        self.world = spec.world_size
        self.consumed = 0
        self.packed = PackedBatches(self._docs, spec.seq_len, spec.rank_batch, eos_id(layout),
                                     self._peer_state, self._peer_load)

    def _docs(self):
        while True:  # epochs
            self.consumed = 0
            for sample in self.dl:
                if self.text:  # a batch of documents' ids
                    self.consumed += len(sample)
                    yield from sample
                else:
                    self.consumed += 1
                    yield sample["ids"]

    def _peer_state(self):
        return self.ds.state_dict(self.consumed * self.world, False)

    def _peer_load(self, state) -> None:
        self.ds.load_state_dict(state)


def open_session(spec: Spec, layout: Layout):
    return PackedRowsSession(spec, layout) if spec.loader == "streaming_packed" else Session(spec, layout)
