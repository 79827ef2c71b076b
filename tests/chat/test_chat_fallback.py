"""The prefix-difference fallback: equal to generation tags where it decides, refusing where it cannot.

For a template without generation tags, the fallback's mask must equal the mask of the same
template with the tags put back (the test templates tag exactly what follows the generation
prompt through the end of the turn). Templates that rewrite text depending on what follows
are refused as ``undecidable_mask``; the documented blind spot (a template that ignores
``add_generation_prompt``) is pinned so a change to it is noticed.
"""

from __future__ import annotations

import pytest

from loader.chat import ChatTemplate, ConversationRejected, encode_conversation, parse_conversation
from loader.chat.spans import assistant_spans
from tests.chat.chat_factory import DATE, SPECIAL_TOKENS, TEMPLATE_FILES, make_records, template_text, tokenizer

RECORDS = make_records(seed=29, count=30)
TOKENIZER = tokenizer(chat_markers=True)


def _template(source: str) -> ChatTemplate:
    return ChatTemplate.from_string(source, special_tokens=SPECIAL_TOKENS, extra_variables={"date_string": DATE})


@pytest.mark.parametrize("loss_on", ["all", "last"])
@pytest.mark.parametrize("template_file", TEMPLATE_FILES)
def test_fallback_mask_equals_the_generation_tag_mask_of_the_same_template(template_file, loss_on):
    tagged = _template(template_text(template_file))
    plain = _template(template_text(template_file, generation_tags=False))
    multi_turn = 0
    for index, record in enumerate(RECORDS):
        by_tags = encode_conversation(record, tagged, TOKENIZER, loss_on=loss_on)
        by_fallback = encode_conversation(record, plain, TOKENIZER, loss_on=loss_on)
        assert (by_tags.mask_source, by_fallback.mask_source) == ("generation_tags", "prefix_difference")
        assert by_fallback.input_ids.tolist() == by_tags.input_ids.tolist(), index
        assert by_fallback.loss_mask.tolist() == by_tags.loss_mask.tolist(), index
        conversation = parse_conversation(record)
        multi_turn += len(conversation.assistant_indices()) > 1
        # The character spans agree too, not only after mapping to tokens.
        spans_by_tags = assistant_spans(tagged, conversation, loss_on=loss_on).spans
        assert assistant_spans(plain, conversation, loss_on=loss_on).spans == spans_by_tags, index
    assert multi_turn >= 10


CHATML_PLAIN = template_text("chatml_generation.jinja", generation_tags=False)
TWO_TURNS = {
    "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ]
}

UNDECIDABLE = {
    # Qwen3-style: reasoning is shown for the last assistant turn only, so an earlier turn renders
    # differently once more messages follow.
    "drops-earlier-reasoning": CHATML_PLAIN.replace(
        "{%- if message.reasoning_content %}", "{%- if message.reasoning_content and loop.last %}"
    ),
    # The generation prompt writes text that the turns do not write.
    "prompt-differs-from-header": CHATML_PLAIN.replace(
        "{{- '<|im_start|>assistant\\n' }}\n{%- endif %}", "{{- '<|im_start|>assistant\\nAnswer: ' }}\n{%- endif %}"
    ),
    # An end-of-conversation token closes the last turn, whatever it is.
    "closes-the-last-turn": CHATML_PLAIN + "{%- if not add_generation_prompt %}{{- eos_token }}{%- endif %}",
}


@pytest.mark.parametrize("name", sorted(UNDECIDABLE))
def test_templates_that_rewrite_text_are_refused_as_undecidable(name):
    source = UNDECIDABLE[name]
    assert source != CHATML_PLAIN  # the edit applied
    template = _template(source)
    with pytest.raises(ConversationRejected, match="undecidable_mask") as refused:
        encode_conversation(TWO_TURNS, template, TOKENIZER)
    assert refused.value.reason == "undecidable_mask" and "messages[" in str(refused.value)


def test_loss_on_last_decides_where_only_earlier_turns_are_undecidable():
    # Only the last turn's prompt and turn are rendered, so an end token after it is fine; as the
    # template writes it after the last message, it belongs to that turn's span.
    template = _template(UNDECIDABLE["closes-the-last-turn"])
    encoded = encode_conversation(TWO_TURNS, template, TOKENIZER, loss_on="last")
    text = template.render(TWO_TURNS["messages"]).text
    assert text.endswith("6<|im_end|>\n<|endoftext|>")
    supervised = TOKENIZER.decode(encoded.input_ids[encoded.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert supervised == "<think>\nadd again\n</think>\n\n6<|im_end|>\n<|endoftext|>"


def test_a_template_that_ignores_the_generation_prompt_puts_the_header_in_the_span():
    # The documented blind spot: nothing in the renders tells the header from the answer.
    template = _template("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    rendered = assistant_spans(template, parse_conversation(TWO_TURNS))
    assert [rendered.text[start:end] for start, end in rendered.spans] == ["assistant: 4\n", "assistant: 6\n"]
