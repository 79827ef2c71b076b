"""``from_json`` renders (no copy of JSON-typed messages) equal the default render, spans included."""

from __future__ import annotations

import json

import pytest

from loader.chat import ChatTemplate, parse_conversation
from loader.chat.encode import encode_conversations
from loader.chat.spans import assistant_spans
from tests.chat.chat_factory import DATE, SPECIAL_TOKENS, TEMPLATE_FILES, make_records, template_text, tokenizer

RECORDS = make_records(seed=31, count=60) + make_records(seed=32, count=8, text_parts=True)


def _records_from_json() -> list[dict]:
    records = [json.loads(json.dumps(record)) for record in RECORDS]
    # None-valued keys (Parquet structs), nested nulls, reasoning under both names: all normalised alike.
    records[0]["messages"][0]["name"] = None
    records[1]["messages"][-1]["thinking"] = "Thinking first"
    records[2]["messages"][-1]["reasoning"] = None
    records[3].setdefault("tools", []).append({"type": "function", "function": {"name": "f", "parameters": None}})
    return records


def _outcome(function, *args, **kwargs):
    """The result, or (exception type, message) for a refusal, which must be the same refusal."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("name", TEMPLATE_FILES)
@pytest.mark.parametrize("generation_tags", (True, False))
def test_from_json_renders_and_spans_equal_the_copying_render(name, generation_tags):
    template = ChatTemplate.from_string(template_text(name, generation_tags=generation_tags), origin=name,
                                        special_tokens=SPECIAL_TOKENS, extra_variables={"date_string": DATE})
    compared = 0
    for record in _records_from_json():
        copied, trusted = parse_conversation(record), parse_conversation(record, from_json=True)
        assert trusted.from_json and not copied.from_json
        for loss_on in ("all", "last"):
            expected = _outcome(assistant_spans, template, copied, loss_on=loss_on)
            assert _outcome(assistant_spans, template, trusted, loss_on=loss_on) == expected
            compared += not isinstance(expected, tuple)
        for prompt in (False, True):
            plain = _outcome(template.render, list(copied.messages), tools=copied.tools, add_generation_prompt=prompt)
            assert _outcome(template.render, list(trusted.messages), tools=trusted.tools,
                            add_generation_prompt=prompt, from_json=True) == plain
        assert [dict(m) for m in trusted.messages] == [dict(m) for m in copied.messages]  # not changed by rendering
    assert compared > 50


def test_encode_conversations_from_json_gives_the_same_arrays():
    template = ChatTemplate.from_string(template_text("chatml_generation.jinja"), origin="chatml",
                                        special_tokens=SPECIAL_TOKENS)
    ours = tokenizer()
    records = _records_from_json()
    expected = encode_conversations(records, template, ours)
    for a, b in zip(expected, encode_conversations(records, template, ours, from_json=True)):
        assert type(a) is type(b)
        if hasattr(a, "input_ids"):
            assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        else:
            assert a.reason == b.reason


ODD_TAG_TEMPLATES = {
    "in_macro": "{% macro turn(m) %}[{% generation %}{{ m.content }}{% endgeneration %}]{% endmacro %}"
                "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{{ turn(m) }}"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "in_set_block": "{% for m in messages %}{% set body %}{% generation %}{{ m.content }}{% endgeneration %}"
                    "{% endset %}{{ m.role }}:{{ body }};{% endfor %}",
    "in_filter_block": "{% for m in messages %}{{ m.role }}{% filter upper %}{% generation %}{{ m.content }}"
                       "{% endgeneration %}{% endfilter %}|{% endfor %}",
    "nested_and_empty": "{% for m in messages %}{% generation %}({% generation %}{{ m.content }}"
                        "{% endgeneration %}){% endgeneration %}{% generation %}{% endgeneration %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(ODD_TAG_TEMPLATES))
def test_generation_spans_equal_transformers_in_buffered_constructs(name):
    """Generation blocks inside macros, set / filter blocks, nested or empty ones: the spans the
    tracker records (from the count of blocks yielded when the tag ran) equal transformers'."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = ODD_TAG_TEMPLATES[name]
    template = ChatTemplate.from_string(source, origin=name)
    for record in RECORDS[:20]:
        messages = [m for m in record["messages"] if isinstance(m.get("content"), str)]
        (text,), (indices,) = chat_template_utils.render_jinja_template(
            conversations=[messages], chat_template=source, return_assistant_tokens_mask=True)
        rendered = template.render(messages, track_generation=True)
        assert rendered.text == text and list(rendered.generation_spans) == [tuple(i) for i in indices]
