"""From rendered text and assistant character spans to ``input_ids`` and a per-token loss mask.

The text is tokenized with a ``tokenizers.Tokenizer`` without special tokens (the template
writes them; ``apply_chat_template`` also tokenizes with ``add_special_tokens=False``). A token
is supervised (mask 1) when its character offsets overlap an assistant span, by the rule of
``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)``
(``tokenization_utils_base.py``): one pass over tokens and spans in order::

    span = 0
    for each token (start, end):
        while span < len(spans) and start >= spans[span].end: span += 1    # span is behind
        if span == len(spans): stop                                          # no span left
        if end > spans[span].start: mask = 1                                 # overlap

So a token that straddles a span edge (``"\\nHello"`` after ``"assistant"``) is supervised,
and so are both tokens of a character split across byte tokens. The loop runs on the offsets
list the tokenizer returns: cheaper than converting it to an array (measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from loader.stages.tokenizer import TokenizerError


@dataclass(frozen=True)
class TokenizedChat:
    """``input_ids`` (int32) and ``offsets`` (the tokenizer's ``(start, end)`` character offsets) of a render."""

    input_ids: np.ndarray
    offsets: Sequence[tuple[int, int]]


def tokenize_rendered(tokenizer, text: str) -> TokenizedChat:
    """Tokenize a rendered conversation with character offsets.

    A tokenizer with truncation or padding switched on (saved into some ``tokenizer.json``
    files) would silently cut or pad every conversation, so it is refused.
    """
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        raise TokenizerError(
            f"the tokenizer has truncation={tokenizer.truncation} / padding={tokenizer.padding} enabled, which would "
            "cut or pad every conversation; call tokenizer.no_truncation() and tokenizer.no_padding() (or save the "
            "tokenizer.json without them) and use max_tokens= to bound conversation length"
        )
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return TokenizedChat(np.array(encoding.ids, dtype=np.int32), encoding.offsets)


def token_mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 mask, 1 on tokens that overlap ``spans`` by transformers' rule (module docstring)."""
    mask = bytearray(len(offsets))
    if not spans:
        return np.frombuffer(mask, dtype=np.uint8).copy()
    span_index = 0
    span_start, span_end = spans[0]
    for token_index, (token_start, token_end) in enumerate(offsets):
        while token_start >= span_end:  # this span is behind the token: move to the next
            span_index += 1
            if span_index == len(spans):
                return np.frombuffer(mask, dtype=np.uint8).copy()
            span_start, span_end = spans[span_index]
        if token_end > span_start:
            mask[token_index] = 1
    return np.frombuffer(mask, dtype=np.uint8).copy()


def covered_characters(spans: Sequence[tuple[int, int]], text_length: int) -> int:
    """How many characters of ``[0, text_length)`` lie inside at least one span."""
    covered, reach = 0, 0
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, text_length)
        if end > start:
            covered += end - start
            reach = end
    return covered
