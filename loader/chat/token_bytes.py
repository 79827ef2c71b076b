"""Where each token of a render ends, from its ids alone, for byte-level BPE tokenizers.

``Tokenizer.encode_batch`` (with character offsets) costs about a third more than
``encode_batch_fast`` (none) on chat renders, measured: every string gets a byte-to-character
map and every token an offsets tuple. The loss mask needs the offsets only to compare tokens
with the assistant spans, and for one family of tokenizers (GPT-2, Llama 3, Qwen, the shipped
one) the offsets follow from the ids:

- no normalizer (the text the tokens cover is the text given);
- pre-tokenizers that keep every character (``ByteLevel`` without ``add_prefix_space``,
  ``Split`` / ``Punctuation`` whose behaviour is not ``Removed``, ``Digits``): the pieces tile
  the text, and ``ByteLevel`` turns each character into one symbol per UTF-8 byte, each
  aligned to the whole character;
- a ``BPE`` model without byte fallback, subword prefix / suffix or dropout, whose vocabulary
  strings are made of ``ByteLevel`` symbols (one per byte), and added tokens without
  ``lstrip`` / ``rstrip`` (a match is its content, nothing around it);
- a post-processor that leaves offsets alone when it adds no special tokens (none,
  ``ByteLevel`` with ``trim_offsets`` off, ``TemplateProcessing``, or a ``Sequence`` of them).

Then the tokens tile the text's UTF-8 bytes in order, token ``i`` covering
``[end[i-1], end[i])`` with ``end = cumsum(byte length of each id)``, and the character offsets
``encode`` reports are that byte range widened to whole characters. :func:`byte_lengths`
gives the table of byte lengths per id (``None`` for any other tokenizer: it keeps
``encode_batch``); an id whose length is not known for sure (a vocabulary string that is
not byte-level symbols, an added token whose content disagrees with the vocabulary's string
for its id, the unknown token) gets ``-1``, and a render that contains one, or whose lengths
do not add up to its UTF-8 length, is tokenized again with offsets
(:func:`loader.chat.masks.tokenize_rendered_batch`).
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from loader.caches import BoundedCache

# Pre-tokenizers that never drop a character (with a behaviour other than "Removed").
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Split", "Punctuation", "Digits")
# Post-processors that add nothing and keep offsets with add_special_tokens=False.
_OFFSET_KEEPING_POST_PROCESSORS = ("TemplateProcessing",)

# id(tokenizer) -> (tokenizer, signature, table or None): the tokenizer is kept to tell a reused id apart
_tables: BoundedCache[tuple] = BoundedCache(16)


def byte_level_symbols() -> dict[str, int]:
    """``ByteLevel``'s alphabet: the symbol of each byte (GPT-2's ``bytes_to_unicode``), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[chr(byte)] = byte
        else:
            symbols[chr(256 + extra)] = byte
            extra += 1
    return symbols


def _keeps_characters(pre_tokenizer: Optional[dict]) -> tuple[bool, bool]:
    """(every piece kept, a ByteLevel seen) for a pre-tokenizer config."""
    if pre_tokenizer is None:
        return True, False
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        results = [_keeps_characters(step) for step in pre_tokenizer.get("pretokenizers") or ()]
        return all(keeps for keeps, _ in results), any(byte_level for _, byte_level in results)
    if kind not in _KEEPING_PRE_TOKENIZERS or pre_tokenizer.get("behavior") == "Removed":
        return False, False
    if kind == "ByteLevel":
        return not pre_tokenizer.get("add_prefix_space", True), True
    return True, False


def _keeps_offsets(post_processor: Optional[dict]) -> bool:
    if post_processor is None:
        return True
    kind = post_processor.get("type")
    if kind == "Sequence":
        return all(_keeps_offsets(step) for step in post_processor.get("processors") or ())
    if kind == "ByteLevel":
        return post_processor.get("trim_offsets") is False
    return kind in _OFFSET_KEEPING_POST_PROCESSORS


def table_from_config(config: dict) -> Optional[np.ndarray]:
    """int64 UTF-8 byte length of each token id (``-1``: not known for sure), or ``None`` when
    the tokenizer (its ``tokenizer.json`` as a dict) is not of the family the module describes."""
    model = config.get("model") or {}
    keeps, byte_level = _keeps_characters(config.get("pre_tokenizer"))
    if not (config.get("normalizer") is None and keeps and byte_level and _keeps_offsets(config.get("post_processor"))
            and model.get("type") == "BPE" and not model.get("byte_fallback") and not model.get("dropout")
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
            and isinstance(model.get("vocab"), dict)):
        return None
    added = config.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    vocab = model["vocab"]
    size = 1 + max([*vocab.values(), *(token["id"] for token in added), -1])
    table = np.full(size, -1, dtype=np.int64)
    symbols = byte_level_symbols()
    for text, token_id in vocab.items():
        if all(symbol in symbols for symbol in text):
            table[token_id] = len(text)
    for token in added:
        length = len(token["content"].encode("utf-8"))
        in_vocab = table[token["id"]]
        # An id the vocabulary spells differently: which text produced it is not known.
        table[token["id"]] = length if in_vocab in (-1, length) and length > 0 else -1
    unknown = model.get("unk_token")
    if unknown is not None and unknown in vocab:
        table[vocab[unknown]] = -1
    return table


def _signature(tokenizer) -> tuple:
    # What would make a cached table stale: added tokens, or a component replaced in place.
    parts = [tokenizer.get_vocab_size(with_added_tokens=False), tokenizer.get_vocab_size(with_added_tokens=True)]
    for component in (tokenizer.normalizer, tokenizer.pre_tokenizer, tokenizer.post_processor):
        parts.append(None if component is None else component.__getstate__())
    return tuple(parts)


def byte_lengths(tokenizer) -> Optional[np.ndarray]:
    """:func:`table_from_config` of a ``tokenizers.Tokenizer``, cached per tokenizer object
    (and rebuilt if its vocabulary size or normalizer / pre-tokenizer / post-processor change)."""
    signature = _signature(tokenizer)
    cached = _tables.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer and cached[1] == signature:
        return cached[2]
    table = table_from_config(json.loads(tokenizer.to_str()))
    _tables.put(id(tokenizer), (tokenizer, signature, table))
    return table


def utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def char_byte_starts(text: str) -> np.ndarray:
    """int64 ``[n + 1]``: the UTF-8 byte at which each character starts, then the total."""
    starts = np.zeros(len(text) + 1, dtype=np.int64)
    if text.isascii():
        starts[1:] = np.arange(1, len(text) + 1)
        return starts
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    np.cumsum(1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000), out=starts[1:])
    return starts
