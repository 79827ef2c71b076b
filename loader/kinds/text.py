"""The text kinds: ``text`` (documents tokenized by the loader) and ``tokens`` (pre-tokenized ids).

``text`` lanes hold a ``text`` column, tokenized as the cursor reaches it
(:class:`loader.io.blocks.TextBlock`); ``tokens`` lanes hold ``input_ids`` and the per-token
feature columns the manifest's schema lists (:func:`loader.io.blocks.pretokenized_block`),
chat data encoded by the Beam job included.
"""

from __future__ import annotations

from loader.io.blocks import Block, TextBlock, feature_values, pretokenized_block
from loader.kinds.base import BlockSource, LaneKind, register_kind


class TextKind(LaneKind):
    name = "text"

    def matches(self, *, pretokenized, chat, images) -> bool:
        return not pretokenized and chat is None and images is None

    def decode(self, source: BlockSource) -> Block:
        return TextBlock(source.values.to_pylist(), source.tokenizer, source.token_format)


class TokensKind(LaneKind):
    name = "tokens"

    def matches(self, *, pretokenized, chat, images) -> bool:
        return pretokenized and chat is None and images is None

    def decode(self, source: BlockSource) -> Block:
        block = pretokenized_block(source.values, source.token_format, source.where, source.row_group)
        if source.features:
            block.features = {f.name: feature_values(c, f, block, source.token_format, source.where, source.row_group)
                              for f, c in zip(source.features, source.columns)}
        return block


TEXT = register_kind(TextKind())
TOKENS = register_kind(TokensKind())
