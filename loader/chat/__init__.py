"""Chat / SFT data: render conversations with their chat template and mark the assistant tokens.

Modules, in the order a record flows through them:

- :mod:`~loader.chat.conversations`: record validation, roles, reject reasons;
- :mod:`~loader.chat.template`: loading a chat template and rendering as ``transformers`` does
  (:mod:`~loader.chat.shipped`: the templates inside the package, by name: ``"chatml"``);
- :mod:`~loader.chat.spans`: assistant character spans (generation tags, or prefix difference);
- :mod:`~loader.chat.masks`: tokenization with offsets and the per-token loss mask;
- :mod:`~loader.chat.encode`: :func:`encode_conversation`, the one entry point, with the guards
  (:func:`~loader.chat.encode.encode_conversations`: many at once, batched tokenizer calls);
- :mod:`~loader.chat.block`: online chat, a lane's row group of conversations encoded by the loader.
"""

from __future__ import annotations

import importlib

# Name -> the module that defines it. Imported on first use (PEP 562): the manifest reader
# needs only the reject reasons, and every worker process imports it; the templates' jinja2
# and the tokenizer code load only where chat data is encoded.
_EXPORTS = {
    "REJECT_REASONS": "conversations", "ROLES": "conversations", "Conversation": "conversations",
    "ConversationRejected": "conversations", "parse_conversation": "conversations",
    "OVERFLOW_CHOICES": "encode", "EncodedConversation": "encode", "encode_conversation": "encode",
    "LOSS_ON_CHOICES": "spans", "ChatOptionError": "spans",
    "ChatTemplate": "template", "ChatTemplateError": "template", "RenderedChat": "template",
    "load_chat_template": "template", "SHIPPED_TEMPLATES": "shipped", "shipped_template_path": "shipped",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loader.chat' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"loader.chat.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
