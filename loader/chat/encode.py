"""One chat record to ``input_ids`` + ``loss_mask``, or a reject with a reason.

The single entry point the Beam job (offline tokenization) and the loader (online) call, so
both produce the same arrays::

    record --parse_conversation--> Conversation --assistant_spans--> text + char spans
           --tokenize_rendered_batch--> ids + where each token is --loss_mask--> loss_mask
           --guards--> EncodedConversation | ConversationRejected(reason)

Guards, in order (each a reason in :data:`loader.chat.conversations.REJECT_REASONS`):
``empty_loss_mask`` when no token is supervised (no assistant turn, or its text renders to no
token); ``full_loss_mask`` when every token is supervised although the render holds text
outside the assistant spans or the content of a system / user / tool message (a template
that tags everything); ``too_long`` when the conversation has more than ``max_tokens`` tokens
and ``overflow="reject"`` (with ``overflow="truncate"`` the first ``max_tokens`` tokens are
kept and the empty-mask guard runs again on them).

Deterministic: the same record, template, tokenizer and options give the same arrays (the
template's ``strftime_now`` is the one exception; templates that call it depend on the date).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import jinja2.exceptions
import numpy as np

from loader.chat.conversations import Conversation, ConversationRejected, parse_conversation
from loader.chat.record import OVERFLOW_CHOICES
from loader.chat.masks import TokenizedChat, covered_characters, encode_renders, tokenized_renders
from loader.chat.spans import LOSS_ON_CHOICES, AssistantSpans, assistant_spans, check_choice
from loader.chat.template import ChatTemplate
from loader.errors import ChatOptionError, ZephonError
from loader.io.owner import PROCESS_OWNER

# encode_conversations tokenizes its renders in parts of at least this many characters, each
# on a helper thread while the records after it render: the tokenizer releases the GIL, so
# the (GIL-bound) Jinja render of one part and the tokenization of the previous one run at
# once. Each text is encoded on its own, so the ids do not depend on where the parts end.
# Smaller parts overlap more of the work but pay the batched call's overhead more often.
TOKENIZE_PART_CHARS = 24 * 1024

TOKENIZE_HELPER = "chat-tokenize"  # the name of that thread's executor (loader.io.owner.StreamOwner.helper)

# What a template may raise on data it does not accept: its own raise_exception
# (TemplateError and its subclasses), or Python errors from operations on odd values.
_TEMPLATE_FAILURES = (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


@dataclass(frozen=True, eq=False)  # arrays: compare fields with np.array_equal, not ==
class EncodedConversation:
    """A conversation ready to pack: ``input_ids`` (int32) and ``loss_mask`` (uint8, 1 = supervised).

    ``mask_source`` says how the assistant tokens were found (``generation_tags`` or
    ``prefix_difference``); ``truncated`` that ``overflow="truncate"`` cut the conversation.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    mask_source: str
    truncated: bool = False

    @property
    def supervised_tokens(self) -> int:
        return int(self.loss_mask.sum())


def spans_or_reject(template: ChatTemplate, conversation: Conversation, loss_on: str) -> AssistantSpans:
    """The conversation's render and assistant spans; a template that fails on it is a reject
    (the text and image chat paths share this)."""
    try:
        return assistant_spans(template, conversation, loss_on=loss_on)
    except ZephonError:
        raise  # a reject already, or a template choice that is a configuration error
    except _TEMPLATE_FAILURES as exc:
        raise ConversationRejected(
            "template_error", f"the chat template ({template.origin}) refused the conversation: {exc}"
        ) from exc


def _renders_non_assistant_text(conversation: Conversation, rendered: AssistantSpans) -> bool:
    if covered_characters(rendered.spans, len(rendered.text)) < len(rendered.text):
        return True
    for message in conversation.messages:
        content = message.get("content")
        if message["role"] != "assistant" and isinstance(content, str) and content and content in rendered.text:
            return True
    return False


def check_options(loss_on: str, max_tokens: Optional[int], overflow: str) -> None:
    """Refuse encoding options outside their choices (:class:`ChatOptionError`, naming the option)."""
    check_choice("loss_on", loss_on, LOSS_ON_CHOICES)
    check_choice("overflow", overflow, OVERFLOW_CHOICES)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ChatOptionError(f"max_tokens must be a positive integer or None (got {max_tokens!r})")


@dataclass(frozen=True)
class RenderedConversation:
    """A validated conversation and its render with the assistant spans: what is left is tokenizing."""

    conversation: Conversation
    spans: AssistantSpans

    @property
    def text(self) -> str:
        return self.spans.text


def render_conversation(
    record: Any, template: ChatTemplate, *, loss_on: str = "all", messages_field: str = "messages",
    tools_field: str = "tools", from_json: bool = False,
) -> RenderedConversation:
    """Validate and render one record (the steps before tokenization); raises :class:`ConversationRejected`.
    ``from_json``: the record is ``json.loads`` output (:func:`parse_conversation`)."""
    conversation = parse_conversation(record, messages_field=messages_field, tools_field=tools_field,
                                      from_json=from_json)
    return RenderedConversation(conversation, spans_or_reject(template, conversation, loss_on))


