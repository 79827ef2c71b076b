"""What every peer adapter shares: the run spec, the data layout, the concat packer, fingerprints.

The packer here is the one piece of "user code" written on top of peers that have no packing
of their own (see ``PACKING_NOTE``, which the report quotes). It is the simplest correct
concat packing: append each document's ids and one EOS id to a carry buffer, cut full
``seq_len`` rows off the front, keep the remainder for the next row. Its state is the carry
buffer (at most ``seq_len - 1`` tokens plus one document), saved beside the peer's own state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

PACKING_NOTE = (
    "concat packing written once in bench/peers/common.py (ConcatPacker): each document's ids "
    "+ one EOS are appended to a carry buffer, full seq_len rows are cut from its front, the "
    "remainder carries over (its state is that buffer, saved next to the peer's state); text "
    "is tokenized one document at a time with tokenizers' Tokenizer.encode in the consuming "
    "process"
)

MODES = ("pretok", "text", "mix")


@dataclass
class Spec:
    """One run of one loader: what it reads and how the consuming loop is shaped."""

    loader: str
    mode: str  # "pretok" (pre-tokenized docs, packed), "text" (online tokenization + packing), "mix"
    data_dir: str  # bench work dir holding corpus/ and formats/
    seq_len: int
    global_batch: int
    num_workers: int = 0
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    weights: tuple[float, float] = (0.7, 0.3)
    profile: str = "main"  # "main" or "resume" (a second, smaller-seq_len copy of the formats)
    dataset: str = ""  # Zephon only: another dataset of its formats (the RSS goal's small twin)
    options: dict = field(default_factory=dict)  # Zephon only: LoaderConfig overrides, for profiling runs

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {self.mode=})")
        if self.global_batch % self.world_size:
            raise ValueError(f"global_batch {self.global_batch} not divisible by world_size {self.world_size}")
        self.weights = tuple(self.weights)

    @property
    def rank_batch(self) -> int:
        return self.global_batch // self.world_size

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------
# Data layout under <data_dir>.


@dataclass(frozen=True)
class Layout:
    root: str

    @property
    def corpus(self) -> str:
        return os.path.join(self.root, "corpus")

    def source_jsonl_dir(self, source: str) -> str:
        return os.path.join(self.corpus, source)

    def flat(self, source: str) -> str:
        """numpy flat token file + offsets: <source>.tokens.npy / <source>.offsets.npy"""
        return os.path.join(self.corpus, "flat", source)

    def formats(self, loader: str) -> str:
        return os.path.join(self.root, "formats", loader)

    @property
    def info_path(self) -> str:
        return os.path.join(self.corpus, "info.json")

    def info(self) -> dict:
        with open(self.info_path) as fh:
            return json.load(fh)

    def sources(self) -> list[str]:
        """The sources this corpus has (a corpus for runs without the mix has ``web`` only)."""
        return [s for s in SOURCES if s in self.info()["sources"]]


SOURCES = ("web", "caps")  # source A (weight 0.7) and source B (weight 0.3) of the mix


def load_flat(layout: Layout, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 memmap, offsets int64) of one source's pre-tokenized documents."""
    base = layout.flat(source)
    tokens = np.load(base + ".tokens.npy", mmap_mode="r")
    offsets = np.load(base + ".offsets.npy")
    return tokens, offsets


def iter_docs_jsonl(layout: Layout, source: str) -> Iterator[dict]:
    d = layout.source_jsonl_dir(source)
    for name in sorted(os.listdir(d)):
        if name.endswith(".jsonl"):
            with open(os.path.join(d, name)) as fh:
                for line in fh:
                    yield json.loads(line)


# --------------------------------------------------------------------------------------
# Tokenizer.


def load_tokenizer(layout: Layout):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(layout.info()["tokenizer"])


def eos_id(layout: Layout) -> int:
    return int(layout.info()["eos_id"])


# --------------------------------------------------------------------------------------
# Packing.


