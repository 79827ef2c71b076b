"""``balance = "attention"`` with image and image-chat sources, on real gloo ranks.

One config mixes an image source, an image-chat source (online rejects included) and a text
source. Real ranks exchange whole rows (pixels, image grids and positions, features, rejects:
``loader.balance_rows``); every micro-batch of every real rank must equal, field by field and
byte for byte, the one the same rank collates when the ranks are simulated in one process, and
the global batches they form must have the fingerprints of the config without balance.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from beam_jobs import shard
from image_datasets import write_jsonl
from image_loader_data import DYNAMIC, FIXED, NUM_LANES, image_config, image_tokenizer, shard_images
from loader.balance_rows import decode_items, encode_items
from loader.balanced import Balancer
from loader.commands.fingerprints import collect_fingerprints
from loader.order.balance import CostModel
from loader.pipeline import ZephonLoader
from loader.stages.tokenizer import load_tokenizer
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.loader.balance_worker import batch_digest, row_bytes
from tests.rank_launcher import launch_ranks
from tests.vision.image_chat_data import bad_conversations, conversations, job_args, online_rejects

STEPS = 3
SEQ_LEN = 256


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_balance")
    tokenizer = image_tokenizer(root / "tokenizer.json")
    images = shard_images(root / "pairs", root / "images", 40, DYNAMIC)
    inputs = root / "chat_in"
    write_jsonl(inputs / "chat.jsonl", conversations(inputs) + bad_conversations(inputs) + online_rejects())
    shard.run(job_args(inputs / "chat.jsonl", root / "chat"))
    texts = synthetic_texts(48, seed=5, max_words=120)
    write_dataset(str(root / "text"), texts, num_lanes=NUM_LANES, source_name="text",
                  tokenizer=load_tokenizer(tokenizer), keys=[f"text-{k}" for k in range(len(texts))])
    datasets = [{"path": images, "name": "images", "weight": 0.4}, {"path": str(root / "chat"), "name": "chat",
                                                                     "weight": 0.4},
                {"path": str(root / "text"), "name": "text", "weight": 0.2}]

    def make(**overrides):
        fields = dict(seq_len=SEQ_LEN, batch_fields=("input_ids", "labels", "position_ids", "loss_mask"))
        fields.update(overrides)
        return image_config(datasets, tokenizer, **fields)

    return make


def _simulated(config, world_size: int, steps: int):
    """Per rank: the micro-batches' digests and the sequences' fingerprint bytes, ranks in one process."""
    loaders = [ZephonLoader(config, rank=r, world_size=world_size) for r in range(world_size)]
    digests, rows, batches = [[] for _ in loaders], [{} for _ in loaders], []
    try:
        for _ in range(steps):
            for rank, loader in enumerate(loaders):
                for _ in range(loader.topology.micro_steps_per_step):
                    batch = next(loader)
                    digests[rank].append(batch_digest(batch))
                    rows[rank].update(row_bytes(batch))
                    batches.append(batch)
    finally:
        for loader in loaders:
            loader.close()
    return digests, rows, batches


def _global_lines(rows: dict[str, str], global_batch: int, steps: int) -> list[str]:
    import hashlib

    lines = []
    for step in range(steps):
        digest = hashlib.sha256()
        for index in range(step * global_batch, (step + 1) * global_batch):
            digest.update(bytes.fromhex(rows[str(index)]))
        lines.append(f"{step} {digest.hexdigest()}")
    return lines


def _reference_lines(config, steps: int) -> list[str]:
    results, _ = collect_fingerprints(config.replace(balance=None), world_size=1, end_step=steps)
    return [" ".join(r.line().split()[:2]) for r in results]


def test_rows_survive_the_exchange_encoding_byte_for_byte(mixed):
    """Every field of every row (pixels, grids, positions, features, rejects) through encode/decode."""
    config = mixed(balance=None)
    loader = ZephonLoader(config, rank=0, world_size=1)
    try:
        items = [item for _ in range(2 * loader.topology.micro_steps_per_step) for item in loader._next_items()]
        features = loader.features
        decoded = decode_items(encode_items(items, features), features)
        assert any(item.sequence.images is not None and len(item.sequence.images) for item in items)
        for sent, got in zip(items, decoded, strict=True):
            assert (got.global_index, got.source_id, got.chat_rejects) == \
                (sent.global_index, sent.source_id, sent.chat_rejects)
            a, b = sent.sequence, got.sequence
            for name in ("input_ids", "labels", "segment_starts"):
                assert getattr(a, name).dtype == getattr(b, name).dtype and np.array_equal(getattr(a, name),
                                                                                           getattr(b, name))
            assert b.padding == a.padding and b.majority_source == a.majority_source
            assert sorted(b.features) == sorted(a.features)
            for name in a.features:
                assert a.features[name].dtype == b.features[name].dtype
                assert np.array_equal(a.features[name], b.features[name])
            assert (a.images is None) == (b.images is None)
            if a.images is not None:
                assert np.array_equal(a.images.positions, b.images.positions)
                assert np.array_equal(a.images.lengths, b.images.lengths)
                assert np.array_equal(a.images.grids, b.images.grids)
                for x, y in zip(a.images.pixels, b.images.pixels, strict=True):
                    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        collated = loader._collate(items[:2], 2), loader._collate(decoded[:2], 2)
        assert batch_digest(collated[0]) == batch_digest(collated[1])
    finally:
        loader.close()


def test_image_cost_is_priced_by_the_encoders_patches():
    """A dynamic image of grid (1, 4, 6): 24 patches for 6 visual tokens; a fixed one (1, 4, 4):
    16 patches for 16 visual tokens. The grid is what the encoder sees, whatever the policy."""
    model = CostModel(linear=10)
    base = model.row_cost(np.array([0]), 32, 0)
    assert model.row_cost(np.array([0]), 32, 0, image_grids=np.array([[1, 4, 6]])) == base + 24 * 24 + 10 * 24
    assert model.row_cost(np.array([0]), 32, 0, image_grids=np.array([[1, 4, 4], [1, 4, 6]])) == \
        base + (16 * 16 + 160) + (24 * 24 + 240)
    assert model.row_cost(np.array([0]), 32, 0, image_grids=np.zeros((0, 3), np.int64)) == base


@pytest.mark.parametrize("policy", [DYNAMIC, FIXED], ids=["dynamic", "fixed"])
def test_the_balancer_prices_a_rows_images_by_their_grids(tmp_path, policy):
    tokenizer = image_tokenizer(tmp_path / "tokenizer.json")
    path = shard_images(tmp_path, tmp_path / "images", 12, policy)
    loader = ZephonLoader(image_config([{"path": path}], tokenizer, balance="attention"), rank=0, world_size=1)
    try:
        items = loader._next_items()
        balancer: Balancer = loader._balancer
        with_images = [item for item in items if len(item.sequence.images)]
        assert with_images
        for item in with_images:
            sequence = item.sequence
            text_only = balancer.cost_model.row_cost(sequence.segment_starts, len(sequence.input_ids),
                                                     sequence.padding)
            patches = sequence.images.grids.prod(axis=1)
            assert balancer.cost(item) == text_only + int((patches * patches + balancer.cost_model.linear * patches).sum())
    finally:
        loader.close()


def _real_run(config, tmp_path, world_size: int, steps: int) -> dict:
    config_path, out = tmp_path / "config.json", tmp_path / f"ranks_{world_size}.json"
    config_path.write_text(json.dumps(config.to_dict()))
    launch_ranks(world_size, "tests.loader.balance_worker", [str(config_path), str(out), str(steps)], timeout_s=300)
    return json.loads(out.read_text())


def _check_real_equals_simulated(config, tmp_path, world_size: int) -> None:
    real = _real_run(config, tmp_path, world_size, STEPS)["ranks"]
    digests, rows, batches = _simulated(config, world_size, STEPS)
    for rank in range(world_size):
        assert real[rank]["digests"] == digests[rank], f"rank {rank}: a micro-batch differs from the simulated rank's"
        assert real[rank]["rows"] == rows[rank], f"rank {rank}"
    merged = {index: value for part in real for index, value in part["rows"].items()}
    assert _global_lines(merged, config.global_batch_size, STEPS) == _reference_lines(config, STEPS)
    # the exchange moved rows with images between ranks, and rows of all three sources were trained
    moved_images = [int(i) for rank, part in enumerate(real) for i, value in part["rows"].items()
                    if int(i) % world_size != rank and len(value) > 16 * SEQ_LEN]
    assert moved_images, "no row with images changed rank: the test would not exercise the pixels' exchange"
    assert {int(s) for batch in batches for s in batch["source_ids"].tolist()} == {0, 1, 2}
    assert sum(sum(batch["chat_rejects"].values()) for batch in batches) > 0  # rejects travel with their rows
    assert all(seconds is not None and seconds > 0 for part in real for seconds in part["exchange_s"])


@pytest.mark.slow
def test_real_2_ranks_equal_simulated_ranks_with_images(mixed, tmp_path):
    _check_real_equals_simulated(mixed(balance="attention"), tmp_path, 2)


@pytest.mark.slow
def test_real_4_ranks_equal_simulated_ranks_with_images(mixed, tmp_path):
    _check_real_equals_simulated(mixed(balance="attention", micro_batch_size=1), tmp_path, 4)


def test_simulated_ranks_keep_the_global_batches_of_no_balance(mixed):
    config = mixed(balance="attention")
    reference = _reference_lines(config, STEPS)
    for world_size in (2, 4):
        results, _ = collect_fingerprints(config, world_size=world_size, end_step=STEPS)
        assert [" ".join(r.line().split()[:2]) for r in results] == reference, f"W={world_size}"
