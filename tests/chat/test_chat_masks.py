"""Loss masks equal an independent reference: ``transformers``' ``apply_chat_template``.

The reference is ``PreTrainedTokenizerFast(tokenizer_object=<shipped tokenizer.json>)`` with
``return_assistant_tokens_mask=True`` on templates with generation tags, over seeded,
generated multi-turn conversations (system, user, assistant, tool turns; unicode, emoji,
empty and long turns; tools). Zephon never calls ``transformers``; only the tests do.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.chat import ChatTemplate, ConversationRejected, encode_conversation, parse_conversation
from loader.chat.masks import token_mask_from_spans, tokenize_rendered
from loader.chat.spans import assistant_spans
from tests.chat.chat_factory import DATE, SPECIAL_TOKENS, TEMPLATE_FILES, make_records, template_text, tokenizer

transformers = pytest.importorskip("transformers")

# Text-part lists are few: the Llama-like template refuses them (exercising raise_exception).
RECORDS = make_records(seed=17, count=40) + make_records(seed=18, count=8, text_parts=True)


def _reference_tokenizer(chat_markers: bool):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer(chat_markers=chat_markers), **SPECIAL_TOKENS)


def _template(name: str, *, generation_tags: bool = True) -> ChatTemplate:
    return ChatTemplate.from_string(
        template_text(name, generation_tags=generation_tags),
        origin=name,
        special_tokens=SPECIAL_TOKENS,
        extra_variables={"date_string": DATE},
    )


def _reference(reference_tokenizer, source: str, record: dict):
    """(input_ids, assistant_masks) from transformers, or the exception it raised."""
    try:
        out = reference_tokenizer.apply_chat_template(
            record["messages"],
            tools=record.get("tools"),
            chat_template=source,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            date_string=DATE,
        )
    except Exception as exc:  # the templates' raise_exception on list content, for one
        return exc
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_the_generated_conversations_cover_the_cases_the_reference_must_see():
    messages = [message for record in RECORDS for message in record["messages"]]
    roles = {message["role"] for message in messages}
    assert roles == {"system", "user", "assistant", "tool"}
    contents = [message.get("content") for message in messages]
    assert "" in contents and any(isinstance(c, list) for c in contents)
    assert any(isinstance(c, str) and len(c) > 600 for c in contents)
    assert any(isinstance(c, str) and "👨‍👩‍👧" in c for c in contents)
    assert any("tool_calls" in message for message in messages)
    assert sum("tools" in record for record in RECORDS) >= 5


@pytest.mark.parametrize("chat_markers", [False, True], ids=["markers-as-text", "markers-as-special-tokens"])
@pytest.mark.parametrize("template_file", TEMPLATE_FILES)
def test_masks_and_ids_equal_transformers_return_assistant_tokens_mask(template_file, chat_markers):
    reference_tokenizer = _reference_tokenizer(chat_markers)
    ours = tokenizer(chat_markers=chat_markers)
    template = _template(template_file)
    source = template_text(template_file)
    compared = supervised = template_errors = 0
    for index, record in enumerate(RECORDS):
        expected = _reference(reference_tokenizer, source, record)
        if isinstance(expected, Exception):
            with pytest.raises(ConversationRejected) as rejected:
                encode_conversation(record, template, ours)
            assert rejected.value.reason == "template_error", index
            template_errors += 1
            continue
        expected_ids, expected_mask = expected
        # The raw mask, before any guard: render, tokenize, map spans to tokens.
        spans = assistant_spans(template, parse_conversation(record))
        tokens = tokenize_rendered(ours, spans.text)
        assert tokens.input_ids.tolist() == expected_ids, index
        assert token_mask_from_spans(tokens.offsets, spans.spans).tolist() == expected_mask, index
        # The entry point: the same arrays, or a guard that the reference mask explains.
        if not any(expected_mask):
            with pytest.raises(ConversationRejected, match="empty_loss_mask"):
                encode_conversation(record, template, ours)
            continue
        encoded = encode_conversation(record, template, ours)
        assert encoded.input_ids.dtype == np.int32 and encoded.loss_mask.dtype == np.uint8
        assert encoded.input_ids.tolist() == expected_ids, index
        assert encoded.loss_mask.tolist() == expected_mask, index
        assert encoded.mask_source == "generation_tags"
        compared += 1
        supervised += encoded.supervised_tokens
    assert compared >= 30 and supervised > 1000  # not a vacuous pass
    if template_file.startswith("llama3"):
        assert template_errors > 0  # its raise_exception on text-part lists was exercised


@pytest.mark.parametrize("template_file", TEMPLATE_FILES)
def test_loss_on_last_keeps_the_reference_mask_after_the_last_assistant_prompt(template_file):
    reference_tokenizer = _reference_tokenizer(chat_markers=True)
    ours = tokenizer(chat_markers=True)
    template = _template(template_file)
    source = template_text(template_file)
    checked = 0
    for index, record in enumerate(RECORDS):
        expected = _reference(reference_tokenizer, source, record)
        if isinstance(expected, Exception) or not any(expected[1]):
            continue
        last = max(i for i, message in enumerate(record["messages"]) if message["role"] == "assistant")
        prompt = reference_tokenizer.apply_chat_template(
            record["messages"][:last], tools=record.get("tools"), chat_template=source, tokenize=False,
            add_generation_prompt=True, date_string=DATE,
        )
        offsets = reference_tokenizer(
            reference_tokenizer.apply_chat_template(
                record["messages"], tools=record.get("tools"), chat_template=source, tokenize=False, date_string=DATE
            ),
            add_special_tokens=False,
        ).encodings[0].offsets
        expected_last = [int(bit and end > len(prompt)) for bit, (_, end) in zip(expected[1], offsets)]
        encoded = encode_conversation(record, template, ours, loss_on="last")
        assert encoded.loss_mask.tolist() == expected_last, index
        assert encoded.input_ids.tolist() == expected[0]
        checked += 1
        if sum(m["role"] == "assistant" for m in record["messages"]) > 1:
            assert encoded.supervised_tokens < sum(expected[1]), index
    assert checked >= 30


def test_span_to_token_rule_at_the_edges():
    # Tokens: "ab" "c" "" (zero width, e.g. an added token) "de" "f"; spans cover "b" and "de".
    offsets = [(0, 2), (2, 3), (3, 3), (3, 5), (5, 6)]
    assert token_mask_from_spans(offsets, [(1, 2), (3, 5)]).tolist() == [1, 0, 0, 1, 0]  # straddling "ab" counts
    assert token_mask_from_spans(offsets, [(3, 3)]).tolist() == [0, 0, 0, 0, 0]  # an empty span marks nothing
    assert token_mask_from_spans(offsets, [(2, 6)]).tolist() == [0, 1, 1, 1, 1]  # zero width inside: supervised
    assert token_mask_from_spans(offsets, []).tolist() == [0] * 5
    assert token_mask_from_spans([], [(0, 4)]).tolist() == []
    mask = token_mask_from_spans(offsets, [(0, 6)])
    assert mask.dtype == np.uint8 and mask.flags.writeable and mask.tolist() == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("chat_markers", (False, True))
def test_the_mask_from_offset_lookups_equals_the_loop_over_all_offsets(chat_markers):
    """``TokenizedChat.loss_mask`` looks the span edges up in the encoding instead of reading
    every token's offsets; over real renders and random sorted, disjoint spans (empty ones and
    edges inside multi-byte characters included) it marks what the reference loop marks."""
    import random

    from loader.chat.masks import token_mask_from_encoding

    ours = tokenizer(chat_markers=chat_markers)
    template = _template("chatml_generation.jinja")
    rng = random.Random(3)
    checked = 0
    for record in RECORDS[:60]:
        text = assistant_spans(template, parse_conversation(record)).text
        tokens = tokenize_rendered(ours, text)
        for _ in range(5):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 2 * rng.randint(1, 6))))
            spans = list(zip(cuts[::2], cuts[1::2]))
            if rng.random() < 0.2:
                at = rng.randrange(len(text) + 1)
                spans = sorted(spans + [(at, at)])
                if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                    continue
            expected = token_mask_from_spans(tokens.offsets, spans).tolist()
            assert token_mask_from_encoding(tokens.encoding, len(tokens.input_ids), spans).tolist() == expected
            assert tokens.loss_mask(spans).tolist() == expected
            checked += 1
    assert checked > 200
