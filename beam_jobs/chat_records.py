"""Chat records in the sharding job: a conversation rendered and tokenized offline, or
validated and stored for the loader to encode online.

With ``--messages-field`` each input record is a conversation, and the ``ReadFiles`` step
turns it into a document through :mod:`loader.chat.encode`, the code the loader's online path
(:mod:`loader.chat.block`) calls too, so both give the same arrays::

    with --tokenizer (offline):
    record --encode_conversation(template, tokenizer, loss_on, max_tokens, overflow)-->
        document (key, rendered text, text bytes, kept values, (input_ids bytes, loss_mask bytes))
    without (online):
    record --render_conversation(template, loss_on)-->
        document (key, rendered text, text bytes, kept values, conversation JSON)
      | ConversationRejected(reason) --> rejection with that reason (into ``_rejected/``)

Online, every reject that needs no tokenizer happens here, as offline (malformed messages,
``invalid_utf8``, ``template_error``, ``undecidable_mask``); the token-level guards
(``empty_loss_mask``, ``full_loss_mask``, ``too_long``) run in the loader, which counts them.
The text column is the same plain render either way, so lanes, order, file counts and row
groups of the two datasets are the same, and so are their batches.

The document's text is the full rendered conversation (what the template wrote, special
tokens included as text); ``input_ids`` are its tokens without added special tokens, cut to
``--chat-max-tokens`` with ``--chat-overflow truncate``; ``loss_mask`` holds one byte per id,
1 on the assistant's tokens. Lanes, order and file counts follow from the key and the rendered
text exactly as for text documents (:mod:`beam_jobs.lane_files`).

The conversation JSON (:func:`conversation_json`) is the validated conversation, compact, in
the record's key order (templates may print a mapping's keys in order: sorting them would
change the render), the ``null`` values of messages dropped as :func:`parse_conversation` drops
them, and a value JSON cannot hold written as the placeholder the template would have seen.

The template and tokenizer are loaded once per worker (:meth:`ChatEncoder.load`) and checked
against the fingerprints taken at launch, so a file rewritten while the job runs fails the job
instead of mixing two encodings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from loader.chat import encode_conversation, load_chat_template, parse_conversation
from loader.chat.encode import render_conversation
from loader.chat.record import ChatRecord
from loader.chat.record import template_fingerprint as manifest_template_fingerprint
from loader.io.storage_options import StorageOptions
from loader.stages.tokenizer import describe, load_tokenizer

TOOLS_FIELD = "tools"  # the record-level tools list (JSON schemas), passed to the template
EncodedTokens = tuple  # (input_ids as little-endian int32 bytes, loss_mask as one uint8 byte per id)


@dataclass(frozen=True)
class ChatSpec:
    """What the job needs to encode conversations (``--messages-field`` and the ``--chat-*`` options)."""

    messages_field: str
    template_path: str
    tokenizer_path: Optional[str]  # None: online (the lanes hold the conversations)
    tokenizer_fingerprint: Optional[str]
    template_fingerprint: str
    loss_on: str = "all"
    max_tokens: Optional[int] = None
    overflow: str = "reject"

    @property
    def tokenized(self) -> bool:
        return self.tokenizer_path is not None

    @property
    def record_fields(self) -> tuple[str, ...]:
        """The fields a record's conversation is read from (Parquet columns to load)."""
        return (self.messages_field, TOOLS_FIELD)

    def manifest_record(self, template) -> ChatRecord:
        """The manifest's ``chat`` entry; online data carries the template itself."""
        return ChatRecord(
            messages_field=self.messages_field, tokenized=self.tokenized, loss_on=self.loss_on,
            max_tokens=self.max_tokens, overflow=self.overflow, template_fingerprint=self.template_fingerprint,
            template=None if self.tokenized else template_record(template), template_origin=self.template_path,
        )


def template_record(template) -> dict:
    """What :class:`loader.chat.ChatTemplate` is rebuilt from (the manifest's ``chat.template``)."""
    return {"sources": dict(template.sources), "special_tokens": dict(template.special_tokens),
            "extra_variables": dict(template.extra_variables), "template_name": template.template_name}


def _placeholder(value: Any) -> str:
    # loader.chat.template._plain: what a template sees of a value outside JSON's types
    return f"<{type(value).__name__}>"


