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
from loader.kinds.base import (
    BlockSource, LaneKind, ManifestEntry, SourcePlan, register_kind, register_manifest_entry, register_source_plan,
)

# What a chat job (--messages-field) records in the manifest's ``rejected``: every reason, the
# conversation reasons of loader.chat included.
REJECT_REASONS = DOCUMENT_REJECT_REASONS + CHAT_REJECT_REASONS


class ChatKind(LaneKind):
    name = "chat"
    rejects_online = True

    def matches(self, *, pretokenized, chat, images) -> bool:
        return chat is not None and images is None

    def decode(self, source: BlockSource) -> Block:
        return source.chat.block(source.values.to_pylist(), source.token_format, source.where, source.row_group)

    def stream_options(self, manifest, spec, source_name: str, tokenizer) -> dict:
        return {"chat": online_chat(manifest, spec, source_name, tokenizer)}


def online_chat(manifest, spec, source_name: str, tokenizer):
    """The encoder of an online chat source (loader.chat.block), bounded by the spec's seq_len."""
    from loader.chat.block import OnlineChat  # jinja2 (~0.1 s to import): only online chat lanes load it

    return OnlineChat.of_manifest(manifest, tokenizer, source_name=source_name, seq_len=spec.seq_len,
                                  overlong=spec.overlong, packing=spec.packing, wrap_tokens=spec.token_format.extra)


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


def _check_sources(manifests, source_names, tokenizer, **bounds) -> tuple[str, ...]:
    """loader.chat.block.check_chat_sources where a source is chat (offline or online)."""
    if all(m.chat is None for m in manifests):
        return ()
    from loader.chat.block import check_chat_sources  # jinja2 (~0.1 s to import): only chat sources load it

    return check_chat_sources(manifests, source_names, tokenizer, **bounds)


def _overflows(manifest, **bounds) -> bool:
    if manifest.chat is None:
        return False
    from loader.chat.block import chat_overflows  # jinja2 (~0.1 s to import): only chat sources load it

    return chat_overflows(manifest, **bounds)


CHAT = register_kind(ChatKind())
CHAT_ENTRY = register_manifest_entry(ManifestEntry("chat", _parse_chat_entry, _chat_entry_problems))
CHAT_PLAN = register_source_plan(SourcePlan("chat", rejects=_check_sources, overflows=_overflows))
