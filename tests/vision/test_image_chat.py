"""Chat with images: conversations whose messages hold image parts, sharded by ``zephon shard``
and encoded online by the loader (``loader.vision.chat``).

* The job: a missing, undecodable or unnamed image rejects the whole conversation with its
  reason (counted); records in = conversations in the lanes + rejected. ``--tokenizer`` and
  ``--image-field`` are refused with the fix.
* Masks: with each image's run of pads collapsed back to one, the ids equal ``transformers``'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on a Qwen2-VL-style template
  with generation tags, and so does the mask except on the image tokens (0 there, even in an
  assistant turn, where the reference has 1).
* Batches: per image, a run of pads as long as the policy's visual-token count, between its
  start and end tokens; ``pixel_values`` equal the policy's output for the image the text next
  to it names; labels -100 on image tokens and non-assistant text; online rejects counted.

The data is :mod:`tests.vision.image_chat_data`'s; mixed with its text source it is the
"image-chat-rejects+text-best_fit" row of the elastic matrix (tests/elastic/cases.py): the same
step lines on every topology and across resumes.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from beam_jobs import shard
from image_loader_data import DYNAMIC, image_config
from loader.chat import ChatTemplate
from loader.chat.block import OnlineChat
from loader.errors import ZephonError
from loader.io.manifest import read_manifest
from loader.pipeline import ZephonLoader
from loader.stages.tokenizer import load_tokenizer
from loader.vision.block import ImageOptions
from loader.vision.chat import ImageChatRejected, encode_image_conversations
from loader.vision.policies import policy_from_dict
from tests.vision.image_chat_data import SEQ_LEN, SIZES, TEMPLATE, image_of, job_args, online_rejects, write_image_chat

PIC = re.compile(r"pic (\d+)")
BAD = {"image_missing": 2, "image_undecodable": 1}  # what the job rejects below


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_image_chat(tmp_path_factory.mktemp("image_chat"))


def ids_of(tokenizer) -> tuple[int, int, int]:
    return tuple(tokenizer.token_to_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))


def test_the_job_rejects_conversations_with_bad_images_and_counts_every_record(data):
    manifest = read_manifest(data["chat"])
    rejected = {reason: count for reason, count in manifest.rejected.items() if count}
    assert rejected == BAD
    rows = sum(f.rows for f in manifest.files)
    assert rows + sum(rejected.values()) == len(data["good"]) + len(BAD) + 1 + len(online_rejects())
    assert manifest.online_chat and manifest.images is not None
    named = sum(1 for r in data["good"] + online_rejects() for m in r["messages"] if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image")
    assert manifest.images.images == named
    rejects = (data["root"] / "chat" / "_rejected").glob("*.jsonl")
    details = [json.loads(line)["detail"] for path in rejects for line in path.read_text().splitlines()]
    assert any("messages[0].content[0]" in d and "gone.png" in d for d in details)


@pytest.mark.parametrize("extra, message", [
    (("--tokenizer", "TOKENIZER"), "drop --tokenizer"),
    (("--image-field", "image"), "drop --image-field"),
])
def test_the_offline_path_and_an_image_field_are_refused_naming_the_fix(data, tmp_path, extra, message):
    extra = tuple(data["tokenizer"] if value == "TOKENIZER" else value for value in extra)
    with pytest.raises(ZephonError, match=message):
        shard.run(job_args(data["inputs"] / "chat.jsonl", tmp_path / "out", *extra))


def _options(tokenizer, seq_len: int = 4096) -> ImageOptions:
    start, pad, end = ids_of(tokenizer)
    return ImageOptions(policy_config=policy_from_dict(DYNAMIC).to_dict(), image_id=pad, start_id=start, end_id=end,
                        overflow="reject", max_images_per_sequence=None, seq_len=seq_len, packing="best_fit")


def _stored(record: dict) -> dict:
    """The record as the lane stores it: image parts reduced to {"type": "image"}, JSON round trip."""
    messages = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in record["messages"]]
    return json.loads(json.dumps({"messages": messages}))


def test_text_masks_equal_transformers_once_the_expansion_is_removed(data):
    transformers = pytest.importorskip("transformers")
    tokenizer = load_tokenizer(data["tokenizer"])
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    template = ChatTemplate.from_string(TEMPLATE.read_text(), origin="qwen2_vl")
    chat = OnlineChat(template, tokenizer, "all", None, "reject", "chat")
    options = _options(tokenizer)
    policy = policy_from_dict(DYNAMIC)
    start, pad, end = ids_of(tokenizer)
    records = [_stored(r) for r in data["good"]]
    counts = [[policy.visual_tokens(*SIZES[int(n) % len(SIZES)]) for n in PIC.findall(json.dumps(r))] for r in records]
    outcomes = encode_image_conversations(records, counts, chat, options)
    in_assistant = 0
    for record, outcome, tokens in zip(records, outcomes, counts):
        assert not isinstance(outcome, ImageChatRejected), outcome
        expected = reference.apply_chat_template(record["messages"], chat_template=TEMPLATE.read_text(),
                                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = outcome.input_ids, outcome.loss_mask
        pads = np.flatnonzero(ids == pad)
        assert len(pads) == sum(tokens)
        assert (outcome.image_index[pads] >= 0).all() and (outcome.image_index[ids != pad] == -1).all()
        first = np.ones(len(ids), bool)  # collapse each image's run of pads to its first
        first[1:] = ~((ids[1:] == pad) & (ids[:-1] == pad))
        assert ids[first].tolist() == list(expected["input_ids"])
        image_token = np.isin(ids[first], [start, pad, end])
        reference_mask = np.asarray(expected["assistant_masks"], np.uint8)
        assert (mask[first][~image_token] == reference_mask[~image_token]).all()
        assert not mask[np.isin(ids, [start, pad, end])].any()
        in_assistant += int(reference_mask[image_token].sum())
        assert mask.any()
    assert in_assistant >= 3 * 6  # the reference supervises the assistants' images; ours never does


def _named_image(tokenizer, ids: np.ndarray, after: int) -> int:
    match = PIC.search(tokenizer.decode(ids[after : after + 8].tolist()))
    assert match, tokenizer.decode(ids[after : after + 8].tolist())
    return int(match.group(1))


def test_batches_hold_each_images_pads_its_pixels_and_masked_labels(data):
    tokenizer = load_tokenizer(data["tokenizer"])
    start, pad, end = ids_of(tokenizer)
    policy = policy_from_dict(DYNAMIC)
    config = image_config([{"path": data["chat"], "name": "chat", "max_epochs": 1}], data["tokenizer"],
                          seq_len=SEQ_LEN)
    checked, rejects, seen = 0, {}, set()
    with ZephonLoader(config, output="numpy") as loader:
        for batch in loader:  # one epoch
                assert set(batch["chat_rejects"]) >= {"too_long", "image_placeholder_mismatch"}
                for reason, count in {**batch["chat_rejects"], **batch["image_rejects"]}.items():
                    rejects[reason] = rejects.get(reason, 0) + count
                ids, labels, mask = batch["input_ids"], batch["labels"], batch["loss_mask"]
                at = 0
                for k, (row, offset) in enumerate(zip(batch["image_sequence_index"], batch["image_token_offsets"])):
                    rows = int(np.prod(batch["image_grid_thw"][k]))
                    tokens = rows // 4
                    run = ids[row, offset : offset + tokens]
                    assert (run == pad).all() and ids[row, offset - 1] == start and ids[row, offset + tokens] == end
                    named = _named_image(tokenizer, ids[row], offset + tokens + 1)
                    expected = policy.process(image_of(named))  # Qwen2VLImageProcessor's layout
                    assert policy.visual_tokens(*SIZES[named % len(SIZES)]) == tokens
                    np.testing.assert_array_equal(batch["pixel_values"][at : at + rows], expected.values)
                    at += rows
                    checked += 1
                    seen.add(named)
                assert at == batch["pixel_values"].shape[0]
                image_tokens = np.isin(ids, [start, pad, end])
                assert (labels[image_tokens] == -100).all() and not mask[image_tokens].any()
                assert ((labels != -100) <= (mask == 1)).all()
                supervised = tokenizer.decode(ids[labels != -100].tolist())
                assert "What is this" not in supervised and "You describe" not in supervised
                if not batch["fill"].all():  # the epoch's last micro-batches may be fill rows only
                    assert "It is" in supervised
                assert int((ids == pad).sum()) == int(np.prod(batch["image_grid_thw"], axis=1).sum()) // 4
    # the literal pad and the overlong conversation, each counted once; every image checked
    assert {reason: n for reason, n in rejects.items() if n} == {"too_long": 1, "image_placeholder_mismatch": 1}
    images = sum(1 for r in data["good"] for m in r["messages"] if isinstance(m["content"], list)
                 for p in m["content"] if p["type"] == "image")
    assert len(seen) == checked and checked >= images - 6  # each once (the last, partial step is not produced)


def test_truncation_cuts_before_an_image_never_inside_it(data):
    from loader.vision.chat import ImageConversation, fit_conversation

    tokenizer = load_tokenizer(data["tokenizer"])
    options = _options(tokenizer)
    start, pad, end = ids_of(tokenizer)
    # text(3) [start pad x4 end] text(2): tokens 3..8 are the image
    ids = np.array([5, 6, 7, start, pad, pad, pad, pad, end, 9, 10], np.int32)
    mask = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1], np.uint8)
    index = np.array([-1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1], np.int16)
    conversation = ImageConversation(ids, mask, index)
    for bound in range(4, 9):  # a cut anywhere inside the image keeps the text before it
        cut = fit_conversation(conversation, max_tokens=bound, overflow="truncate", max_images=None, options=options)
        assert cut.input_ids.tolist() == [5, 6, 7], bound
    kept = fit_conversation(conversation, max_tokens=10, overflow="truncate", max_images=None, options=options)
    assert kept.input_ids.tolist() == ids[:10].tolist()
    with pytest.raises(ImageChatRejected, match="too_long"):
        fit_conversation(conversation, max_tokens=10, overflow="reject", max_images=None, options=options)
    with pytest.raises(ImageChatRejected, match="too_many_images_for_sequence"):
        fit_conversation(conversation, max_tokens=None, overflow="reject", max_images=0, options=options)


def test_null_keys_of_parquet_parts_do_not_render_as_images():
    from loader.vision.chat import image_parts, parse_image_conversation, render_image_conversation

    template = ChatTemplate.from_string(TEMPLATE.read_text(), origin="qwen2_vl")
    record = {"messages": [  # as a Parquet list<struct> gives it back: every part has every key
        {"role": "user", "content": [{"type": "image", "image": b"...", "text": None},
                                     {"type": "text", "text": "What?", "image": None}]},
        {"role": "assistant", "content": "A cat."}]}
    parsed = parse_image_conversation(record)
    assert [where for where, _ in image_parts(parsed)] == ["messages[0].content[0]"]
    rendered = render_image_conversation(parsed, template)
    assert rendered.text.count("<|image_pad|>") == 1 and "What?" in rendered.text
    assert rendered.conversation.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "What?"}]
