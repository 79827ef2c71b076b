"""The elastic-determinism suite with chat sources: the same global batches, loss masks included,
whatever the topology, and across a resume on another topology.

One chat dataset, sharded once by ``zephon shard`` with the ChatML test template and the shipped
tokenizer (so the lane files hold ``input_ids`` and ``loss_mask``), alone and mixed 1:1 with a
pretraining text dataset, in both packings. A step's fingerprint hashes ``input_ids`` and
``labels`` (``loader.commands.fingerprints``), not ``loss_mask``; so every step line here is the
harness's fingerprint line plus the SHA-256 of the step's loss masks in global-index order
(:class:`MaskedLoaderRun`), and two lines agree only when ids, labels and masks all do.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np
import pytest

from beam_jobs import shard
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints
from loader.stages.tokenizer import load_tokenizer
from loader.samples import default_tokenizer_path
from tests.chat.chat_factory import make_records
from tests.chat.test_chat_shard import MAX_TOKENS, NUM_LANES, _config, _job_args, _write_jsonl
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.resume_harness import LoaderRun, check_resume
from tests.loader.io.test_features import _rows as delivered_rows

STEPS = 4
PACKINGS = ("best_fit", "concat")
MIXES = ("chat", "chat+text")
# (world_size, num_workers, micro_batch_size); global batch 8. The first is the reference.
TOPOLOGIES = ((1, 0, 2), (2, 0, 4), (4, 0, 1), (2, 2, 2), (4, 2, 1))
# The uninterrupted run, then the segments of a run cut at steps 1 and 3, each on another
# W and worker count than the one before it.
RESUME = ({"world_size": 1, "num_workers": 0, "micro_batch_size": 4},
          {"world_size": 2, "num_workers": 2, "micro_batch_size": 2},
          {"world_size": 4, "num_workers": 0, "micro_batch_size": 2})


class _Recording:
    """A rank loader that hands each micro-batch's loss masks to ``sink`` by global index."""

    def __init__(self, loader, sink: dict[int, bytes]) -> None:
        self._loader, self._sink = loader, sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __next__(self) -> dict:
        batch = next(self._loader)
        for index, mask in zip(batch["global_indices"].tolist(), batch["loss_mask"].numpy()):
            self._sink[index] = np.asarray(mask, np.uint8).tobytes()
        return batch


class MaskedLoaderRun(LoaderRun):
    """:class:`LoaderRun` whose step line also covers the step's ``loss_mask`` rows."""

    def __init__(self, config: LoaderConfig, world_size: int = 1) -> None:
        super().__init__(config, world_size)
        self.masks: dict[int, bytes] = {}
        self.loaders = [_Recording(loader, self.masks) for loader in self.loaders]

    def _step(self) -> Optional[str]:
        self.masks.clear()
        line = super()._step()
        if line is None:
            return None
        digest = hashlib.sha256(b"".join(self.masks[i] for i in sorted(self.masks)))
        assert sorted(self.masks) == sorted(self.last_rows)  # every sequence of the step has its mask
        return f"{line} loss_mask={digest.hexdigest()}"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, list[dict]]:
    base = tmp_path_factory.mktemp("chat_elastic")
    (base / "in").mkdir()
    _write_jsonl(base / "in" / "chat.jsonl", make_records(29, 60))
    shard.run(_job_args([str(base / "in" / "chat.jsonl")], base / "chat", "--chat-max-tokens", str(MAX_TOKENS),
                        "--chat-overflow", "truncate"))
    texts = synthetic_texts(60, seed=8)
    write_dataset(str(base / "text"), texts, num_lanes=NUM_LANES, source_name="text",
                  tokenizer=load_tokenizer(default_tokenizer_path()), keys=[f"text-{k}" for k in range(len(texts))])
    chat = {"path": str(base / "chat"), "name": "chat", "weight": 0.5}
    return {"chat": [chat], "chat+text": [chat, {"path": str(base / "text"), "name": "text", "weight": 0.5}]}


def _lines(config: LoaderConfig, world_size: int, num_workers: int, micro: int) -> list[str]:
    run = MaskedLoaderRun(config.replace(num_workers=num_workers, micro_batch_size=micro), world_size)
    try:
        return run.run(STEPS)
    finally:
        run.close()


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("packing", PACKINGS)
def test_chat_batches_and_masks_are_the_same_on_every_topology_and_across_a_resume(datasets, packing, mix):
    config = _config(datasets[mix], packing)
    reference = _lines(config, *TOPOLOGIES[0])
    assert len(reference) == STEPS
    for topology in TOPOLOGIES[1:]:
        assert _lines(config, *topology) == reference, f"(W, workers, micro) = {topology}"

    def make(k: int) -> MaskedLoaderRun:
        topology = dict(RESUME[k % len(RESUME)])  # segments 1, 2, 3: W 2, 4, then 1 again
        world_size = topology.pop("world_size")
        return MaskedLoaderRun(config.replace(**topology), world_size)

    check_resume(make, steps=STEPS, cut_points=[1, 3], expected=reference)


@pytest.mark.parametrize("unit", ("sequence", "token"))
def test_supervised_counts_follow_the_delivered_labels_and_masks(datasets, unit):
    """``zephon fingerprints`` counts supervised tokens per source, the same on every W."""
    config = _config(datasets["chat+text"], "best_fit", mixing_unit=unit)
    rows = delivered_rows(config, steps=STEPS, output="numpy")
    results, _ = collect_fingerprints(config, world_size=1, end_step=STEPS)
    spread, _ = collect_fingerprints(config.replace(num_workers=2, micro_batch_size=1), world_size=4,
                                     end_step=STEPS)
    assert [r.line() for r in spread] == [r.line() for r in results]
    for result in results:
        expected = {"chat": 0, "text": 0}
        for index in range(result.step * 8, (result.step + 1) * 8):
            row = rows[index]
            supervised = (row["labels"] != -100) & (row["loss_mask"] == 1)
            if unit == "token":
                sources = row["token_source_ids"][supervised]
                expected["chat"] += int((sources == 0).sum())
                expected["text"] += int((sources == 1).sum())
            else:
                expected[("chat", "text")[int(row["source_ids"])]] += int(supervised.sum())
        assert result.supervised_counts == expected, f"step {result.step}"
        assert result.line().endswith(f" supervised: chat={expected['chat']} text={expected['text']}")
    assert all(r.supervised_counts["chat"] > 0 for r in results)
    assert sum(r.supervised_counts["text"] for r in results) > 0