class ConcatPacker:
    """Concat packing of a document stream into fixed ``seq_len`` rows.

    ``feed(ids)`` appends one document (ids + EOS); ``rows()`` yields the full rows cut so far.
    State: ``{"carry": [token ids not yet emitted]}`` (shorter than one document + seq_len).
    """

    def __init__(self, seq_len: int, eos: int) -> None:
        self.seq_len = seq_len
        self.eos = eos
        self._carry = np.zeros(0, dtype=np.int64)

    def feed(self, ids) -> list[np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        buf = np.concatenate([self._carry, ids, np.array([self.eos], dtype=np.int64)])
        n = len(buf) // self.seq_len
        rows = [buf[i * self.seq_len:(i + 1) * self.seq_len] for i in range(n)]
        self._carry = buf[n * self.seq_len:].copy()
        return rows

    def state_dict(self) -> dict:
        return {"carry": self._carry.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._carry = np.asarray(state["carry"], dtype=np.int64)


class PackedBatches:
    """Turns a (stateful) document iterator into per-rank batches of packed rows.

    ``make_docs()`` returns a fresh iterator of token-id documents (called once per start and
    again after ``load_state_dict``); ``peer_state()`` / ``peer_load(state)`` save and restore
    the peer's own position. Rows left over from a document that produced more rows than
    the batch needed are part of the state too (``pending``).
    """

    def __init__(self, make_docs: Callable[[], Iterator], seq_len: int, batch: int, eos: int,
                 peer_state: Callable[[], Any], peer_load: Callable[[Any], None]) -> None:
        self.make_docs = make_docs
        self.batch = batch
        self.packer = ConcatPacker(seq_len, eos)
        self.pending: list[np.ndarray] = []
        self.peer_state = peer_state
        self.peer_load = peer_load
        self._docs: Optional[Iterator] = None

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self._docs is None:
            self._docs = iter(self.make_docs())
        while len(self.pending) < self.batch:
            self.pending.extend(self.packer.feed(next(self._docs)))
        out, self.pending = self.pending[: self.batch], self.pending[self.batch:]
        return np.stack(out)

    def state_dict(self) -> dict:
        return {"peer": self.peer_state(), "packer": self.packer.state_dict(),
                "pending": [r.tolist() for r in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        self.peer_load(state["peer"])
        self.packer.load_state_dict(state["packer"])
        self.pending = [np.asarray(r, dtype=np.int64) for r in state["pending"]]
        self._docs = None


class PackedSession:
    """A peer session whose batches come from ``self.packed`` (a :class:`PackedBatches`)."""

    packed: PackedBatches

    def __iter__(self):
        return self.packed

    def state_dict(self):
        return self.packed.state_dict()

    def load_state_dict(self, state) -> None:
        self.packed.load_state_dict(state)

    def close(self) -> None:
        pass


TOKENIZE_BATCH = 64  # documents per encode_batch_fast call where a peer tokenizes text


class TokenizeTexts:
    """Documents' texts -> their ids (int32 arrays, no special tokens), one
    ``encode_batch_fast`` call per batch: batched tokenization, as every tokenizer's docs
    recommend. Usable as a ``collate_fn`` (a list of texts, or of dicts with ``key``), so
    that with worker processes the workers tokenize; the tokenizer loads lazily in the
    process that calls it (picklable before that)."""

    def __init__(self, tokenizer_path: str, key: Optional[str] = None) -> None:
        self.path, self.key, self.tok = tokenizer_path, key, None

    def __call__(self, batch: list) -> list[np.ndarray]:
        if self.tok is None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(self.path)
        texts = [b[self.key] for b in batch] if self.key else list(batch)
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def __getstate__(self):
        return {"path": self.path, "key": self.key, "tok": None}


def flatten(batches: Iterable[list]) -> Iterator:
    """The documents of a stream of document batches, one by one."""
    for batch in batches:
        yield from batch


def tokenized_in_batches(texts: Iterable[str], tokenize: TokenizeTexts, size: int = TOKENIZE_BATCH) -> Iterator:
    """Ids of a stream of texts, tokenized ``size`` at a time in this process (for a peer
    whose pipeline hands out single documents, so a collate function cannot batch them)."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield from tokenize(batch)
            batch = []
    if batch:
        yield from tokenize(batch)


# --------------------------------------------------------------------------------------
# Pre-packed rows: the offline packing several peers recommend for LLM pre-training
# (LitData's TokensLoader chunks, llm-foundry's concat_tokens MDS, a packed ArrayRecord).


def packed_rows(layout: Layout, source: str, seq_len: int) -> np.ndarray:
    """[rows, seq_len] int32 (memory-mapped): ``source``'s documents in corpus order, each
    followed by EOS, concatenated and cut every ``seq_len`` tokens (the last partial row
    dropped). Built once per seq_len under ``corpus/packed``; what each peer's pre-packed
    format is written from."""
    path = os.path.join(layout.corpus, "packed", f"{source}-{seq_len}.npy")
    if not os.path.exists(path):
        tokens, offsets = load_flat(layout, source)
        stream = np.insert(np.asarray(tokens), offsets[1:], np.int32(eos_id(layout)))
        rows = len(stream) // seq_len
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path + ".tmp.npy", stream[: rows * seq_len].reshape(rows, seq_len))
        os.replace(path + ".tmp.npy", path)
    return np.load(path, mmap_mode="r")


class SampledRowsSession:
    """Batches of a map-style dataset of pre-packed rows: ``DistributedSampler(shuffle=True)``
    + torchdata ``StatefulDataLoader(batch_size=rows)``, epoch after epoch (the torchdata and
    HF datasets pre-packed rows). State: the epoch + the loader's state (it fast-forwards the
    sampler on restore)."""

    def __init__(self, ds, spec: Spec, collate_fn: Optional[Callable] = None, field: Optional[str] = None) -> None:
        from torch.utils.data.distributed import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.sampler = DistributedSampler(ds, num_replicas=spec.world_size, rank=spec.rank, shuffle=True,
                                          seed=spec.seed, drop_last=True)
        self.dl = StatefulDataLoader(ds, batch_size=spec.rank_batch, sampler=self.sampler, drop_last=True,
                                     num_workers=spec.num_workers, collate_fn=collate_fn,
                                     persistent_workers=spec.num_workers > 0)
        self.field = field
        self.epoch = 0
        self._it = None

    def _batches(self):
        while True:
            self.sampler.set_epoch(self.epoch)
            for batch in self.dl:
                yield batch if self.field is None else batch[self.field]
            self.epoch += 1

    def __iter__(self):
        if self._it is None:
            self._it = self._batches()
        return self._it

    def state_dict(self):
        return {"epoch": self.epoch, "dl": self.dl.state_dict()}

    def load_state_dict(self, state) -> None:
        self.epoch = state["epoch"]
        self.sampler.set_epoch(self.epoch)
        self.dl.load_state_dict(state["dl"])
        self._it = None

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------
# Fingerprints and source shares.


def batch_fingerprint(rows: np.ndarray) -> str:
    """SHA-256 of the batch's token ids, row-major, as little-endian int64."""
    return hashlib.sha256(np.ascontiguousarray(rows, dtype="<i8").tobytes()).hexdigest()


def multiset_fingerprint(rows: np.ndarray) -> str:
    """Order-insensitive variant: rows sorted by their own bytes before hashing."""
    rows = np.ascontiguousarray(rows, dtype="<i8")
    keys = sorted(r.tobytes() for r in rows)
    return hashlib.sha256(b"".join(keys)).hexdigest()


class ShareMeter:
    """Estimates the token share of source A in a batch from source-exclusive token ids.

    Source A is lowercase text, source B uppercase: their word tokens are disjoint, while
    spaces, punctuation and EOS are shared and not counted. ``info["share"]`` holds, per
    source, which ids are exclusive to it and which fraction of its tokens they are
    (``coverage``); counts are divided by that coverage before taking the share.
    """

    def __init__(self, layout: Layout) -> None:
        share = layout.info()["share"]
        vocab = int(share["vocab_size"])
        self.label = np.zeros(vocab + 1, dtype=np.int8)  # 0 shared, 1 A, 2 B
        self.label[np.asarray(share["a_ids"], dtype=np.int64)] = 1
        self.label[np.asarray(share["b_ids"], dtype=np.int64)] = 2
        self.cov_a = float(share["a_coverage"])
        self.cov_b = float(share["b_coverage"])

    def share_a(self, rows: np.ndarray) -> float:
        lab = self.label[np.clip(np.asarray(rows).ravel(), 0, len(self.label) - 1)]
        a = np.count_nonzero(lab == 1) / self.cov_a
        b = np.count_nonzero(lab == 2) / self.cov_b
        return float(a / (a + b)) if a + b else float("nan")


# --------------------------------------------------------------------------------------
# Small helpers for adapters.


def stub_streaming_vision() -> None:
    """mosaicml-streaming imports ``streaming.vision`` (and so torchvision) at import time.

    The PyPI torchvision is a CUDA build that crashes beside the CPU torch, and setup_peers.sh
    keeps it out of the venv, so the vision submodule is replaced by an empty module before
    ``import streaming``. Nothing in the text path uses it.
    """
    if "streaming.vision" not in sys.modules:
        sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")


def shard_dirs(base: str) -> list[str]:
    return sorted(os.path.join(base, n) for n in os.listdir(base))