def conversation_json(conversation) -> str:
    """The lane-file ``conversation`` value of a validated conversation (module docstring)."""
    value: dict[str, Any] = {"messages": list(conversation.messages)}
    if conversation.tools is not None:
        value["tools"] = list(conversation.tools)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_placeholder)


def template_fingerprint(template) -> str:
    """A stable digest of a loaded template: its sources, special tokens and variables (the
    loader checks a stored ``chat.template`` against it: :func:`loader.chat.record.template_fingerprint`)."""
    return manifest_template_fingerprint(template_record(template))


def _lone_surrogate(value: Any) -> Optional[str]:
    """Where a JSON value holds a string that is not valid UTF-8 (a ``\\ud800`` escape), if anywhere.

    The tokenizer refuses such text with a bare TypeError and Parquet cannot store it, so the
    record is an ``invalid_utf8`` reject, checked before rendering.
    """
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"character {exc.start} of its JSON: {exc.reason} (a lone surrogate escape such as \\ud800)"
    return None


class InvalidUtf8Record(ValueError):
    """A conversation holding a string that is not valid UTF-8: an ``invalid_utf8`` reject."""


class ChatEncoder:
    """A :class:`ChatSpec` with its template and tokenizer loaded: record -> tokens or reject."""

    def __init__(self, spec: ChatSpec, template, tokenizer):
        self.spec = spec
        self.template = template
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, spec: ChatSpec, storage_options: Optional[StorageOptions] = None) -> "ChatEncoder":
        """Load the template and tokenizer (remote ones read with ``storage_options``), checking their
        fingerprints against the launch's."""
        template = load_chat_template(spec.template_path, storage_options=storage_options)
        tokenizer = load_tokenizer(spec.tokenizer_path, storage_options) if spec.tokenized else None
        checks = [("--chat-template", spec.template_path, spec.template_fingerprint, template_fingerprint(template))]
        if tokenizer is not None:
            checks.append(("--tokenizer", spec.tokenizer_path, spec.tokenizer_fingerprint,
                           describe(tokenizer).fingerprint))
        for option, path, launched, actual in checks:
            if actual != launched:
                raise RuntimeError(
                    f"zephon shard: {option} {path} changed while the job ran (fingerprint {actual[:12]} on a "
                    f"worker, {launched[:12]} at launch); re-run with a file that is not being rewritten."
                )
        return cls(spec, template, tokenizer)

    def encode(self, record: dict) -> tuple[str, Any]:
        """``(rendered text, (ids bytes, mask bytes))`` offline, ``(rendered text, conversation
        JSON)`` online; raises :class:`loader.chat.ConversationRejected` (a chat reason) or
        :class:`InvalidUtf8Record`."""
        spec = self.spec
        for name in spec.record_fields:
            problem = _lone_surrogate(record.get(name))
            if problem:
                raise InvalidUtf8Record(f"field {name!r}: {problem}")
        if not spec.tokenized:
            rendered = render_conversation(record, self.template, loss_on=spec.loss_on,
                                           messages_field=spec.messages_field, tools_field=TOOLS_FIELD)
            conversation = rendered.conversation
            # the plain render, as offline (the text column must be the same for the same lanes)
            text = self.template.render(list(conversation.messages), tools=conversation.tools).text
            return text, conversation_json(conversation)
        encoded = encode_conversation(
            record, self.template, self.tokenizer, loss_on=spec.loss_on, max_tokens=spec.max_tokens,
            overflow=spec.overflow, messages_field=spec.messages_field, tools_field=TOOLS_FIELD,
        )
        # The text column holds the full render: rendered again (plain, no span tracking), the
        # same text the spans were found in. encode_conversation does not return its text; the
        # second render adds about a fifth (0.37 ms on 1.66 ms per generated conversation).
        conversation = parse_conversation(record, messages_field=spec.messages_field, tools_field=TOOLS_FIELD)
        text = self.template.render(list(conversation.messages), tools=conversation.tools).text
        ids = np.ascontiguousarray(encoded.input_ids, dtype="<i4").tobytes()
        mask = np.ascontiguousarray(encoded.loss_mask, dtype=np.uint8).tobytes()
        return text, (ids, mask)
