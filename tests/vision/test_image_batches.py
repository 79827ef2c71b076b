"""Image datasets as training batches: placeholders, masks, pixels, packing caps and overflow.

One dataset of generated images (pairs, two-image captions, interleaved documents) is sharded
with the dynamic policy's counts, one without counts; every test reads them through
``ZephonLoader``. Each document names its images in its text (``pic 17``), so the pixels of
every image of a batch are compared with the policy's own output for the stored bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from image_loader_data import (DYNAMIC, FIXED, PIC, image_config, image_of, image_tokenizer, shard_images)
from loader.config import ConfigError
from loader.pipeline import ZephonLoader
from loader.stages.tokenizer import TokenizerError, load_tokenizer
from loader.vision.policies import policy_from_dict

DOCUMENTS = 40


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_batches")
    return {
        "counted": shard_images(root, root / "counted", DOCUMENTS, DYNAMIC),
        "uncounted": shard_images(root, root / "uncounted", DOCUMENTS, None),
        "tokenizer": image_tokenizer(root / "tokenizer.json"),
    }


def batches(config, count: int, **loader_args) -> list[dict]:
    with ZephonLoader(config, output="numpy", **loader_args) as loader:
        return [next(loader) for _ in range(count)]


def images_of_batch(batch: dict) -> list[tuple[int, int, int, np.ndarray]]:
    """``(row, offset, tokens, pixels)`` per image, pixels cut from ``pixel_values`` by the grids."""
    grids = batch["image_grid_thw"]
    out, at = [], 0
    for k, (row, offset) in enumerate(zip(batch["image_sequence_index"], batch["image_token_offsets"])):
        if batch["pixel_values"].ndim == 2:  # dynamic: t * h * w patch rows, 4 patches per token
            rows = int(np.prod(grids[k]))
            out.append((int(row), int(offset), rows // 4, batch["pixel_values"][at : at + rows]))
            at += rows
        else:
            out.append((int(row), int(offset), int(grids[k][1] * grids[k][2]), batch["pixel_values"][k]))
    return out


def named_images(tokenizer, ids: np.ndarray, end: int) -> list[int]:
    """The images a document names in its text from ``end`` (the token after an image) to its EOS."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    stop = end + int(np.argmax(ids[end:] == eos)) if (ids[end:] == eos).any() else len(ids)
    return [int(m) for m in PIC.findall(tokenizer.decode(ids[end:stop].tolist(), skip_special_tokens=False))]


