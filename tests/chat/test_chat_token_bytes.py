"""Token byte ends from ids (loader.chat.token_bytes) against the tokenizer's own offsets.

The byte-level path (``encode_batch_fast`` + byte lengths per id) must give exactly what
``encode_batch`` with offsets gives: the same ids, the same character offsets, the same loss
mask for any sorted or unsorted spans; tokenizers outside the family keep ``encode_batch``.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer

from loader.chat import ChatTemplate, parse_conversation
from loader.chat.masks import TokenizedChat, token_mask_from_spans, tokenize_rendered, tokenize_rendered_batch
from loader.chat.spans import assistant_spans
from loader.chat.token_bytes import byte_lengths, table_from_config
from tests.chat.chat_factory import DATE, SPECIAL_TOKENS, TEMPLATE_FILES, make_records, template_text, tokenizer

ODD_TEXTS = ["", " ", "\n\n\n", "a", "Zürich 東京 😀😀 e\u0301", "<|im_start|>user\n<|im_end|>",
             "<|endoftext|>x", "  leading and trailing  ", "\t\r\n mixed \u00a0 spaces \u2028",
             "🏳️‍🌈 family 👨‍👩‍👧", "x" * 3000]


def _renders(count: int = 40) -> list[str]:
    texts = list(ODD_TEXTS)
    records = make_records(seed=23, count=count) + make_records(seed=24, count=6, text_parts=True)
    for name in TEMPLATE_FILES:
        template = ChatTemplate.from_string(template_text(name), origin=name, special_tokens=SPECIAL_TOKENS,
                                            extra_variables={"date_string": DATE})
        for record in records:
            try:
                texts.append(assistant_spans(template, parse_conversation(record)).text)
            except Exception:  # the Llama-like template refuses text parts: not this test's subject
                pass
    return texts


@pytest.mark.parametrize("chat_markers", (False, True))
def test_byte_ends_give_the_ids_offsets_and_masks_of_encode_batch(chat_markers):
    ours = tokenizer(chat_markers=chat_markers)
    assert byte_lengths(ours) is not None  # the shipped tokenizer is byte-level BPE: the fast path
    texts = _renders()
    fast = tokenize_rendered_batch(ours, texts)
    assert sum(t.encoding is None for t in fast) == len(texts)  # no render fell back
    rng = random.Random(5)
    checked = 0
    for text, tokens, reference in zip(texts, fast, ours.encode_batch(texts, add_special_tokens=False)):
        assert tokens.input_ids.tolist() == reference.ids
        assert tokens.offsets == reference.offsets, text
        for _ in range(6):
            cuts = sorted(rng.sample(range(len(text) + 3), min(len(text) + 3, 2 * rng.randint(1, 5))))
            spans = list(zip(cuts[::2], cuts[1::2]))  # sorted and disjoint; some past the text's end
            if rng.random() < 0.3:
                spans.append((rng.randrange(len(text) + 1),) * 2)  # an empty span: may be out of order
            if rng.random() < 0.2:
                spans.reverse()  # unsorted: the loop, on offsets rebuilt from the byte ends
            expected = token_mask_from_spans(reference.offsets, spans).tolist()
            assert tokens.loss_mask(spans).tolist() == expected, (text, spans)
            checked += 1
    assert checked > 500


def test_a_render_whose_lengths_do_not_add_up_is_encoded_with_offsets(monkeypatch):
    ours = tokenizer()
    table = byte_lengths(ours).copy()
    broken = ours.encode("Hello", add_special_tokens=False).ids[0]
    table[broken] = -1  # an id of unsure length
    monkeypatch.setattr("loader.chat.masks.byte_lengths", lambda _: table)
    hello, other = tokenize_rendered_batch(ours, ["Hello there", "no such id here"])
    assert hello.encoding is not None and hello.offsets == ours.encode("Hello there").offsets
    assert other.encoding is None and other.input_ids.tolist() == ours.encode("no such id here").ids


def _config(**changes) -> dict:
    config = json.loads(tokenizer().to_str())
    for path, value in changes.items():
        *parents, key = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[key] = value
    return config


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "NFC"}},
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
    {"pre_tokenizer": {"type": "Whitespace"}},
    {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}},
    {"post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}},
    {"post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0], "trim_offsets": True,
                        "add_prefix_space": False}},
    {"model.byte_fallback": True},
])
def test_tokenizers_outside_the_family_keep_the_offsets(change):
    config = _config(**change)
    assert table_from_config(config) is None
    other = Tokenizer.from_str(json.dumps(config))
    (tokens,) = tokenize_rendered_batch(other, ["Zürich  said hi"])
    assert tokens.encoding is not None
    assert tokens.offsets == other.encode("Zürich  said hi", add_special_tokens=False).offsets


def test_vocabularies_with_subword_affixes_are_outside_the_family():
    assert table_from_config(_config(**{"model.continuing_subword_prefix": "##"})) is None
    assert table_from_config(_config(**{"model.end_of_word_suffix": "</w>"})) is None
    assert table_from_config(_config(**{"model.type": "WordPiece"})) is None


def test_a_llama3_style_pre_tokenizer_sequence_is_in_the_family_and_exact():
    sequence = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                                                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    config = _config(pre_tokenizer=sequence, post_processor=post)
    assert table_from_config(config) is not None
    other = Tokenizer.from_str(json.dumps(config))
    texts = _renders(count=12)
    for text, tokens in zip(texts, tokenize_rendered_batch(other, texts)):
        reference = other.encode(text, add_special_tokens=False)
        assert tokens.encoding is None and tokens.input_ids.tolist() == reference.ids
        assert tokens.offsets == reference.offsets


def test_the_table_follows_tokens_added_after_first_use():
    ours = tokenizer()
    before = byte_lengths(ours)
    ours.add_special_tokens(["<|im_start|>"])
    after = byte_lengths(ours)
    assert len(after) == len(before) + 1 and after[-1] == len("<|im_start|>")
    (tokens,) = tokenize_rendered_batch(ours, ["<|im_start|>user"])
    assert tokens.input_ids[0] == len(before) and tokens.offsets == ours.encode("<|im_start|>user").offsets


def test_tokenized_chat_from_the_offsets_path_is_unchanged():
    ours = tokenizer()
    tokens = tokenize_rendered(ours, "Hi there")
    assert isinstance(tokens, TokenizedChat) and tokens.encoding is not None
    assert tokens.loss_mask([(3, 8)]).tolist() == token_mask_from_spans(tokens.offsets, [(3, 8)]).tolist()
    assert np.array_equal(tokens.input_ids, np.array(ours.encode("Hi there").ids, dtype=np.int32))
