"""Which characters of a rendered conversation are assistant text (the loss targets).

Two ways, chosen by the template:

1. **Generation tags.** The template wraps assistant text in ``{% generation %}`` ...
   ``{% endgeneration %}``; one tracked render gives the character spans (exactly the spans
   ``transformers`` records for ``return_assistant_tokens_mask``).
2. **Prefix difference** (templates without tags). For assistant message ``i``::

       prompt_i = render(messages[:i],   add_generation_prompt=True)    "...<|im_start|>assistant\\n"
       turn_i   = render(messages[:i+1], add_generation_prompt=False)   "...<|im_start|>assistant\\nHi<|im_end|>\\n"
       full     = render(messages,       add_generation_prompt=False)

   and the assistant span is ``turn_i[len(prompt_i):]``, placed at ``len(prompt_i)`` in ``full``.
   It is only sound when ``prompt_i`` is a prefix of ``turn_i`` and ``turn_i`` is a prefix of
   ``full``; otherwise the template rewrites text depending on what follows (it drops the
   reasoning of earlier turns, closes a turn differently when it is last, names later tools
   in the system prompt, ...) and the conversation is refused as ``undecidable_mask``.

   Where it can be wrong although both checks pass: a template that ignores
   ``add_generation_prompt`` and writes the assistant header with the message puts the header
   in the span (trained on); text the generation prompt writes that the turn also writes (a
   prompt ending in ``"<think>\\n"``) counts as prompt, not as assistant text; text the template
   writes after the last message (an end-of-conversation token) counts with the last assistant
   turn when that turn is the last message; a separator the template writes before the next
   header counts with the next message. Generation tags are exact and cost one render instead
   of ``2 x turns + 1``: prefer them.

``loss_on="last"`` keeps the spans of the last assistant message only: with tags, the spans
that end after ``prompt_k`` (``k`` = the last assistant message; its prompt must be a prefix of
the full render, else ``undecidable_mask``); with the fallback, that message's span alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.chat.conversations import Conversation, ConversationRejected
from loader.chat.record import LOSS_ON_CHOICES
from loader.chat.template import ChatTemplate
from loader.errors import ChatOptionError

MASK_SOURCES = ("generation_tags", "prefix_difference")


def check_choice(option: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ChatOptionError(f"{option} must be one of {choices} (got {value!r})")


@dataclass(frozen=True)
class AssistantSpans:
    """The full render, its assistant character spans ``(start, end)`` and how they were found."""

    text: str
    spans: tuple[tuple[int, int], ...]
    source: str  # one of MASK_SOURCES


def _render(template: ChatTemplate, conversation: Conversation, count: int, *, prompt: bool, track: bool = False):
    return template.render(
        list(conversation.messages[:count]),
        tools=list(conversation.tools) if conversation.tools is not None else None,
        add_generation_prompt=prompt,
        track_generation=track,
        from_json=conversation.from_json,
    )


def _prompt_boundary(template: ChatTemplate, conversation: Conversation, index: int, full: str) -> int:
    """Length of ``render(messages[:index], add_generation_prompt=True)``, checked to prefix ``full``."""
    prompt = _render(template, conversation, index, prompt=True).text
    if not full.startswith(prompt):
        raise ConversationRejected(
            "undecidable_mask",
            f"the render up to messages[{index}] with add_generation_prompt=True is not a prefix of the whole "
            f"conversation's render (it differs at character {_first_difference(prompt, full)}): the template "
            "rewrites earlier text depending on what follows, so the assistant turn cannot be located",
        )
    return len(prompt)


def _first_difference(a: str, b: str) -> int:
    for position, (char_a, char_b) in enumerate(zip(a, b)):
        if char_a != char_b:
            return position
    return min(len(a), len(b))


def generation_tag_spans(template: ChatTemplate, conversation: Conversation, loss_on: str) -> AssistantSpans:
    """Spans recorded by ``{% generation %}`` blocks in one tracked render."""
    rendered = _render(template, conversation, len(conversation.messages), prompt=False, track=True)
    spans = rendered.generation_spans
    assistants = conversation.assistant_indices()
    if loss_on == "last" and assistants and spans:
        boundary = _prompt_boundary(template, conversation, assistants[-1], rendered.text)
        spans = tuple((start, end) for start, end in spans if end > boundary or start >= boundary)
    return AssistantSpans(rendered.text, tuple(spans), "generation_tags")


def prefix_difference_spans(template: ChatTemplate, conversation: Conversation, loss_on: str) -> AssistantSpans:
    """Spans found by rendering up to and through each assistant turn (module docstring)."""
    full = _render(template, conversation, len(conversation.messages), prompt=False).text
    assistants = conversation.assistant_indices()
    if loss_on == "last":
        assistants = assistants[-1:]
    spans = []
    for index in assistants:
        start = _prompt_boundary(template, conversation, index, full)
        turn = _render(template, conversation, index + 1, prompt=False).text
        if not turn.startswith(full[:start]):
            raise ConversationRejected(
                "undecidable_mask",
                f"messages[{index}] (assistant): the render with add_generation_prompt=True is not a prefix of the "
                "render through this turn (the generation prompt differs from the header the template writes "
                "with the message), so the assistant text cannot be separated from the prompt",
            )
        if not full.startswith(turn):
            raise ConversationRejected(
                "undecidable_mask",
                f"messages[{index}] (assistant): the render through this turn is not a prefix of the whole "
                f"conversation's render (it differs at character {_first_difference(turn, full)}): the template "
                "renders this turn differently when more messages follow",
            )
        spans.append((start, len(turn)))
    return AssistantSpans(full, tuple(spans), "prefix_difference")


def assistant_spans(template: ChatTemplate, conversation: Conversation, *, loss_on: str = "all") -> AssistantSpans:
    """The assistant character spans of ``conversation``: by generation tags when the template has them."""
    check_choice("loss_on", loss_on, LOSS_ON_CHOICES)
    if template.has_generation_tags(conversation.tools is not None):
        return generation_tag_spans(template, conversation, loss_on)
    return prefix_difference_spans(template, conversation, loss_on)
