"""Helpers for the mixing tests: run a loader and keep every sequence by global index."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from loader.config import LoaderConfig
from loader.order.mixing import exact_weights
from loader.stages.packing import IGNORE_INDEX
from loader.pipeline import ZephonLoader
from tests.loader.settings import make_stream


@dataclass
class Record:
    """One delivered sequence."""

    index: int
    step: int
    source: int  # batch["source_ids"]
    input_ids: np.ndarray
    labels: np.ndarray
    token_sources: Optional[np.ndarray]  # batch["token_source_ids"] row (token mixing only)
    padding: np.ndarray  # bool mask of the pad tail (only a lane's last sequence before its data ends)


def run_records(config: LoaderConfig, steps: int, *, world_size: int = 1) -> dict[int, Record]:
    """Every sequence of steps ``[0, steps)``, from all ``world_size`` ranks, by global index.

    Checks on the way that each micro-batch carries ``source_ids`` (and, in token mixing,
    ``token_source_ids`` whose majority is the sequence's source).
    """
    records: dict[int, Record] = {}
    loaders = [ZephonLoader(config, rank=r, world_size=world_size) for r in range(world_size)]
    try:
        for _ in range(steps):
            for loader in loaders:
                for _ in range(loader.topology.micro_steps_per_step):
                    batch = next(loader)
                    rows = len(batch["global_indices"])
                    assert batch["source_ids"].shape == (rows,)
                    token_sources = batch.get("token_source_ids")
                    if config.mixing_unit == "token":
                        assert token_sources is not None and token_sources.shape == (rows, config.seq_len)
                    else:
                        assert token_sources is None
                    for row, index in enumerate(batch["global_indices"].tolist()):
                        per_token = None if token_sources is None else token_sources[row].numpy()
                        source = int(batch["source_ids"][row])
                        if per_token is not None:
                            counts = np.bincount(per_token[per_token >= 0], minlength=len(config.datasets))
                            assert source == int(np.argmax(counts)), "source_ids is not the majority source"
                        ids, labels = batch["input_ids"][row].numpy(), batch["labels"][row].numpy()
                        records[index] = Record(
                            index, batch["step"], source, ids, labels, per_token,
                            _pad_tail(ids, labels, loader.spec.pad_id),
                        )
    finally:
        for loader in loaders:
            loader.close()
    assert sorted(records) == list(range(steps * config.global_batch_size))
    return records


def count_bounds(weights: dict[str, float], batch: int) -> list[tuple[int, int]]:
    """``(floor, ceil)`` of ``w_s * batch`` per source, with the loader's exact weights."""
    return [(math.floor(w * batch), math.ceil(w * batch)) for w in exact_weights(list(weights.values()))]


def lane_records(records: dict[int, Record], lane: int, num_lanes: int) -> list[Record]:
    """The lane's outputs in the order the lane produced them."""
    return [records[i] for i in sorted(records) if i % num_lanes == lane]


def source_tokens_of_lane(records: list[Record], source: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``source`` in a lane's outputs, in order, and a mask of its document starts.

    Sequence mixing: the whole sequences of that source. Token mixing: the tokens labelled
    with it. Padding (label -100 on the pad tail) is dropped.
    """
    tokens, starts = [], []
    for record in records:
        if record.token_sources is not None:
            keep = record.token_sources == source
        else:
            keep = np.full(len(record.input_ids), record.source == source)
        keep &= ~record.padding
        tokens.append(record.input_ids[keep])
        starts.append((record.labels == IGNORE_INDEX)[keep])
    return np.concatenate(tokens), np.concatenate(starts)


def _pad_tail(ids: np.ndarray, labels: np.ndarray, pad_id: int) -> np.ndarray:
    """The padded tail: the longest suffix of pad ids with label -100.

    A real token there would be a document's first token (label -100 too) but never the
    pad id (EOS), since the test documents are never empty.
    """
    pad = (labels == IGNORE_INDEX) & (ids == pad_id)
    tail = np.zeros(len(ids), dtype=bool)
    k = len(ids)
    while k > 0 and pad[k - 1]:
        k -= 1
    tail[k:] = True
    return tail


def stream_prefix(path: str, tokenizer, lane: int, count: int, *, seed: int, max_epochs=None) -> np.ndarray:
    """The first ``count`` tokens of a source's lane stream (what the loader must deliver)."""
    stream = make_stream(path, tokenizer, lane, seed=seed, max_epochs=max_epochs)
    chunks = []
    taken = 0
    while taken < count:
        chunk = stream.take(count - taken)
        if chunk is None:
            break
        chunks.append(chunk.tokens)
        taken += len(chunk.tokens)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)


def split_documents(tokens: np.ndarray, starts: np.ndarray) -> list[tuple[int, ...]]:
    """Documents of a token run given its document-start mask (the first may be partial)."""
    cuts = np.flatnonzero(starts).tolist()
    bounds = ([0] if not cuts or cuts[0] != 0 else []) + cuts + [len(tokens)]
    return [tuple(tokens[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
