"""The baselines a user would write: ``DistributedSampler`` over pre-packed sequences, or over documents.

These are the comparison points for ``train_gpt.py --loader baseline`` / ``--loader
baseline_online`` and the elastic demo. Both read the *same* lane-sharded datasets and
tokenizer as the Zephon config and resume the usual way, by skipping the micro-batches
already consumed; they differ in where packing happens.

``baseline`` (:class:`BaselineData`): pack once, then shard the sequences.

1. **Pre-packs once** (every rank builds the same list, or loads it from ``cache``): each
   source's documents in file order, ``ids + [EOS]``, concatenated and cut every
   ``seq_len`` tokens (the tail remainder is dropped). Labels are ``input_ids`` with
   ``-100`` on each document's first token and position ids restart at every document,
   exactly Zephon's conventions, so the model and loss code are shared.
2. **Mixes by a fixed list**: the largest epoch with the configured weights that uses no
   sequence twice (``n_s = floor(w_s * min_s(count_s / w_s))``, the first ``n_s`` sequences
   of source ``s``), concatenated.
3. **Samples** with ``DistributedSampler(shuffle=True, seed=config.seed)`` and
   ``set_epoch(epoch)``, a ``DataLoader(batch_size=micro_batch, drop_last=False)`` and
   gradient accumulation ``B / (W * micro_batch)``. An epoch has
   ``ceil(len(dataloader) / accum)`` optimizer steps; the last one may be short.
4. **Resumes the usual way** (as Hugging Face ``Trainer`` does): from the global step,
   ``epoch = step // steps_per_epoch`` and the first ``(step % steps_per_epoch) * accum``
   micro-batches of that epoch are read and discarded.

Sequence ``k`` of rank ``r`` in an epoch is position ``r + k * W`` of the sampler's
permutation (``DistributedSampler`` deals indices round-robin), which is how the trainer
orders a baseline global batch for its fingerprint. Where this differs from Zephon: the
sampler pads the permutation to a multiple of ``W`` by repeating its first indices, so the
last step of every epoch depends on the world size.

``baseline_online`` (:class:`OnlineBaselineData`): shard the documents, then tokenize and
pack on each rank, as one writes once tokenization and packing move into the input
pipeline (the pattern of ``split_dataset_by_node`` + a packing ``IterableDataset``):

1. **Documents**: exactly the tokens of the pre-packed list, as documents. Per source, the
   documents in file order; the one that crosses the pre-packed list's share of the source
   (step 2 above) is cut there, and later ones are left out. (Finding the cut needs token
   counts, so the document list is built once up front, as ``prepack`` would be.)
2. **Shards documents** with ``DistributedSampler(shuffle=True, seed=config.seed)`` over the
   document list, ``set_epoch(epoch)``; a rank's loader worker ``w`` of ``n`` takes every
   ``n``-th of the rank's documents (the usual ``get_worker_info`` split).
3. **Tokenizes and concat-packs online**, in an ``IterableDataset`` read through a
   ``DataLoader(batch_size=micro_batch)``: ``ids + [EOS]`` of each document appended to a
   buffer, a sequence cut every ``seq_len`` tokens, the remainder carried into the next
   sequence (same labels / position-id conventions as above). The stream is endless: after
   its last document a rank starts its next epoch, so every rank delivers ``B / W``
   sequences per step whatever its documents' lengths.
4. **Resumes by skipping**: a rank restarts its stream and discards the first
   ``step * accum`` micro-batches, the count it would have consumed by then.

A rank's sequences here are a function of ``W`` (which documents it packs, and in what
order) and of the worker count, so after a resume on another world size (or worker count)
the global batches differ from the first resumed step on. A sequence's ``source_ids`` is
the source of its first token (a sequence can hold documents of both sources).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

from loader.config import LoaderConfig
from loader.io.manifest import read_manifest
from loader.stages.tokenizer import EOS_CANDIDATES, BOS_CANDIDATES, load_tokenizer, resolve_special_token

IGNORE_INDEX = -100


@dataclass
class PackedList:
    """The pre-packed epoch: ``[n, seq_len]`` arrays plus each row's source id."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    source_ids: np.ndarray
    source_names: list[str]

    def save(self, path: str, key: str) -> None:
        tmp = path + ".tmp.npz"
        np.savez(tmp, input_ids=self.input_ids, labels=self.labels, position_ids=self.position_ids,
                 source_ids=self.source_ids, source_names=np.array(self.source_names), key=np.array(key))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, key: str) -> Optional["PackedList"]:
        """The cached list, or None when ``path`` is missing or was built from other inputs."""
        if not os.path.exists(path):
            return None
        with np.load(path) as data:
            if str(data["key"]) != key:
                return None
            return cls(data["input_ids"], data["labels"], data["position_ids"], data["source_ids"],
                       [str(n) for n in data["source_names"]])


