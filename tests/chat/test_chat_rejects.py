"""Every reject reason and guard, the options, and what is accepted.

The table below holds one or more records per reason in ``REJECT_REASONS``; a test checks the
table covers the tuple, so a new reason cannot land without a case.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.chat import (
    REJECT_REASONS,
    ChatOptionError,
    ChatTemplate,
    ChatTemplateError,
    ConversationRejected,
    encode_conversation,
)
from loader.errors import ZephonError
from loader.stages.tokenizer import TokenizerError
from tests.chat.chat_factory import DATE, SPECIAL_TOKENS, template_text, tokenizer

TOKENIZER = tokenizer(chat_markers=True)
CHATML = ChatTemplate.from_string(template_text("chatml_generation.jinja"), special_tokens=SPECIAL_TOKENS)
CHATML_PLAIN = ChatTemplate.from_string(template_text("chatml_generation.jinja", generation_tags=False))
LLAMA = ChatTemplate.from_string(
    template_text("llama3_generation.jinja"), special_tokens=SPECIAL_TOKENS, extra_variables={"date_string": DATE}
)
TAGS_EVERYTHING = ChatTemplate.from_string(
    "{% generation %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% endgeneration %}"
)
EMPTY_TAGS = ChatTemplate.from_string(
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)

USER = {"role": "user", "content": "Hi"}
ASSISTANT = {"role": "assistant", "content": "Hello"}


def _record(*messages, **fields):
    return {"messages": list(messages), **fields}


CASES = [
    ("missing_messages", {"text": "no messages here"}, CHATML, {}),
    ("missing_messages", ["not", "a", "mapping"], CHATML, {}),
    ("missing_messages", {"messages": "Hi"}, CHATML, {}),
    ("missing_messages", {"conversation": [USER, ASSISTANT]}, CHATML, {}),  # default field name
    ("empty_conversation", _record(), CHATML, {}),
    ("not_a_message", _record(USER, "Hello"), CHATML, {}),
    ("missing_role", _record({"content": "Hi"}, ASSISTANT), CHATML, {}),
    ("missing_role", _record({"role": None, "content": "Hi"}, ASSISTANT), CHATML, {}),
    ("unknown_role", _record({"role": "developer", "content": "Hi"}, ASSISTANT), CHATML, {}),
    ("unknown_role", _record({"role": 3, "content": "Hi"}, ASSISTANT), CHATML, {}),
    ("missing_content", _record({"role": "user"}, ASSISTANT), CHATML, {}),
    ("missing_content", _record(USER, {"role": "assistant", "content": None}), CHATML, {}),
    ("non_string_content", _record({"role": "user", "content": 5}, ASSISTANT), CHATML, {}),
    ("non_string_content", _record(USER, {"role": "assistant", "content": {"text": "Hello"}}), CHATML, {}),
    ("unsupported_content_part",
     _record({"role": "user", "content": [{"type": "image", "url": "x.png"}]}, ASSISTANT), CHATML, {}),
    ("unsupported_content_part", _record({"role": "user", "content": ["plain string part"]}, ASSISTANT), CHATML, {}),
    ("bad_tool_calls", _record(USER, {"role": "assistant", "content": "", "tool_calls": "f()"}), CHATML, {}),
    ("bad_tool_calls", _record(USER, {"role": "assistant", "content": "", "tool_calls": [1]}), CHATML, {}),
    ("bad_name", _record(USER, ASSISTANT, {"role": "tool", "content": "42", "name": 7}), CHATML, {}),
    ("bad_tools", _record(USER, ASSISTANT, tools="get_weather"), CHATML, {}),
    ("bad_tools", _record(USER, ASSISTANT, tools=[1]), CHATML, {}),
    ("template_error", _record({"role": "user", "content": [{"type": "text", "text": "Hi"}]}, ASSISTANT), LLAMA, {}),
    ("template_error", _record(USER, ASSISTANT), ChatTemplate.from_string("{{ raise_exception('no ' + 'way') }}"), {}),
    ("template_error", _record(USER, ASSISTANT), ChatTemplate.from_string("{{ messages[0].content + 1 }}"), {}),
    ("undecidable_mask", _record(USER, ASSISTANT, USER, ASSISTANT),
     ChatTemplate.from_string(template_text("chatml_generation.jinja", generation_tags=False)
                              + "{% if not add_generation_prompt %}<|endoftext|>{% endif %}"), {}),
    ("empty_loss_mask", _record({"role": "system", "content": "Be brief."}, USER), CHATML, {}),
    ("empty_loss_mask", _record(USER, ASSISTANT), EMPTY_TAGS, {}),
    ("empty_loss_mask", _record(USER, ASSISTANT), CHATML, {"max_tokens": 3, "overflow": "truncate"}),
    ("full_loss_mask", _record(USER, ASSISTANT), TAGS_EVERYTHING, {}),
    ("too_long", _record(USER, ASSISTANT), CHATML, {"max_tokens": 5}),
]


def test_the_table_exercises_every_reject_reason():
    assert {reason for reason, *_ in CASES} == set(REJECT_REASONS)


@pytest.mark.parametrize("reason, record, template, options", CASES, ids=[case[0] for case in CASES])
def test_each_reason_is_a_reject_with_a_message(reason, record, template, options):
    with pytest.raises(ConversationRejected) as rejected:
        encode_conversation(record, template, TOKENIZER, **options)
    assert rejected.value.reason == reason
    assert isinstance(rejected.value, ZephonError) and isinstance(rejected.value, ValueError)
    assert str(rejected.value).startswith(f"{reason}: ") and len(rejected.value.detail) > 20


def test_messages_name_the_message_and_the_value():
    with pytest.raises(ConversationRejected, match=r"messages\[1\]\.role is 'developer'; known roles"):
        encode_conversation(_record(USER, {"role": "developer", "content": "x"}), CHATML, TOKENIZER)
    with pytest.raises(ConversationRejected, match=r"messages\[0\] \(role 'user'\)\.content\[1\] is not a text part"):
        encode_conversation(
            _record({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}, ASSISTANT),
            CHATML, TOKENIZER,
        )


def test_what_is_accepted():
    # Text parts, tool calls without content, null keys from Parquet structs, another field name.
    record = {
        "conversation": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}], "name": None},
            {"role": "user", "content": "Weather?", "tool_calls": None},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Bern"}}]},
            {"role": "tool", "content": "sunny", "name": "get_weather"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "functions": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    encoded = encode_conversation(record, CHATML, TOKENIZER, messages_field="conversation", tools_field="functions")
    text = TOKENIZER.decode(encoded.input_ids.tolist(), skip_special_tokens=False)
    assert "Be brief." in text and '"name": "get_weather"' in text and "<tools>" in text
    supervised = TOKENIZER.decode(encoded.input_ids[encoded.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert supervised == '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\nSunny.<|im_end|>\n'


def test_a_template_that_renders_only_the_assistant_may_supervise_every_token():
    template = ChatTemplate.from_string(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% endif %}{% endfor %}"
    )
    encoded = encode_conversation(_record({"role": "system", "content": ""}, ASSISTANT), template, TOKENIZER)
    assert encoded.loss_mask.all() and len(encoded.loss_mask) > 0


def test_truncation_keeps_the_first_tokens_and_says_so():
    record = _record({"role": "system", "content": "S"}, USER, ASSISTANT, USER, {"role": "assistant", "content": "Bye now"})
    whole = encode_conversation(record, CHATML, TOKENIZER)
    cut = encode_conversation(record, CHATML, TOKENIZER, max_tokens=len(whole.input_ids) - 2, overflow="truncate")
    assert cut.truncated and not whole.truncated
    assert cut.input_ids.tolist() == whole.input_ids[:-2].tolist()
    assert cut.loss_mask.tolist() == whole.loss_mask[:-2].tolist()
    assert encode_conversation(record, CHATML, TOKENIZER, max_tokens=len(whole.input_ids)).input_ids.size == whole.input_ids.size


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_on": "first"}, r"loss_on must be one of \('all', 'last'\) \(got 'first'\)"),
        ({"overflow": "drop"}, r"overflow must be one of \('reject', 'truncate'\)"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": True}, "max_tokens must be a positive integer"),
    ],
)
def test_bad_options_are_errors_not_rejects(options, message):
    with pytest.raises(ChatOptionError, match=message):
        encode_conversation(_record(USER, ASSISTANT), CHATML, TOKENIZER, **options)


def test_configuration_errors_are_not_turned_into_rejects():
    several = ChatTemplate(sources={"a": "A", "b": "B"})
    with pytest.raises(ChatTemplateError):
        encode_conversation(_record(USER, ASSISTANT), several, TOKENIZER)
    truncating = tokenizer()
    truncating.enable_truncation(max_length=8)
    with pytest.raises(TokenizerError, match=r"no_truncation\(\)"):
        encode_conversation(_record(USER, ASSISTANT), CHATML, truncating)
    with pytest.raises(ValueError, match="unknown reject reason"):
        ConversationRejected("not_a_reason", "x")
    with pytest.raises(ChatTemplateError, match=r"extra_variables may not set \['messages'\]"):
        ChatTemplate.from_string("x", extra_variables={"messages": []})


def test_a_reject_survives_pickling_across_processes():
    import pickle

    with pytest.raises(ConversationRejected) as rejected:
        encode_conversation(_record(), CHATML, TOKENIZER)
    copy = pickle.loads(pickle.dumps(rejected.value))
    assert (copy.reason, copy.detail, str(copy)) == (rejected.value.reason, rejected.value.detail, str(rejected.value))


def test_the_fallback_and_the_tags_give_the_same_arrays_through_the_entry_point():
    record = _record({"role": "system", "content": "S"}, USER, ASSISTANT, USER, {"role": "assistant", "content": ""})
    by_tags = encode_conversation(record, CHATML, TOKENIZER)
    by_fallback = encode_conversation(record, CHATML_PLAIN, TOKENIZER)
    assert np.array_equal(by_tags.loss_mask, by_fallback.loss_mask)
    assert by_tags.supervised_tokens == by_fallback.supervised_tokens > 0