def finish_encoding(
    rendered: RenderedConversation, tokens: TokenizedChat, *, max_tokens: Optional[int] = None,
    overflow: str = "reject",
) -> EncodedConversation:
    """The loss mask of a tokenized render, then the guards (module docstring); raises
    :class:`ConversationRejected`."""
    conversation, spans = rendered.conversation, rendered.spans
    input_ids = tokens.input_ids
    loss_mask = tokens.loss_mask(spans.spans)
    if not loss_mask.any():
        why = "it has no assistant message" if not conversation.assistant_indices() else "no token overlaps an assistant span"
        raise ConversationRejected("empty_loss_mask", f"no token is supervised: {why} ({spans.source})")
    if loss_mask.all() and _renders_non_assistant_text(conversation, spans):
        raise ConversationRejected(
            "full_loss_mask",
            f"all {len(loss_mask)} tokens are supervised although the render holds non-assistant text "
            f"({spans.source}); the template's generation tags cover more than the assistant turns",
        )
    truncated = False
    if max_tokens is not None and len(input_ids) > max_tokens:
        if overflow == "reject":
            raise ConversationRejected(
                "too_long", f"{len(input_ids)} tokens > max_tokens={max_tokens} (overflow='reject')"
            )
        input_ids, loss_mask, truncated = input_ids[:max_tokens], loss_mask[:max_tokens], True
        if not loss_mask.any():
            raise ConversationRejected(
                "empty_loss_mask", f"no supervised token in the first max_tokens={max_tokens} tokens (overflow='truncate')"
            )
    return EncodedConversation(
        input_ids=np.ascontiguousarray(input_ids),
        loss_mask=np.ascontiguousarray(loss_mask),
        mask_source=spans.source,
        truncated=truncated,
    )


def encode_conversation(record: Any, template: ChatTemplate, tokenizer, **options: Any) -> EncodedConversation:
    """Encode one chat record; raise :class:`ConversationRejected` (with ``.reason``) to refuse it.

    ``options`` are :func:`encode_conversations`' keywords: ``loss_on`` (``"all"`` supervises
    every assistant turn, ``"last"`` the last one only), ``max_tokens`` / ``overflow`` (the
    length bound and what a longer conversation gets), ``messages_field`` / ``tools_field``
    (where the record holds its messages and tools). Bad options raise
    :class:`loader.chat.spans.ChatOptionError`; a tokenizer with truncation or padding enabled
    a :class:`loader.stages.tokenizer.TokenizerError`.
    """
    (outcome,) = encode_conversations([record], template, tokenizer, **options)
    if isinstance(outcome, ConversationRejected):
        raise outcome
    return outcome


def encode_conversations(
    records: Sequence[Any],
    template: ChatTemplate,
    tokenizer,
    *,
    loss_on: str = "all",
    max_tokens: Optional[int] = None,
    overflow: str = "reject",
    messages_field: str = "messages",
    tools_field: str = "tools",
    from_json: bool = False,
    helper: Optional[ThreadPoolExecutor] = None,
) -> list[Union[EncodedConversation, ConversationRejected]]:
    """:func:`encode_conversation` of each record, the renders tokenized in batched calls.

    A batched call runs the tokenizer on every core and pays its call overhead once per part,
    where one ``encode`` per conversation serialises both; ids and masks are the same
    (:func:`loader.chat.masks.tokenize_rendered_batch`). The renders are tokenized in parts of
    :data:`TOKENIZE_PART_CHARS`, each on a helper thread while the next part renders (the
    same ids: every text is encoded on its own). A refused record's entry is
    its :class:`ConversationRejected`, in record order. ``from_json``: the records are
    ``json.loads`` output (only JSON types), so they render without transformers' copy of
    the messages (the same text: :meth:`loader.chat.template.ChatTemplate.render`).
    ``helper``: the one-thread executor of those parts (a loader stream's owner's; None: the
    process's, :data:`loader.io.owner.PROCESS_OWNER`).
    """
    check_options(loss_on, max_tokens, overflow)
    if helper is None:
        helper = PROCESS_OWNER.helper(TOKENIZE_HELPER)
    outcomes: list = []
    parts: list[tuple[list[str], Future]] = []  # each part's renders and their encode_renders, in order
    texts: list[str] = []  # the renders of the part being filled
    chars = 0
    for record in records:
        try:
            outcome = render_conversation(record, template, loss_on=loss_on, messages_field=messages_field,
                                          tools_field=tools_field, from_json=from_json)
        except ConversationRejected as exc:
            outcome = exc
        else:
            texts.append(outcome.text)
            chars += len(outcome.text)
            if chars >= TOKENIZE_PART_CHARS:
                parts.append((texts, helper.submit(encode_renders, tokenizer, texts)))
                texts, chars = [], 0
        outcomes.append(outcome)
    last = encode_renders(tokenizer, texts)  # the last part: on this thread, while the helper finishes
    tokenized = [tokens for part_texts, future in parts for tokens in tokenized_renders(tokenizer, part_texts,
                                                                                          future.result())]
    results = iter(tokenized + tokenized_renders(tokenizer, texts, last))
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, RenderedConversation):
            tokens = next(results)
            try:
                outcomes[index] = finish_encoding(outcome, tokens, max_tokens=max_tokens, overflow=overflow)
            except ConversationRejected as exc:
                outcomes[index] = exc
    return outcomes
