"""``encode_conversations`` tokenizes its renders in parts on a helper thread while the rest
render (``loader.chat.encode.TOKENIZE_PART_CHARS``): the outcomes must not depend on the parts.

Compared with one batched call over every render (parts larger than the row group) and with
one conversation per call: ids, loss masks, mask sources, truncation flags and reject reasons
(rejects found before and after tokenizing), for byte-level BPE (byte ends from the ids) and a
tokenizer that takes offsets, with and without generation tags and length bounds.
"""

from __future__ import annotations

import threading

import pytest
from tokenizers import normalizers

import loader.chat.encode as encode_module
from loader.chat import ChatTemplate, ConversationRejected
from loader.chat.encode import encode_conversations
from loader.stages.tokenizer import TokenizerError
from tests.chat.chat_factory import SPECIAL_TOKENS, make_records, template_text, tokenizer

USER = {"role": "user", "content": "Hi"}
REJECTED_RECORDS = [
    {"messages": [{"content": "no role"}, {"role": "assistant", "content": "Hello"}]},  # missing_role
    {"messages": [{"role": "system", "content": "Be brief."}, USER]},  # empty_loss_mask (no assistant)
    {"messages": []},  # empty_conversation
    {"messages": [USER, {"role": "assistant", "content": "word " * 1200}]},  # too_long under max_tokens
]


def _records() -> list:
    generated = make_records(seed=41, count=36) + make_records(seed=42, count=4, text_parts=True)
    records = []
    for index, record in enumerate(generated):  # rejects spread among accepted ones, and at both ends
        if index % 9 == 0:
            records.append(REJECTED_RECORDS[(index // 9) % len(REJECTED_RECORDS)])
        records.append(record)
    return records + [REJECTED_RECORDS[1]]


def _offsets_tokenizer():
    # A normalizer takes the tokenizer out of the byte-level family: encode_batch with offsets.
    tok = tokenizer()
    tok.normalizer = normalizers.NFC()
    return tok


def _summary(outcomes) -> list:
    summary = []
    for outcome in outcomes:
        if isinstance(outcome, ConversationRejected):
            summary.append(("rejected", outcome.reason))
        else:
            summary.append((outcome.input_ids.dtype.str, outcome.input_ids.tolist(), outcome.loss_mask.dtype.str,
                            outcome.loss_mask.tolist(), outcome.mask_source, outcome.truncated))
    return summary


def _encode(monkeypatch, part_chars: int, records, template, tok, **options):
    monkeypatch.setattr(encode_module, "TOKENIZE_PART_CHARS", part_chars)
    calls = []
    real = encode_module.encode_renders

    def recording(tokenizer_, texts):
        calls.append((threading.current_thread().name, len(texts)))
        return real(tokenizer_, texts)

    monkeypatch.setattr(encode_module, "encode_renders", recording)
    return _summary(encode_conversations(records, template, tok, **options)), calls


@pytest.mark.parametrize("tags", (True, False), ids=("generation_tags", "prefix_difference"))
@pytest.mark.parametrize("make_tokenizer", (tokenizer, _offsets_tokenizer), ids=("byte_level", "offsets"))
@pytest.mark.parametrize("options", ({}, {"max_tokens": 1000}, {"max_tokens": 1000, "overflow": "truncate"},
                                     {"loss_on": "last", "from_json": True}))
def test_parts_on_the_helper_thread_give_the_single_call_outcomes(monkeypatch, tags, make_tokenizer, options):
    template = ChatTemplate.from_string(template_text("chatml_generation.jinja", generation_tags=tags),
                                        special_tokens=SPECIAL_TOKENS)
    tok, records = make_tokenizer(), _records()
    single, single_calls = _encode(monkeypatch, 10**12, records, template, tok, **options)
    assert len(single_calls) == 1  # one call over every render, on this thread
    reasons = {entry[1] for entry in single if entry[0] == "rejected"}
    assert {"missing_role", "empty_loss_mask", "empty_conversation"} <= reasons
    assert ("too_long" in reasons) == (options.get("max_tokens") is not None and "overflow" not in options)
    assert sum(entry[0] != "rejected" for entry in single) > 15
    for part_chars in (1, 5000):
        parts, calls = _encode(monkeypatch, part_chars, records, template, tok, **options)
        assert parts == single, part_chars
        helper = [count for name, count in calls if "-chat-tokenize" in name]  # the owner's helper thread
        assert len(helper) >= 2 and len(calls) == len(helper) + 1  # parts on the helper, the last one here
        assert sum(count for _, count in calls) == sum(entry[0] != "rejected" or entry[1] in
                                                       ("empty_loss_mask", "too_long") for entry in single)
    per_conversation = [_summary(encode_conversations([record], template, tok, **options))[0] for record in records]
    assert per_conversation == single


def test_a_tokenizer_error_on_the_helper_thread_reaches_the_caller(monkeypatch):
    template = ChatTemplate.from_string(template_text("chatml_generation.jinja"), special_tokens=SPECIAL_TOKENS)
    tok = tokenizer()
    tok.enable_truncation(16)
    monkeypatch.setattr(encode_module, "TOKENIZE_PART_CHARS", 1)
    with pytest.raises(TokenizerError, match="truncation"):
        encode_conversations(make_records(seed=43, count=5), template, tok)
