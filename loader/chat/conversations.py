"""Chat records: what a conversation must look like, and the reasons one is rejected.

A record is a mapping with a messages list (field ``messages`` unless told otherwise) and,
optionally, a record-level ``tools`` list (JSON schemas, passed to the template as ``tools``).
Each message is a mapping with:

- ``role``: one of :data:`ROLES`;
- ``content``: a string, or a list of content parts of which only text parts
  (``{"type": "text", "text": str}``) are accepted, plus image parts (``{"type": "image", ...}``)
  with ``image_parts=True`` (chat with images, :mod:`loader.vision.chat`). An assistant message that carries
  ``tool_calls`` may omit ``content`` (or give ``None``);
- optional ``tool_calls`` (a list of mappings), ``name`` (a string, e.g. the tool's name on a
  ``tool`` message), and any other keys, which reach the template untouched.

Keys whose value is ``None`` count as absent (Parquet structs fill missing keys with nulls;
``transformers`` drops them the same way). A record that breaks a rule raises
:class:`ConversationRejected` with one of :data:`REJECT_REASONS`; it is never "fixed".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from loader.errors import RecordRejected

ROLES = ("system", "user", "assistant", "tool")

# Every reason a conversation is refused, in the order the checks run. Counted by reason
# (offline in `_rejected/`, online in the batch metadata), so the names are stable API.
REJECT_REASONS = (
    "missing_messages",  # the record has no messages field, or it is not a list
    "empty_conversation",  # the messages list is empty
    "not_a_message",  # a message is not a mapping
    "missing_role",  # a message has no role (or a null one)
    "unknown_role",  # a role outside ROLES (or not a string)
    "missing_content",  # no content, and not an assistant message with tool_calls
    "non_string_content",  # content neither a string nor a list of content parts
    "unsupported_content_part",  # a content part that is not a text part (nor an image part, with images)
    "bad_tool_calls",  # tool_calls not a list of mappings
    "bad_name",  # name not a string
    "bad_tools",  # record-level tools not a list of mappings
    "template_error",  # the chat template refused the conversation (raise_exception, bad data)
    "undecidable_mask",  # no generation tags and the prefix-difference fallback cannot decide
    "empty_loss_mask",  # no token is supervised (no assistant turn, or it renders no token)
    "full_loss_mask",  # every token supervised although non-assistant text was rendered
    "too_long",  # more tokens than max_tokens (with overflow="reject")
)


class ConversationRejected(RecordRejected):
    """One chat record refused for a named reason (one of :data:`REJECT_REASONS`); the
    pipeline counts and skips it. The message says what is wrong where (message index,
    field, value) so the record can be fixed at its source.
    """

    REASONS = REJECT_REASONS


@dataclass(frozen=True)
class Conversation:
    """A validated conversation: messages with ``None`` values dropped, and the record's tools."""

    messages: tuple[dict, ...]
    tools: Optional[tuple[dict, ...]] = None
    from_json: bool = False  # parsed from json.loads output: only JSON types (ChatTemplate.render's from_json)

    def assistant_indices(self) -> tuple[int, ...]:
        return tuple(index for index, message in enumerate(self.messages) if message["role"] == "assistant")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_content(index: int, message: dict, image_parts: bool = False) -> None:
    where = f"messages[{index}] (role {message['role']!r})"
    if "content" not in message:
        if message["role"] == "assistant" and "tool_calls" in message:
            return
        raise ConversationRejected("missing_content", f"{where} has no content")
    content = message["content"]
    if isinstance(content, str):
        return
    if not isinstance(content, (list, tuple)):
        raise ConversationRejected(
            "non_string_content", f"{where}.content must be a string or a list of text parts (got {_short(content)})"
        )
    for part_index, part in enumerate(content):
        is_text_part = isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        if image_parts and isinstance(part, Mapping) and part.get("type") == "image":
            continue  # chat with images (loader.vision.chat): its references are checked there
        if not is_text_part:
            raise ConversationRejected(
                "unsupported_content_part",
                f"{where}.content[{part_index}] is not a text part {{'type': 'text', 'text': str}} "
                f"(got {_short(part)}); image parts need an image job (zephon shard --image-root/--image-policy), "
                "other media are not supported",
            )


def _check_message(index: int, raw: Any, image_parts: bool = False) -> dict:
    if not isinstance(raw, Mapping):
        raise ConversationRejected("not_a_message", f"messages[{index}] is not a mapping (got {_short(raw)})")
    message = {key: value for key, value in raw.items() if value is not None}
    if "role" not in message:
        raise ConversationRejected("missing_role", f"messages[{index}] has no 'role' (keys: {sorted(map(str, raw))})")
    if message["role"] not in ROLES:
        raise ConversationRejected(
            "unknown_role", f"messages[{index}].role is {_short(message['role'])}; known roles: {ROLES}"
        )
    _check_content(index, message, image_parts)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, (list, tuple)) and all(isinstance(call, Mapping) for call in tool_calls)
    ):
        raise ConversationRejected(
            "bad_tool_calls", f"messages[{index}].tool_calls must be a list of mappings (got {_short(tool_calls)})"
        )
    if "name" in message and not isinstance(message["name"], str):
        raise ConversationRejected("bad_name", f"messages[{index}].name must be a string (got {_short(message['name'])})")
    return message


def parse_conversation(
    record: Any, *, messages_field: str = "messages", tools_field: str = "tools", from_json: bool = False,
    image_parts: bool = False,
) -> Conversation:
    """Validate one record and return its :class:`Conversation`, or raise :class:`ConversationRejected`.

    ``from_json``: the record is ``json.loads`` output (only JSON types), so its messages
    render as they are (:meth:`loader.chat.template.ChatTemplate.render`'s ``from_json``).
    ``image_parts``: ``{"type": "image", ...}`` content parts are accepted (:mod:`loader.vision.chat`)."""
    messages = record.get(messages_field) if isinstance(record, Mapping) else None
    if not isinstance(messages, (list, tuple)):
        got = f"record type {type(record).__name__}" if not isinstance(record, Mapping) else _short(messages)
        raise ConversationRejected(
            "missing_messages", f"field {messages_field!r} must hold a list of messages (got {got})"
        )
    if not messages:
        raise ConversationRejected("empty_conversation", f"field {messages_field!r} is an empty list")
    checked = tuple(_check_message(index, message, image_parts) for index, message in enumerate(messages))
    tools = record.get(tools_field)
    if tools is not None:
        if not (isinstance(tools, (list, tuple)) and all(isinstance(tool, Mapping) for tool in tools)):
            raise ConversationRejected(
                "bad_tools", f"field {tools_field!r} must be a list of JSON-schema mappings (got {_short(tools)})"
            )
        tools = tuple(dict(tool) for tool in tools)
    return Conversation(messages=checked, tools=tools, from_json=from_json)
