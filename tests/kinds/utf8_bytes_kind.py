"""A test-only lane kind, ``utf8-bytes``: a document's tokens are its UTF-8 bytes (ids 0..255).

It shows that a new kind is one module outside the core: it registers its loader side (a
:class:`~loader.kinds.base.LaneKind` whose blocks turn the lane's ``text`` column into byte
ids, no tokenizer involved) and its Beam side (the record converter ``zephon shard --kind
utf8-bytes`` reads records with), both by being imported. Worker processes import it by name
(:func:`loader.kinds.base.kind_modules`), so it is imported as ``tests.kinds.utf8_bytes_kind``
(the repository root is on pytest's ``pythonpath``).
"""

from __future__ import annotations

from types import SimpleNamespace

from beam_jobs.records import RecordConverter, register_converter
from loader.io.blocks import Block, TextBlock
from loader.kinds.base import BlockSource, LaneKind, register_kind

NAME = "utf8-bytes"


class Utf8Bytes:
    """The ``encode_batch_fast`` a :class:`TextBlock` calls, with a document's UTF-8 bytes as its ids."""

    def encode_batch_fast(self, texts: list, add_special_tokens: bool = False) -> list:
        return [SimpleNamespace(ids=list(text.encode("utf-8"))) for text in texts]


class Utf8BytesKind(LaneKind):
    name = NAME
    named = True  # its datasets say so in the manifest ("kind": "utf8-bytes")

    def decode(self, source: BlockSource) -> Block:
        # A text block: its cursor resumes at a document like the text kind's (TextBlock.skip_to).
        return TextBlock(source.values.to_pylist(), Utf8Bytes(), source.token_format)


@register_converter(NAME)
class Utf8BytesConverter(RecordConverter):
    """The text kind's record rules (a non-empty string in --text-field), without chat."""

    def __init__(self, spec, input_file, chat_encoder=None):
        if spec.chat is not None:
            raise ValueError(f"--kind {NAME} reads text records, not conversations")
        super().__init__(spec, input_file, chat_encoder)


UTF8_BYTES = register_kind(Utf8BytesKind())
