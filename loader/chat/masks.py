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

Byte-level BPE tokenizers (:mod:`loader.chat.token_bytes`) skip the offsets altogether: the
renders go through ``encode_batch_fast`` (the same ids, a third cheaper) and each token's
UTF-8 byte range follows from its ids. A token's character offsets are its byte range widened
to whole characters, and a span's edges are character (so byte) boundaries, so for a span
``[s, e)`` at bytes ``[S, E)`` the loop's overlap test ``start < e and end > s`` reads
``byte_start < E and byte_end > S``: the tokens ``first..last`` are two ``searchsorted``
look-ups (:func:`token_mask_from_byte_ends`), the same mask bit for bit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from loader.errors import TokenizerError
from loader.chat.token_bytes import byte_lengths, char_byte_starts, utf8_length


@dataclass(frozen=True)
class TokenizedChat:
    """``input_ids`` (int32) of a render, and where its tokens are: the ``tokenizers.Encoding``
    (character offsets), or for a byte-level BPE tokenizer the render's ``text`` and the UTF-8
    byte end of each token (``token_ends``, int64; see the module docstring)."""

    input_ids: np.ndarray
    encoding: object = None
    text: Optional[str] = None
    token_ends: Optional[np.ndarray] = None

    @property
    def offsets(self) -> Sequence[tuple[int, int]]:
        """The tokenizer's ``(start, end)`` character offsets of every token (a Python list: slow)."""
        if self.encoding is not None:
            return self.encoding.offsets
        return char_offsets_from_byte_ends(self.text, self.token_ends)

    def loss_mask(self, spans: Sequence[tuple[int, int]]) -> np.ndarray:
        """uint8 mask, 1 on tokens that overlap ``spans`` by transformers' rule (module docstring)."""
        if self.encoding is not None:
            return token_mask_from_encoding(self.encoding, len(self.input_ids), spans)
        return token_mask_from_byte_ends(self.text, self.token_ends, spans)


def ids_array(ids: list[int]) -> np.ndarray:
    """int32 array of an ``Encoding.ids`` list. ``np.fromiter`` with the count: ~30% fewer
    instructions than ``np.array``, which first discovers the list's dtype and shape element by
    element (valgrind, 1,000-id lists; the conversion was ~5% of online chat's instructions)."""
    return np.fromiter(ids, dtype=np.int32, count=len(ids))


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
    return TokenizedChat(ids_array(encoding.ids), encoding)


def tokenize_rendered_batch(tokenizer, texts: Sequence[str]) -> list[TokenizedChat]:
    """:func:`tokenize_rendered` of each text, in one batched call (same ids, same masks).

    A byte-level BPE tokenizer (:func:`loader.chat.token_bytes.byte_lengths`) takes
    ``encode_batch_fast`` and byte ends from the ids; a render with an id of unsure length,
    or whose lengths do not add up to its UTF-8 length, is encoded again with offsets. Any
    other tokenizer takes ``encode_batch`` (offsets). The two halves, :func:`encode_renders`
    (the tokenizer's call, which releases the GIL) and :func:`tokenized_renders`, may run on
    different threads."""
    return tokenized_renders(tokenizer, texts, encode_renders(tokenizer, texts))


def encode_renders(tokenizer, texts: Sequence[str]) -> list:
    """The batched tokenizer call of :func:`tokenize_rendered_batch`: its ``tokenizers.Encoding``
    of each text (:func:`check_tokenizer` first)."""
    check_tokenizer(tokenizer)
    if not texts:
        return []
    if byte_lengths(tokenizer) is None:
        return tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)


