"""Finite epochs deliver every document exactly once (docs/guides/finite-epochs.md).

Generated documents carry unique markers (``Q00017Z``); one epoch with ``max_epochs = 1`` and
with ``exhaustion = "stop"`` is gathered over simulated ranks and every marker counted, for text
(pre-tokenized and tokenized online), chat (tokenized offline and online) and images, concat and
best fit, W = 1, 2, 4 with 0 and 2 workers, and after a resume mid-epoch on another W. Fill rows
carry no supervised token, the stream is bit-identical across topologies, and the datasets
sharded without ``--num-lanes`` load with the loader's defaults.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.io.manifest import read_manifest
from tests.chat.chat_factory import TEMPLATES_DIR
from tests.dataset_factory import write_dataset
from tests.finite.epoch_stream import marked_texts, marker, run_stream
from tests.vision.image_datasets import write_jsonl
from tests.vision.image_factory import image_bytes

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
TEMPLATE = str(TEMPLATES_DIR / "chatml_generation.jinja")
PLACEHOLDERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<image>")
DYNAMIC = {"kind": "dynamic", "min_pixels": 28 * 28, "max_pixels": 16 * 28 * 28}
TOPOLOGIES = ((1, 0), (2, 2), (4, 0))  # (world size, workers per rank): every W, both worker counts
ENDINGS = ({"max_epochs": 1}, {"exhaustion": "stop"})


def _records(count: int) -> list[dict]:
    texts = marked_texts(count, seed=5)
    return [{"id": f"c{k}", "messages": [{"role": "user", "content": text},
                                         {"role": "assistant", "content": f"answer {k % 7} " + "ok " * (k % 11)}]}
            for k, text in enumerate(texts)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("finite")
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    write_dataset(str(base / "pretokenized"), marked_texts(150, max_words=20), num_lanes=8, seed=3,
                  tokenizer=tokenizer, files_per_lane=2, row_group_rows=4)
    write_dataset(str(base / "text"), marked_texts(150, max_words=20), num_lanes=8, seed=3, files_per_lane=2,
                  row_group_rows=4)
    (base / "in").mkdir()
    with open(base / "in" / "docs.jsonl", "w") as fh:
        for k, text in enumerate(marked_texts(300)):
            fh.write(json.dumps({"id": f"d{k}", "text": text}) + "\n")
    write_jsonl(base / "in" / "chat.jsonl", _records(300))
    (base / "in" / "imgs").mkdir()
    images = []
    for k in range(100):
        (base / "in" / "imgs" / f"{k}.png").write_bytes(image_bytes(20 + k % 30, 28 + k % 17, "PNG", seed=k))
        images.append({"id": f"i{k}", "image": f"imgs/{k}.png", "text": f"{marker(k)} caption {'w ' * (k % 5)}"})
    write_jsonl(base / "in" / "images.jsonl", images)
    common = ["--runner=FnApiRunner", "--direct_running_mode=in_memory", "--id-field", "id"]
    chat = ["--messages-field", "messages", "--chat-template", TEMPLATE]
    shard.run(["--input", str(base / "in" / "docs.jsonl"), "--output", str(base / "docs"), *common])
    shard.run(["--input", str(base / "in" / "chat.jsonl"), "--output", str(base / "chat"), *chat,
               "--tokenizer", default_tokenizer_path(), *common])
    shard.run(["--input", str(base / "in" / "chat.jsonl"), "--output", str(base / "chat_online"), *chat, *common])
    shard.run(["--input", str(base / "in" / "images.jsonl"), "--output", str(base / "images"), "--image-field",
               "image", "--image-policy", json.dumps(DYNAMIC), *common])
    image_tokenizer = Tokenizer.from_file(default_tokenizer_path())
    image_tokenizer.add_special_tokens([AddedToken(t, special=True) for t in PLACEHOLDERS])
    image_tokenizer.save(str(base / "image_tokenizer.json"))
    return {"base": base, "tokenizer": tokenizer, "image_tokenizer": image_tokenizer,
            "image_tokenizer_path": str(base / "image_tokenizer.json")}


def _config(path: str, ending: dict, packing: str, tokenizer: str = default_tokenizer_path(),
            **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, **ending}], seq_len=64, global_batch_size=16, micro_batch_size=2,
                  seed=11, tokenizer=tokenizer, packing=packing, best_fit_open_bins=4, prefetch=2,
                  worker_timeout_s=60.0)
    fields.update(overrides)
    return LoaderConfig(**fields)


def _check_exactly_once(stream, tokenizer, num_lanes: int, documents: int) -> None:
    found = stream.markers(tokenizer, num_lanes)
    assert sorted(found) == list(range(documents)), f"missing {sorted(set(range(documents)) - set(found))[:10]}"
    assert set(found.values()) == {1}, f"delivered twice: {[k for k, n in found.items() if n > 1][:10]}"
    for index in stream.fill_rows():  # no supervised token, nothing but padding
        _, labels, _, mask = stream.rows[index]
        assert (np.frombuffer(labels, np.int64) == -100).all()
        if mask is not None:
            assert not np.frombuffer(mask, np.uint8).any()
    indices = sorted(stream.rows)
    assert indices == list(range(len(indices))) and len(indices) % 16 == 0, "whole steps, every global index"


def _across_topologies(config: LoaderConfig, tokenizer, num_lanes: int, documents: int) -> str:
    digests = set()
    for world_size, workers in TOPOLOGIES:
        stream = run_stream(config.replace(num_workers=workers), world_size=world_size)
        _check_exactly_once(stream, tokenizer, num_lanes, documents)
        digests.add(stream.digest())
    assert len(digests) == 1, "the stream differs across topologies"
    return digests.pop()


@pytest.mark.parametrize("kind, packing, ending", [
    ("pretokenized", "concat", ENDINGS[0]), ("pretokenized", "best_fit", ENDINGS[1]),
    ("text", "concat", ENDINGS[1]), ("text", "best_fit", ENDINGS[0]),
], ids=("pretokenized-concat-max_epochs", "pretokenized-best_fit-stop", "text-concat-stop", "text-best_fit-max_epochs"))
def test_text_delivers_every_document_once_on_every_topology(data, kind, packing, ending):
    config = _config(str(data["base"] / kind), ending, packing)
    _across_topologies(config, data["tokenizer"], 8, 150)


@pytest.mark.parametrize("kind, packing", [
    ("chat", "concat"), ("chat", "best_fit"), ("chat_online", "best_fit"),
    pytest.param("chat_online", "concat", marks=pytest.mark.slow),
])
def test_chat_delivers_every_conversation_once_on_every_topology(data, kind, packing):
    path = str(data["base"] / kind)
    manifest = read_manifest(path)
    assert manifest.documents == 300 and manifest.num_lanes in (8, 16, 32, 64)
    config = _config(path, {"max_epochs": 1}, packing, seq_len=128)
    _across_topologies(config, data["tokenizer"], manifest.num_lanes, 300)


@pytest.mark.parametrize("ending", ENDINGS, ids=("max_epochs", "stop"))
def test_images_deliver_every_document_once_on_every_topology(data, ending):
    path = str(data["base"] / "images")
    manifest = read_manifest(path)
    assert manifest.documents == 100 and manifest.num_lanes in (8, 16, 32, 64)
    config = _config(path, ending, "best_fit", tokenizer=data["image_tokenizer_path"], seq_len=96,
                     global_batch_size=8, images={"policy": DYNAMIC})
    digests = set()
    for world_size, workers in ((1, 0), (2, 2), (4, 0)):
        stream = run_stream(config.replace(num_workers=workers), world_size=world_size)
        found = stream.markers(data["image_tokenizer"], manifest.num_lanes)
        assert sorted(found) == list(range(100)) and set(found.values()) == {1}
        digests.add(stream.digest())
    assert len(digests) == 1


@pytest.mark.parametrize("packing", ("concat", "best_fit"))
def test_a_resume_mid_epoch_on_another_world_size_delivers_the_rest_once(data, packing):
    config = _config(str(data["base"] / "pretokenized"), {"max_epochs": 1}, packing)
    full = run_stream(config)
    fills = sorted(full.fill_rows())
    tail_step = fills[0] // 16  # a step where lanes already ran out: their state says so
    for cut, (world_size, workers) in ((2, (2, 0)), (tail_step + 1, (4, 2))):
        saved = run_stream(config, world_size=1, save_at=cut).state
        rest = run_stream(config.replace(num_workers=workers), world_size=world_size, load_state=saved)
        expected = {i: row for i, row in full.rows.items() if i >= cut * 16}
        assert rest.rows == expected, f"resumed at step {cut} on W={world_size}: the rest of the epoch differs"


def test_the_default_dataset_loads_with_the_loader_defaults(data):
    """300 documents sharded without --num-lanes: every lane filled, W 1/2/4/8 divide L."""
    path = str(data["base"] / "docs")
    manifest = read_manifest(path)
    assert manifest.num_lanes in (8, 16, 32) and manifest.documents == 300
    config = LoaderConfig(datasets=[{"path": path, "max_epochs": 1}], seq_len=64, global_batch_size=16,
                          micro_batch_size=2, seed=0, tokenizer=default_tokenizer_path())
    digests = set()
    for world_size in (1, 2, 4, 8):
        stream = run_stream(config, world_size=world_size)
        _check_exactly_once(stream, data["tokenizer"], manifest.num_lanes, 300)
        digests.add(stream.digest())
    assert len(digests) == 1


@pytest.mark.parametrize("mixing_unit", ("sequence", "token"))
def test_a_mix_of_finite_sources_delivers_both_once(data, tmp_path, mixing_unit):
    """Two sources, each one epoch: where one is done in a lane the other takes its share, and
    once both are, the lane gives fill rows; every document of both is delivered once."""
    other = [text.replace("Q00", "Q01", 1) for text in marked_texts(90, seed=9, max_words=30)]  # markers 1000..1089
    write_dataset(str(tmp_path / "other"), other, num_lanes=8, seed=3, tokenizer=data["tokenizer"],
                  source_name="other", keys=[f"o-{k}" for k in range(90)], files_per_lane=1, row_group_rows=4)
    config = LoaderConfig(
        datasets=[{"path": str(data["base"] / "pretokenized"), "max_epochs": 1, "weight": 2},
                  {"path": str(tmp_path / "other"), "exhaustion": "stop"}],
        seq_len=64, global_batch_size=16, micro_batch_size=2, seed=11, tokenizer=default_tokenizer_path(),
        packing="best_fit", best_fit_open_bins=4, mixing_unit=mixing_unit, prefetch=2, worker_timeout_s=60.0)
    digests = set()
    for world_size, workers in ((1, 0), (2, 2)):
        stream = run_stream(config.replace(num_workers=workers), world_size=world_size)
        found = stream.markers(data["tokenizer"], 8)
        assert sorted(found) == list(range(150)) + list(range(1000, 1090)) and set(found.values()) == {1}
        assert stream.fill_rows()
        digests.add(stream.digest())
    assert len(digests) == 1
