"""The ``chat`` kind: conversations rendered, tokenized and masked by the loader (online chat).

Its lanes hold the ``conversation`` column; a row group becomes the lane's
:class:`loader.chat.block.OnlineChat` block. The kind owns the manifest's ``chat`` entry
(:class:`loader.chat.record.ChatRecord`), which pre-tokenized chat datasets carry too (their
lanes are of the ``tokens`` kind, with a ``loss_mask`` feature).
"""

from __future__ import annotations

from typing import Any

from loader.chat.conversations import REJECT_REASONS as CHAT_REJECT_REASONS
from loader.chat.record import ChatRecord
from loader.io.blocks import Block
from loader.io.names import CONVERSATION_COLUMN, DOCUMENT_REJECT_REASONS
from loader.kinds.base import BlockSource, LaneKind, ManifestEntry, register_kind, register_manifest_entry

# What a chat job (--messages-field) records in the manifest's ``rejected``: every reason, the
# conversation reasons of loader.chat included.
REJECT_REASONS = DOCUMENT_REJECT_REASONS + CHAT_REJECT_REASONS


class ChatKind(LaneKind):
    name = "chat"
    rejects_online = True

    def matches(self, *, pretokenized, chat, images) -> bool:
        return chat is not None and images is None

    def decode(self, source: BlockSource) -> Block:
        return source.chat.block(source.values.to_pylist(), source.token_format, source.where, source.row_group,
                                 source.owner)


def _chat_entry_problems(chat: ChatRecord, data: dict) -> list[str]:
    """The ``chat`` entry against the manifest's tokenizer and schema."""
    if not isinstance(data.get("schema"), list):
        return []
    problems = []
    columns = {c.get("name") for c in data["schema"] if isinstance(c, dict)}
    if chat.tokenized != (data.get("tokenizer") is not None):
        problems.append(f"chat.tokenized is {chat.tokenized} but the dataset is "
                        f"{'' if data.get('tokenizer') is not None else 'not '}pre-tokenized ('tokenizer')")
    if not chat.tokenized and CONVERSATION_COLUMN not in columns:
        problems.append(f"chat.tokenized is false but the schema has no {CONVERSATION_COLUMN!r} column")
    return problems


def _parse_chat_entry(data: Any) -> ChatRecord:
    return ChatRecord.from_dict(data, "chat")


CHAT = register_kind(ChatKind())
CHAT_ENTRY = register_manifest_entry(ManifestEntry("chat", _parse_chat_entry, _chat_entry_problems))
