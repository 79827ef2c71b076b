"""Hugging Face datasets: Parquet files streamed as an ``IterableDataset``.

Pipeline (HF's documented recipes)::

    load_dataset("parquet", data_files=..., streaming=True) .shuffle(seed, buffer_size=1000)
      [interleave_datasets([web, caps], probabilities=(0.7, 0.3), seed) for the mix]
      split_dataset_by_node(rank, world_size)
      [.map(tokenize, batched=True)  with tokenizers' encode_batch, for text]
      .map(group_texts, batched=True, batch_size=1000)   # concat + EOS, cut seq_len blocks
      .with_format("numpy") -> torchdata StatefulDataLoader(batch_size=rank_batch, num_workers)

``group_texts`` is the packing of HF's causal-LM examples: it drops the remainder of each
1000-document map batch (< seq_len tokens), so a few tokens per 1000 documents are lost.
State: the ``StatefulDataLoader`` state (which holds the dataset's ``state_dict()``) + epoch.

``hf_packed`` (pre-tokenized only): the map-style path of HF's ``run_clm.py`` example, whose
``group_texts`` output is an Arrow dataset of packed ``seq_len`` rows: here the same rows as
every pre-packed format (``Dataset(pyarrow table).save_to_disk``), read with
``load_from_disk(...).with_format("numpy")`` through ``StatefulDataLoader(batch_size=rows,
sampler=DistributedSampler(shuffle=True))``.
"""

from __future__ import annotations

import glob
import os


from bench.peers.common import SOURCES, Layout, SampledRowsSession, Spec, eos_id, packed_rows


def version() -> str:
    from importlib.metadata import version as v

    return v("datasets")


def imports() -> None:
    import datasets  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401


def prepare(layout: Layout) -> dict:
    return {"note": "reads corpus/parquet directly"}


def _packed_dir(layout: Layout, seq_len: int) -> str:
    return os.path.join(layout.formats("hf_packed"), f"web-{seq_len}")


def prepare_packed(layout: Layout, seq_len: int) -> dict:
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset

    rows = packed_rows(layout, "web", seq_len)
    ids = pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(rows).reshape(-1)), seq_len)
    Dataset(pa.table({"input_ids": ids})).save_to_disk(_packed_dir(layout, seq_len))
    return {"rows": len(rows)}


class _GroupTexts:
    def __init__(self, seq_len: int, eos: int) -> None:
        self.seq_len, self.eos = seq_len, eos

    def __call__(self, batch: dict) -> dict:
        flat: list[int] = []
        for ids in batch["input_ids"]:
            flat.extend(ids)
            flat.append(self.eos)
        n = len(flat) // self.seq_len * self.seq_len
        return {"input_ids": [flat[i:i + self.seq_len] for i in range(0, n, self.seq_len)]}


class _Tokenize:
    def __init__(self, path: str) -> None:
        self.path, self.tok = path, None

    def __call__(self, batch: dict) -> dict:
        if self.tok is None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(self.path)
        return {"input_ids": [e.ids for e in self.tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}


def _stack_ids(rows: list[dict]):
    import numpy as np

    return {"input_ids": np.stack([r["input_ids"] for r in rows])}


class Session:
    def __init__(self, spec: Spec, layout: Layout) -> None:
        from datasets import interleave_datasets, load_dataset
        from datasets.distributed import split_dataset_by_node
        from torchdata.stateful_dataloader import StatefulDataLoader

        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        cache = os.path.join(layout.root, "_cache", "hf")

        def files(source: str, kind: str) -> list[str]:
            return sorted(glob.glob(os.path.join(layout.corpus, "parquet", source, f"{kind}-*.parquet")))

        def stream(source: str, kind: str, seed: int):
            ds = load_dataset("parquet", data_files=files(source, kind), split="train", streaming=True,
                              cache_dir=cache)
            return ds.select_columns(["input_ids" if kind == "ids" else "text"]).shuffle(seed=seed, buffer_size=1000)

        if spec.mode == "mix":
            ds = interleave_datasets([stream(s, "ids", spec.seed + i) for i, s in enumerate(SOURCES)],
                                     probabilities=list(spec.weights), seed=spec.seed,
                                     stopping_strategy="all_exhausted")
        else:
            ds = stream("web", "ids" if spec.mode == "pretok" else "text", spec.seed)
        ds = split_dataset_by_node(ds, rank=spec.rank, world_size=spec.world_size)
        if spec.mode == "text":
            ds = ds.map(_Tokenize(layout.info()["tokenizer"]), batched=True, remove_columns=["text"])
        ds = ds.map(_GroupTexts(spec.seq_len, eos_id(layout)), batched=True, batch_size=1000)
        # "numpy" format: the "torch" formatter builds one tensor per token id (10x slower here)
        self.ds = ds.with_format("numpy")
        self.dl = StatefulDataLoader(self.ds, batch_size=spec.rank_batch, num_workers=spec.num_workers,
                                     drop_last=True, collate_fn=_stack_ids)
        self.epoch = 0
        self._it = None

    def _batches(self):
        while True:
            self.ds.set_epoch(self.epoch)
            for batch in self.dl:
                yield batch["input_ids"]
            self.epoch += 1

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = self._batches()
        return next(self._it)

    def state_dict(self):
        return {"epoch": self.epoch, "dl": self.dl.state_dict()}

    def load_state_dict(self, state) -> None:
        self.epoch = state["epoch"]
        self.ds.set_epoch(self.epoch)
        self.dl.load_state_dict(state["dl"])
        self._it = None

    def close(self) -> None:
        pass


def open_session(spec: Spec, layout: Layout):
    if spec.loader == "hf_packed":
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.load_from_disk(_packed_dir(layout, spec.seq_len)).with_format("numpy")
        return SampledRowsSession(ds, spec, collate_fn=_stack_ids, field="input_ids")
    return Session(spec, layout)