def test_batches_hold_placeholders_masked_labels_and_the_policys_pixels(data, monkeypatch):
    import loader.vision.resolve as resolve

    epochs = set()  # of the refs resolved: the second epoch replays rows in another order
    decode = resolve.decode_ref
    monkeypatch.setattr(resolve, "decode_ref", lambda ref: epochs.add(decode(ref)[0]) or decode(ref))
    config = image_config([{"path": data["counted"]}], data["tokenizer"])
    tokenizer = load_tokenizer(data["tokenizer"])
    start, pad, end = (tokenizer.token_to_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    policy = policy_from_dict(DYNAMIC)
    checked = 0
    for batch in batches(config, 20):
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["loss_mask"]
        images = images_of_batch(batch)
        assert batch["pixel_values"].shape[0] == int(np.prod(batch["image_grid_thw"], axis=1).sum())
        for row in range(len(ids)):
            mine = [image for image in images if image[0] == row]
            assert int((ids[row] == pad).sum()) == sum(tokens for _, _, tokens, _ in mine)
            assert int((ids[row] == start).sum()) == int((ids[row] == end).sum()) == len(mine)
            placeholder = np.isin(ids[row], [start, pad, end])
            assert (labels[row][placeholder] == -100).all() and (mask[row][placeholder] == 0).all()
        for row, offset, tokens, pixels in images:
            assert (ids[row][offset : offset + tokens] == pad).all()
            assert ids[row][offset - 1] == start and ids[row][offset + tokens] == end
            named = named_images(tokenizer, ids[row], offset + tokens + 1)
            if len(named) == 1:  # a pair, or the second image of an interleaved document
                expected = policy.process(image_of(named[0]))
                assert pixels.shape == expected.values.shape
                np.testing.assert_array_equal(pixels, expected.values)
                checked += 1
    assert checked >= 30 and {0, 1, 2} <= epochs


def test_fixed_policy_batches_are_stacked_images_with_llava_tokens(data, tmp_path):
    from image_loader_data import shard_images as shard_again

    dataset = shard_again(tmp_path, tmp_path / "fixed", 12, FIXED)
    config = image_config([{"path": dataset}], data["tokenizer"])
    tokenizer = load_tokenizer(data["tokenizer"])
    image_id = tokenizer.token_to_id("<image>")
    policy = policy_from_dict(FIXED)
    batch = batches(config, 1)[0]
    assert batch["pixel_values"].shape[1:] == (3, 56, 56)
    assert len(batch["pixel_values"]) == len(batch["image_grid_thw"]) > 0
    assert (batch["image_grid_thw"] == [1, 4, 4]).all()
    ids = batch["input_ids"]
    assert int((ids == image_id).sum()) == 16 * len(batch["pixel_values"])  # no start/end tokens
    for k, (row, offset) in enumerate(zip(batch["image_sequence_index"], batch["image_token_offsets"])):
        named = named_images(tokenizer, ids[row], int(offset) + 16)
        if len(named) == 1:
            np.testing.assert_array_equal(batch["pixel_values"][k], policy.process(image_of(named[0])).values)


def test_counts_computed_online_equal_the_offline_ones(data):
    """A dataset sharded without --image-policy gives the same batches with the policy configured
    (same source name: epoch orders are seeded by it)."""
    offline = image_config([{"path": data["counted"], "name": "pictures"}], data["tokenizer"])
    online = offline.replace(datasets=({"path": data["uncounted"], "name": "pictures"},), images={"policy": DYNAMIC})
    for a, b in zip(batches(offline, 3), batches(online, 3)):
        for key in ("input_ids", "labels", "pixel_values", "image_grid_thw", "image_token_offsets"):
            np.testing.assert_array_equal(a[key], b[key])


def test_max_images_per_sequence_caps_every_packed_sequence(data):
    config = image_config([{"path": data["counted"]}], data["tokenizer"], seq_len=160,
                          images={"max_images_per_sequence": 2})
    uncapped = batches(config.replace(images=None), 4)
    capped = batches(config, 4)
    most = max(int(np.bincount(b["image_sequence_index"], minlength=2).max()) for b in uncapped)
    assert most > 2  # the cap binds on this data
    for batch in capped:
        assert np.bincount(batch["image_sequence_index"], minlength=2).max() <= 2


def lane_blocks(config) -> list:
    """Every block of epoch 0 of every lane, encoded (through the loader's own lane spec)."""
    from loader.stages.producer import build_lanes

    with ZephonLoader(config, output="numpy") as loader:
        lanes = build_lanes(loader.spec, list(range(loader.num_lanes)), {})
    blocks = []
    for lane in lanes.values():
        (stream,) = lane.source_streams()
        for index in range(len(stream.blocks_of_epoch(0))):
            block = stream._load_block(0, index)
            block.ensure(0)
            blocks.append(block)
        lane.close()
    return blocks


@pytest.mark.parametrize("overflow", ("reject", "truncate"))
def test_a_document_longer_than_seq_len_is_rejected_or_cut_before_an_image(data, overflow):
    seq_len = 40  # a two-image document (up to 2 x 18 placeholders + text) does not fit
    config = image_config([{"path": data["counted"]}], data["tokenizer"], seq_len=seq_len,
                          images={"overflow": overflow})
    tokenizer = load_tokenizer(data["tokenizer"])
    start, end = tokenizer.token_to_id("<|vision_start|>"), tokenizer.token_to_id("<|vision_end|>")
    rows, rejected = 0, 0
    for block in lane_blocks(config):
        rejected += block.reject_counts.get("image_document_too_long", 0)
        rows += len(block.doc_starts) - 1
        for lo, hi in zip(block.doc_starts[:-1], block.doc_starts[1:]):
            document = block.tokens[lo:hi]
            assert len(document) <= seq_len  # BOS/EOS included: it fits one sequence, unsplit
            assert int((document == start).sum()) == int((document == end).sum())  # images whole
    if overflow == "reject":
        assert rejected > 0 and rows + rejected == DOCUMENTS
    else:
        assert rows + rejected == DOCUMENTS and rows > DOCUMENTS - 3  # cut, not dropped (unless nothing fits)
    for batch in batches(config, 4):  # and so every image of a batch is whole
        ids = batch["input_ids"]
        for row, offset, tokens, _ in images_of_batch(batch):
            assert ids[row][offset - 1] == start and ids[row][offset + tokens] == end
    # Each block's rejects are reported once, with the sequence that enters it: per step, the
    # same counts whatever the world size (here W=1 vs W=2 with another micro-batch size).
    per_step = {}
    for world_size, micro in ((1, 2), (2, 1)):
        counts = [0] * 6
        for rank in range(world_size):
            with ZephonLoader(config.replace(micro_batch_size=micro), rank=rank, world_size=world_size,
                              output="numpy") as loader:
                for _ in range(6 * 8 // world_size // micro):
                    batch = next(loader)
                    assert set(batch["image_rejects"]) == {"image_document_too_long", "too_many_images_for_sequence"}
                    counts[batch["step"]] += batch["image_rejects"]["image_document_too_long"]
        per_step[world_size] = counts
    assert per_step[1] == per_step[2]
    assert (sum(per_step[1]) > 0) == (overflow == "reject")


def test_image_configs_that_cannot_work_are_refused_naming_the_fix(data, tmp_path):
    base = image_config([{"path": data["counted"]}], data["tokenizer"])
    with pytest.raises(ConfigError, match='packing must be "best_fit"'):
        ZephonLoader(base.replace(packing="concat"))
    with pytest.raises(ConfigError, match="max_pixels: 12544 in the manifest, 1003520 given"):
        ZephonLoader(base.replace(images={"policy": "dynamic"}))
    with pytest.raises(ConfigError, match="images.policy is not set"):
        ZephonLoader(base.replace(datasets=({"path": data["uncounted"]},)))
    with pytest.raises(TokenizerError, match="images.image_token='<nope>' is not in the tokenizer"):
        ZephonLoader(base.replace(images={"image_token": "<nope>"}))
    with pytest.raises(ConfigError, match="images.overflow must be one of"):
        base.replace(images={"overflow": "drop"})
    from loader.samples import default_tokenizer_path

    with pytest.raises(TokenizerError, match="images.image_start_token='<|vision_start|>'"):
        ZephonLoader(base.replace(tokenizer=default_tokenizer_path()))


def test_the_fingerprint_covers_pixels_and_text_configs_keep_theirs(data):
    from loader.commands.fingerprints import collect_fingerprints

    config = image_config([{"path": data["uncounted"]}], data["tokenizer"], images={"policy": DYNAMIC})
    other = config.replace(images={"policy": dict(DYNAMIC, resample="bilinear")})  # same tokens, other pixels
    first, _ = collect_fingerprints(config, end_step=2)
    second, _ = collect_fingerprints(other, end_step=2)
    a, b = batches(config, 1)[0], batches(other, 1)[0]
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert not np.array_equal(a["pixel_values"], b["pixel_values"])
    assert [r.sha256 for r in first] != [r.sha256 for r in second]


@pytest.mark.timeout(90)
def test_worker_batches_carry_the_same_pixels_through_shared_memory(data, monkeypatch):
    import loader.workers.messages as messages

    shipped = []
    unpack = messages.unpack_images
    monkeypatch.setattr(messages, "unpack_images", lambda *a: shipped.append(1) or unpack(*a))
    config = image_config([{"path": data["counted"]}], data["tokenizer"])
    expected = batches(config, 6)
    with ZephonLoader(config.replace(num_workers=2), output="numpy") as loader:
        loader.wait_for_workers(60)  # the worker path, not the warm start
        got = [next(loader) for _ in range(6)]
    assert shipped, "no image sequence came through a worker's slot"
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key, value in a.items():
            np.testing.assert_array_equal(value, b[key], err_msg=key)