def load_or_prepack(config: LoaderConfig, cache: Optional[str], *, rank: int, barrier) -> PackedList:
    """Pre-pack on every rank, or once on rank 0 into ``cache`` (rebuilt when its inputs changed)."""
    if cache is None:
        return prepack(config)
    key = cache_key(config)
    if rank == 0 and PackedList.load(cache, key) is None:
        prepack(config).save(cache, key)
    barrier()
    packed = PackedList.load(cache, key)
    if packed is None:
        raise RuntimeError(f"baseline cache {cache} was not written for this config")
    return packed


def _pack_source(dataset_path: str, tokenizer, seq_len: int, bos: Optional[int], eos: Optional[int]):
    manifest = read_manifest(dataset_path)
    tokens: list[np.ndarray] = []
    for entry in sorted(manifest.files, key=lambda e: (e.lane, e.part)):
        table = pq.read_table(os.path.join(dataset_path, entry.path))
        if "input_ids" in table.column_names:
            docs = [np.asarray(ids, dtype=np.int64) for ids in table.column("input_ids").to_pylist()]
        else:
            texts = table.column("text").to_pylist()
            docs = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        for ids in docs:
            parts = ([[bos]] if bos is not None else []) + [ids] + ([[eos]] if eos is not None else [])
            tokens.append(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    lengths = np.array([len(t) for t in tokens])
    flat = np.concatenate(tokens)
    is_start = np.zeros(len(flat), dtype=bool)
    is_start[np.cumsum(lengths) - lengths] = True
    n = len(flat) // seq_len
    ids = flat[: n * seq_len].reshape(n, seq_len)
    starts = is_start[: n * seq_len].reshape(n, seq_len)
    labels, position_ids = _labels_and_positions(ids, starts)
    return ids, labels, position_ids


def _labels_and_positions(ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels (``-100`` on each document's first token) and position ids of ``[n, seq_len]`` rows."""
    seq_len = ids.shape[1]
    labels = np.where(starts, IGNORE_INDEX, ids)
    restart = starts.copy()
    restart[:, 0] = True  # a carried document piece starts the row at position 0
    seg_begin = np.maximum.accumulate(np.where(restart, np.arange(seq_len), 0), axis=1)
    position_ids = np.arange(seq_len)[None, :] - seg_begin
    return labels, position_ids


def prepack(config: LoaderConfig) -> PackedList:
    """Pack every source of ``config`` and cut the fixed mixed list (see module docstring)."""
    tokenizer = load_tokenizer(config.tokenizer)
    eos = resolve_special_token(tokenizer, config.eos_token, EOS_CANDIDATES, "eos_token") if config.add_eos else None
    bos = resolve_special_token(tokenizer, config.bos_token, BOS_CANDIDATES, "bos_token") if config.add_bos else None
    packed = [_pack_source(d.path, tokenizer, config.seq_len, bos, eos) for d in config.datasets]
    weights = np.array([d.weight for d in config.datasets], dtype=np.float64)
    weights = weights / weights.sum()
    total = min(len(p[0]) / w for p, w in zip(packed, weights) if w > 0)
    take = [int(math.floor(w * total + 1e-9)) for w in weights]
    names = [d.name or read_manifest(d.path).source_name for d in config.datasets]
    return PackedList(
        input_ids=np.concatenate([p[0][:k] for p, k in zip(packed, take)]),
        labels=np.concatenate([p[1][:k] for p, k in zip(packed, take)]),
        position_ids=np.concatenate([p[2][:k] for p, k in zip(packed, take)]),
        source_ids=np.concatenate([np.full(k, s) for s, k in enumerate(take)]).astype(np.int64),
        source_names=names,
    )


def cache_key(config: LoaderConfig) -> str:
    """Names the pre-packed list: what it depends on (datasets, tokenizer, seq_len, weights)."""
    blob = json.dumps({
        "datasets": [(d.path, d.weight, read_manifest(d.path).dataset_fingerprint) for d in config.datasets],
        "tokenizer": config.tokenizer, "seq_len": config.seq_len, "bos": config.add_bos, "eos": config.add_eos,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class PackedDataset(Dataset):
    def __init__(self, packed: PackedList) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed.source_ids)

    def __getitem__(self, i: int) -> dict:
        p = self.packed
        return {
            "input_ids": torch.from_numpy(p.input_ids[i]), "labels": torch.from_numpy(p.labels[i]),
            "position_ids": torch.from_numpy(p.position_ids[i]),
            "source_ids": int(p.source_ids[i]), "sequence_ids": i,
        }


class BaselineData:
    """Per-step lists of micro-batches from the pre-packed list, for one rank."""

    def __init__(self, packed: PackedList, config: LoaderConfig, *, rank: int, world_size: int,
                 micro_batch: int, num_workers: int) -> None:
        per_rank = config.global_batch_size // world_size
        if config.global_batch_size % world_size or per_rank % micro_batch:
            raise ValueError(
                f"global_batch_size={config.global_batch_size} must split into world_size={world_size} "
                f"ranks of whole micro-batches of {micro_batch}"
            )
        self.rank, self.world_size = rank, world_size
        self.accum = per_rank // micro_batch
        self.source_names = packed.source_names
        self.sampler = DistributedSampler(
            PackedDataset(packed), num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed, drop_last=False
        )
        self.dataloader = DataLoader(
            PackedDataset(packed), batch_size=micro_batch, sampler=self.sampler, num_workers=num_workers,
            drop_last=False, persistent_workers=False,
        )
        self.micro_batch = micro_batch
        self.steps_per_epoch = math.ceil(len(self.dataloader) / self.accum)
        self.epoch_positions = len(self.sampler) * world_size  # padded permutation length
        self._iter: Optional[Iterator] = None
        self._epoch = -1
        self._micro_in_epoch = 0

    def start_at(self, step: int) -> None:
        """Position the stream at the first micro-batch of global step ``step`` (skip the usual way)."""
        self._begin_epoch(step // self.steps_per_epoch)
        skip = (step % self.steps_per_epoch) * self.accum
        for _ in itertools.islice(self._iter, skip):
            pass
        self._micro_in_epoch = skip

    def _begin_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self.sampler.set_epoch(epoch)
        self._iter = iter(self.dataloader)
        self._micro_in_epoch = 0

    def next_step(self) -> list[dict]:
        """The rank's micro-batches of the next step (fewer at the end of an epoch)."""
        if self._iter is None:
            self.start_at(0)
        if self._micro_in_epoch >= len(self.dataloader):
            self._begin_epoch(self._epoch + 1)
        out = []
        for _ in range(self.accum):
            if self._micro_in_epoch >= len(self.dataloader):
                break
            batch = next(self._iter)
            k0 = self._micro_in_epoch * self.micro_batch
            positions = self.rank + self.world_size * torch.arange(k0, k0 + len(batch["sequence_ids"]))
            batch["global_indices"] = self._epoch * self.epoch_positions + positions
            self._micro_in_epoch += 1
            out.append(batch)
        return out

    def close(self) -> None:
        self._iter = None


# -- baseline_online: shard documents, tokenize and pack per rank ----------------------------
@dataclass(frozen=True)
class Document:
    """One document of the online baseline: text (or pre-tokenized ids) and an optional cut."""

    source_id: int
    index: int  # position in the document list
    text: Optional[str]
    ids: Optional[tuple[int, ...]]  # pre-tokenized datasets only
    max_tokens: Optional[int]  # keep only the first max_tokens tokens (BOS/EOS included); None: all


def _read_documents(dataset_path: str):
    """``(text, ids)`` of a dataset's documents in file order (lane, part, row)."""
    manifest = read_manifest(dataset_path)
    for entry in sorted(manifest.files, key=lambda e: (e.lane, e.part)):
        table = pq.read_table(os.path.join(dataset_path, entry.path))
        if "input_ids" in table.column_names:
            for ids in table.column("input_ids").to_pylist():
                yield None, tuple(int(i) for i in ids)
        else:
            for text in table.column("text").to_pylist():
                yield text, None


def document_list(config: LoaderConfig) -> tuple[list[Document], list[str]]:
    """The pre-packed list's tokens as documents (module docstring, ``baseline_online`` step 1)."""
    tokenizer = load_tokenizer(config.tokenizer)
    extra = int(config.add_bos) + int(config.add_eos)
    per_source = []
    for d in config.datasets:
        docs = list(_read_documents(d.path))
        texts = [t for t, ids in docs if ids is None]
        encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        lengths = [(len(ids) if ids is not None else len(next(encoded).ids)) + extra for _, ids in docs]
        per_source.append((docs, lengths))
    # the pre-packed list's rule: take_s = floor(w_s * min_s(sequences_s / w_s)) sequences of source s
    weights = np.array([d.weight for d in config.datasets], dtype=np.float64)
    weights = weights / weights.sum()
    sequences = [sum(lengths) // config.seq_len for _, lengths in per_source]
    total = min(n / w for n, w in zip(sequences, weights) if w > 0)
    budgets = [int(math.floor(w * total + 1e-9)) * config.seq_len for w in weights]
    out: list[Document] = []
    for s, ((docs, lengths), budget) in enumerate(zip(per_source, budgets)):
        used = 0
        for (text, ids), n in zip(docs, lengths):
            if used >= budget:
                break
            cut = budget - used if used + n > budget else None
            out.append(Document(s, len(out), text, ids, cut))
            used += n if cut is None else cut
    names = [d.name or read_manifest(d.path).source_name for d in config.datasets]
    return out, names


class DocumentDataset(Dataset):
    """Map-style dataset of documents: what ``DistributedSampler`` shards."""

    def __init__(self, documents: list[Document]) -> None:
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> Document:
        return self.documents[i]


class OnlinePackedStream(IterableDataset):
    """A rank's endless stream of packed sequences: its documents, tokenized and packed in order."""

    def __init__(self, documents: list[Document], config: LoaderConfig, *, rank: int, world_size: int) -> None:
        self.dataset = DocumentDataset(documents)
        self.config, self.rank, self.world_size = config, rank, world_size

    def _token_ids(self, doc: Document, tokenizer, bos: Optional[int], eos: Optional[int]) -> np.ndarray:
        ids = list(doc.ids) if doc.ids is not None else tokenizer.encode(doc.text, add_special_tokens=False).ids
        ids = ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
        return np.asarray(ids[: doc.max_tokens] if doc.max_tokens is not None else ids, dtype=np.int64)

    def __iter__(self):
        config, seq_len = self.config, self.config.seq_len
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        tokenizer = load_tokenizer(config.tokenizer)
        eos = resolve_special_token(tokenizer, config.eos_token, EOS_CANDIDATES, "eos_token") if config.add_eos else None
        bos = resolve_special_token(tokenizer, config.bos_token, BOS_CANDIDATES, "bos_token") if config.add_bos else None
        sampler = DistributedSampler(self.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                     seed=config.seed, drop_last=False)
        ids = np.zeros(0, dtype=np.int64)
        starts = np.zeros(0, dtype=bool)
        sources = np.zeros(0, dtype=np.int64)
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for k, index in enumerate(sampler):
                if k % num_workers != worker_id:
                    continue
                doc = self.dataset[index]
                tokens = self._token_ids(doc, tokenizer, bos, eos)
                is_start = np.zeros(len(tokens), dtype=bool)
                is_start[:1] = True
                ids = np.concatenate([ids, tokens])
                starts = np.concatenate([starts, is_start])
                sources = np.concatenate([sources, np.full(len(tokens), doc.source_id, dtype=np.int64)])
                while len(ids) >= seq_len:
                    row_ids, row_starts = ids[None, :seq_len], starts[None, :seq_len]
                    labels, position_ids = _labels_and_positions(row_ids, row_starts)
                    yield {
                        "input_ids": torch.from_numpy(row_ids[0].copy()), "labels": torch.from_numpy(labels[0]),
                        "position_ids": torch.from_numpy(position_ids[0]), "source_ids": int(sources[0]),
                    }
                    ids, starts, sources = ids[seq_len:], starts[seq_len:], sources[seq_len:]


class OnlineBaselineData:
    """Per-step lists of micro-batches of the online-packing baseline, for one rank."""

    def __init__(self, config: LoaderConfig, *, rank: int, world_size: int, micro_batch: int,
                 num_workers: int) -> None:
        per_rank = config.global_batch_size // world_size
        if config.global_batch_size % world_size or per_rank % micro_batch:
            raise ValueError(
                f"global_batch_size={config.global_batch_size} must split into world_size={world_size} "
                f"ranks of whole micro-batches of {micro_batch}"
            )
        self.rank, self.world_size, self.micro_batch = rank, world_size, micro_batch
        self.per_rank = per_rank
        self.global_batch = config.global_batch_size
        self.accum = per_rank // micro_batch
        self.documents, self.source_names = document_list(config)
        self.stream = OnlinePackedStream(self.documents, config, rank=rank, world_size=world_size)
        self.dataloader = DataLoader(self.stream, batch_size=micro_batch, num_workers=num_workers)
        self._iter: Optional[Iterator] = None
        self._step = 0

    def start_at(self, step: int) -> None:
        """Restart the stream and skip the micro-batches of steps ``0 .. step-1`` (the usual resume)."""
        self._iter = iter(self.dataloader)
        for _ in itertools.islice(self._iter, step * self.accum):
            pass
        self._step = step

    def next_step(self) -> list[dict]:
        """The rank's ``accum`` micro-batches of the next step.

        ``global_indices`` are slots ``step * B + rank * B/W + k`` (rank-major). They only
        order the rows; the trainer fingerprints this baseline's batches by content.
        """
        if self._iter is None:
            self.start_at(0)
        out = []
        base = self._step * self.global_batch + self.rank * self.per_rank
        for j in range(self.accum):
            batch = next(self._iter)
            batch["global_indices"] = base + j * self.micro_batch + torch.arange(len(batch["source_ids"]))
            out.append(batch)
        self._step += 1
        return out

    def close(self) -> None:
        self._iter = None
