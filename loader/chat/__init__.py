"""Chat / SFT data: render conversations with their chat template and mark the assistant tokens.

Modules, in the order a record flows through them:

- :mod:`~loader.chat.conversations`: record validation, roles, reject reasons;
- :mod:`~loader.chat.template`: loading a chat template and rendering as ``transformers`` does;
- :mod:`~loader.chat.spans`: assistant character spans (generation tags, or prefix difference);
- :mod:`~loader.chat.masks`: tokenization with offsets and the per-token loss mask;
- :mod:`~loader.chat.encode`: :func:`encode_conversation`, the one entry point, with the guards.
"""

from loader.chat.conversations import REJECT_REASONS, ROLES, Conversation, ConversationRejected, parse_conversation
from loader.chat.encode import OVERFLOW_CHOICES, EncodedConversation, encode_conversation
from loader.chat.spans import LOSS_ON_CHOICES, ChatOptionError
from loader.chat.template import ChatTemplate, ChatTemplateError, RenderedChat, load_chat_template

__all__ = [
    "LOSS_ON_CHOICES",
    "OVERFLOW_CHOICES",
    "REJECT_REASONS",
    "ROLES",
    "ChatOptionError",
    "ChatTemplate",
    "ChatTemplateError",
    "Conversation",
    "ConversationRejected",
    "EncodedConversation",
    "RenderedChat",
    "encode_conversation",
    "load_chat_template",
    "parse_conversation",
]