def tokenized_renders(tokenizer, texts: Sequence[str], encodings: Sequence) -> list[TokenizedChat]:
    """:func:`tokenize_rendered_batch` of ``texts`` from their :func:`encode_renders` ``encodings``.

    Byte-level BPE: the ids of all renders are looked up in one pass (one array of ids, one of
    byte lengths, one cumulative sum); each render then takes views of them. Per render, numpy
    calls on ~1,000 ids cost more than the work (~90 us a conversation, 12% of online chat)."""
    lengths = byte_lengths(tokenizer) if texts else None
    if lengths is None:
        return [TokenizedChat(ids_array(e.ids), e) for e in encodings]
    id_lists = [e.ids for e in encodings]
    counts = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    starts = np.zeros(len(id_lists) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(starts[-1]))
    token_lengths = lengths.take(flat, mode="clip")
    # A render holding an id past the table or of unsure length (0) asks the tokenizer (rare:
    # the table covers a byte-level BPE tokenizer's whole vocabulary).
    unsure = (flat >= len(lengths)) | (token_lengths <= 0)
    if unsure.any():
        unsure_before = np.concatenate(([0], np.cumsum(unsure)))[starts]
        sure = (np.diff(unsure_before) == 0).tolist()
    else:
        sure = [True] * len(texts)
    ends = np.cumsum(token_lengths)
    bytes_before = np.concatenate(([0], ends))[starts].tolist()  # bytes of the renders before each
    bounds = starts.tolist()
    tokenized = []
    for index, text in enumerate(texts):
        first, last = bounds[index], bounds[index + 1]
        if first == last and not text:
            tokenized.append(TokenizedChat(flat[first:last], text=text, token_ends=np.zeros(0, np.int64)))
            continue
        base = bytes_before[index]
        if sure[index] and bytes_before[index + 1] - base == utf8_length(text) and last > first:
            tokenized.append(TokenizedChat(flat[first:last], text=text, token_ends=ends[first:last] - base))
        else:  # not sure where this render's tokens are: ask the tokenizer
            tokenized.append(tokenize_rendered(tokenizer, text))
    return tokenized


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


def token_mask_from_byte_ends(text: str, token_ends: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """:func:`token_mask_from_spans` of tokens that tile ``text``'s UTF-8 bytes, token ``i``
    ending at ``token_ends[i]`` (module docstring: two look-ups per span)."""
    count = len(token_ends)
    mask = np.zeros(count, dtype=np.uint8)
    if not spans or not count:
        return mask
    if not _sorted_and_disjoint(spans):
        return token_mask_from_spans(char_offsets_from_byte_ends(text, token_ends), spans)
    # Past the text no token reaches, as in the loop; the edges are sorted, so one pass finds their bytes.
    edges = [min(edge, len(text)) for span in spans for edge in span]
    if not text.isascii():
        at_char = at_byte = 0
        for index, edge in enumerate(edges):
            at_byte += len(text[at_char:edge].encode("utf-8"))
            at_char, edges[index] = edge, at_byte
    # Token i spans bytes [token_ends[i - 1], token_ends[i]): the tokens with an end after S,
    # up to those with a start before E (token 0 starts at 0, token i > 0 at token_ends[i - 1]).
    firsts = token_ends.searchsorted(edges[0::2], side="right").tolist()
    lasts = token_ends.searchsorted(edges[1::2], side="left").tolist()
    for first, last, end in zip(firsts, lasts, edges[1::2]):
        stop = min(last + 1, count) if end > 0 else 0
        if stop > first:
            mask[first:stop] = 1
    return mask


def char_offsets_from_byte_ends(text: str, token_ends: np.ndarray) -> list[tuple[int, int]]:
    """The character offsets ``encode`` reports for tokens that tile ``text``'s UTF-8 bytes:
    each token's byte range widened to whole characters."""
    if not len(token_ends):
        return []
    token_starts = np.concatenate(([0], token_ends[:-1]))
    if text.isascii():
        return list(zip(token_starts.tolist(), token_ends.tolist()))
    char_starts = char_byte_starts(text)
    first_chars = np.searchsorted(char_starts, token_starts, side="right") - 1
    last_chars = np.searchsorted(char_starts, token_ends - 1, side="right") - 1
    return list(zip(first_chars.tolist(), (last_chars + 1).tolist()))


def covered_characters(spans: Sequence[tuple[int, int]], text_length: int) -> int:
    """How many characters of ``[0, text_length)`` lie inside at least one span."""
    covered, reach = 0, 0
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, text_length)
        if end > start:
            covered += end - start
            reach = end
    return covered
