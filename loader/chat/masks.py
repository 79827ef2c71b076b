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

Reading that list costs more than the loop (``Encoding.offsets`` builds a Python tuple per
token: ~1.2 us, more than the tokenization itself, measured on 323k chat tokens), so
:meth:`TokenizedChat.loss_mask` asks the encoding only where each span starts and ends
(:func:`token_mask_from_encoding`): for sorted, disjoint spans and offsets that never go
back (what tokenizers produce), the loop above marks exactly the tokens ``first..last`` of each
span, ``first`` the first token holding the span's first character (no earlier token can reach
it) and ``last`` the last token starting before the span's end. Spans that are not sorted and
disjoint, or an edge character no token holds, take the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from loader.stages.tokenizer import TokenizerError


@dataclass(frozen=True)
class TokenizedChat:
    """``input_ids`` (int32) of a render and its ``tokenizers.Encoding`` (character offsets)."""

    input_ids: np.ndarray
    encoding: object

    @property
    def offsets(self) -> Sequence[tuple[int, int]]:
        """The tokenizer's ``(start, end)`` character offsets of every token (a Python list: slow)."""
        return self.encoding.offsets

    def loss_mask(self, spans: Sequence[tuple[int, int]]) -> np.ndarray:
        """uint8 mask, 1 on tokens that overlap ``spans`` by transformers' rule (module docstring)."""
        return token_mask_from_encoding(self.encoding, len(self.input_ids), spans)


def check_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer with truncation or padding switched on (saved into some
    ``tokenizer.json`` files): it would silently cut or pad every conversation."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        raise TokenizerError(
            f"the tokenizer has truncation={tokenizer.truncation} / padding={tokenizer.padding} enabled, which would "
            "cut or pad every conversation; call tokenizer.no_truncation() and tokenizer.no_padding() (or save the "
            "tokenizer.json without them) and use max_tokens= to bound conversation length"
        )


def tokenize_rendered(tokenizer, text: str) -> TokenizedChat:
    """Tokenize a rendered conversation with character offsets (:func:`check_tokenizer` first)."""
    check_tokenizer(tokenizer)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return TokenizedChat(np.array(encoding.ids, dtype=np.int32), encoding)


def tokenize_rendered_batch(tokenizer, texts: Sequence[str]) -> list[TokenizedChat]:
    """:func:`tokenize_rendered` of each text, in one ``encode_batch`` call (same ids and offsets)."""
    check_tokenizer(tokenizer)
    if not texts:
        return []
    return [TokenizedChat(np.array(e.ids, dtype=np.int32), e)
            for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


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


def _sorted_and_disjoint(spans: Sequence[tuple[int, int]]) -> bool:
    return all(start <= end for start, end in spans) and all(
        previous[1] <= following[0] for previous, following in zip(spans, spans[1:]))


def token_mask_from_encoding(encoding, num_tokens: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """:func:`token_mask_from_spans` of the encoding's offsets, from a few offset look-ups per span."""
    mask = np.zeros(num_tokens, dtype=np.uint8)
    if not spans or not num_tokens:
        return mask
    if not _sorted_and_disjoint(spans):
        return token_mask_from_spans(encoding.offsets, spans)
    for start, end in spans:
        first = encoding.char_to_token(start)
        last = encoding.char_to_token(end - 1) if end > 0 else None
        if first is None or last is None:  # an edge no token holds (or past the text): the exact loop
            return token_mask_from_spans(encoding.offsets, spans)
        while last + 1 < num_tokens and encoding.token_to_chars(last + 1)[0] < end:
            last += 1  # the other tokens of a character split across byte tokens, zero-width tokens
        if last >= first:
            mask[first : last + 1] = 1
    return mask


def covered_characters(spans: Sequence[tuple[int, int]], text_length: int) -> int:
    """How many characters of ``[0, text_length)`` lie inside at least one span."""
    covered, reach = 0, 0
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, text_length)
        if end > start:
            covered += end - start
            reach = end
    return covered
