"""Shared helpers of the finite-epoch tests: documents with unique markers, and one finite
stream gathered over simulated ranks, rows by global index, each row's markers decoded."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from loader.checkpoint.state import merge_rank_states
from loader.config import LoaderConfig

MARKER = re.compile(r"Q(\d{5})Z")


def marker(k: int) -> str:
    return f"Q{k:05d}Z"


def marked_texts(count: int, seed: int = 0, max_words: int = 12) -> list[str]:
    """``count`` short documents, document ``k`` holding the marker ``Q{k:05d}Z`` once."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "lane", "batch", "step", "token", "the", "of"]
    return [f"{marker(k)} " + " ".join(words[w] for w in rng.integers(0, len(words), rng.integers(1, max_words)))
            for k in range(count)]


@dataclass
class Stream:
    """A finite stream as the trainers saw it: every row by global index."""

    rows: dict = field(default_factory=dict)  # global index -> (input_ids bytes, labels bytes, fill, loss_mask)
    steps: int = 0
    state: Optional[dict] = None  # merged state at ``save_at``

    def digest(self) -> str:
        h = hashlib.sha256()
        for index in sorted(self.rows):
            ids, labels, fill, _ = self.rows[index]
            h.update(ids + labels + bytes([fill]))
        return h.hexdigest()

    def fill_rows(self) -> list[int]:
        return [i for i, row in self.rows.items() if row[2]]

    def markers(self, tokenizer, num_lanes: int) -> Counter:
        """Every marker of the real rows, counted; rows joined per lane in index order first, so
        a marker a concat row boundary cuts is read whole."""
        lanes: dict[int, list[np.ndarray]] = {}
        for index in sorted(self.rows):
            ids, _, fill, _ = self.rows[index]
            if not fill:
                lanes.setdefault(index % num_lanes, []).append(np.frombuffer(ids, np.int64))
        found: Counter = Counter()
        for rows in lanes.values():
            text = tokenizer.decode(np.concatenate(rows).tolist(), skip_special_tokens=True).replace(" ", "")
            found.update(int(m) for m in MARKER.findall(text))
        return found


def run_stream(config: LoaderConfig, *, world_size: int = 1, load_state: Optional[dict] = None,
               save_at: Optional[int] = None, max_steps: int = 10_000) -> Stream:
    """The stream from the start (or ``load_state``) to its end, on ``world_size`` simulated ranks."""
    from loader.pipeline import ZephonLoader, ranks_have_step  # torch

    stream = Stream()
    loaders = [ZephonLoader(config, rank=r, world_size=world_size, output="numpy") for r in range(world_size)]
    try:
        if load_state is not None:
            for loader in loaders:
                loader.load_state_dict(load_state)
        micro_steps = loaders[0].topology.micro_steps_per_step
        for _ in range(max_steps):
            if save_at is not None and loaders[0].step == save_at:
                stream.state = merge_rank_states([loader.state_dict() for loader in loaders])
                return stream
            if not ranks_have_step(loaders):
                break
            for loader in loaders:
                for _ in range(micro_steps):
                    batch = next(loader)
                    fills = batch.get("fill", np.zeros(len(batch["input_ids"]), bool))
                    masks = batch.get("loss_mask")
                    for row, index in enumerate(batch["global_indices"].tolist()):
                        assert index not in stream.rows, f"global index {index} delivered twice"
                        stream.rows[index] = (batch["input_ids"][row].tobytes(), batch["labels"][row].tobytes(),
                                              bool(fills[row]), None if masks is None else masks[row].tobytes())
            stream.steps += 1
        else:
            raise AssertionError(f"the stream did not end within {max_steps} steps")
        assert not ranks_have_step(loaders), "the ranks' end of the stream is not stable"
    finally:
        for loader in loaders:
            loader.close()
    return stream
