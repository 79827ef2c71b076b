"""Built-in transforms, named in a config by their short name (``function = "drop_regex"``).

=================  ======  ================================================================
name               stage   what it does (args)
=================  ======  ================================================================
identity           any     returns the document unchanged (benchmarks, placeholders)
length_chars       text    drops documents with fewer than ``min`` or more than ``max``
                           characters (code points) of text; either bound may be absent
length_tokens      tokens  the same for the number of ``input_ids`` (without BOS/EOS)
drop_metadata      text    drops documents whose metadata field ``field`` (a --keep-fields
                           value) equals one of ``values``; ``missing = "keep"`` (default)
                           or ``"drop"`` for documents without the field
drop_regex         text    drops documents whose text matches ``pattern`` anywhere
                           (Python ``re.search``); ``ignore_case`` (default false)
truncate_tokens    tokens  keeps the first ``max_tokens`` ids (and feature values) of
                           longer documents
truncate_turns     tokens  chat: keeps a longer conversation up to the end of its last
                           assistant turn (``loss_mask`` run of 1s) that ends within
                           ``max_tokens``; drops it when none does (config ``overlong``)
=================  ======  ================================================================
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional, Sequence

import numpy as np

from loader.transforms.document import Document
from loader.transforms.declare import transform


def _bounds_ok(value: int, minimum: Optional[int], maximum: Optional[int]) -> bool:
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def _check_bounds(name: str, minimum: Optional[int], maximum: Optional[int]) -> None:
    for label, bound in (("min", minimum), ("max", maximum)):
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise ValueError(f"{name}: {label} must be an integer >= 0 or absent (got {bound!r})")
    if minimum is None and maximum is None:
        raise ValueError(f"{name}: give min, max or both")


@transform(stage="any", version="1")
def identity(doc: Document) -> Document:
    return doc


@transform(stage="text", version="1")
def length_chars(doc: Document, min: Optional[int] = None, max: Optional[int] = None) -> Optional[Document]:  # noqa: A002
    _check_bounds("length_chars", min, max)
    return doc if _bounds_ok(len(doc.text or ""), min, max) else None


@transform(stage="tokens", version="1")
def length_tokens(doc: Document, min: Optional[int] = None, max: Optional[int] = None) -> Optional[Document]:  # noqa: A002
    _check_bounds("length_tokens", min, max)
    return doc if _bounds_ok(len(doc.input_ids), min, max) else None


@transform(stage="text", version="1")
def drop_metadata(doc: Document, field: str, values: Sequence[Any], missing: str = "keep") -> Optional[Document]:
    if missing not in ("keep", "drop"):
        raise ValueError(f"drop_metadata: missing must be 'keep' or 'drop' (got {missing!r})")
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"drop_metadata: values must be a list of field values (got {values!r})")
    metadata = doc.metadata
    if field not in metadata or metadata[field] is None:
        return None if missing == "drop" else doc
    return None if metadata[field] in values else doc


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str, ignore_case: bool) -> re.Pattern:
    return re.compile(pattern, re.IGNORECASE if ignore_case else 0)


@transform(stage="text", version="1")
def drop_regex(doc: Document, pattern: str, ignore_case: bool = False) -> Optional[Document]:
    return None if _compiled(pattern, bool(ignore_case)).search(doc.text or "") else doc


@transform(stage="tokens", version="1")
def truncate_tokens(doc: Document, max_tokens: int) -> Document:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError(f"truncate_tokens: max_tokens must be an integer >= 0 (got {max_tokens!r})")
    ids = doc.input_ids
    if len(ids) <= max_tokens:
        return doc
    return doc.replace(input_ids=ids[:max_tokens],
                       features={name: values[:max_tokens] for name, values in doc.features.items()})


@transform(stage="tokens", version="1")
def truncate_turns(doc: Document, max_tokens: int) -> Optional[Document]:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"truncate_turns: max_tokens must be an integer >= 1 (got {max_tokens!r})")
    ids = doc.input_ids
    if len(ids) <= max_tokens:
        return doc
    mask = doc.features.get("loss_mask")
    if mask is None:
        raise ValueError("truncate_turns: the document has no loss_mask (it cuts chat conversations, whose "
                         "assistant turns the mask marks); use truncate_tokens for other documents")
    head = np.asarray(mask[: max_tokens + 1], dtype=np.int8)
    # a turn ends at position p (exclusive) where the mask steps from 1 to 0, or at the cut itself
    # when the conversation goes on past it with the turn's last token at max_tokens - 1
    ends = np.flatnonzero((head[:-1] == 1) & (head[1:] == 0)) + 1
    if not len(ends):
        return None
    cut = int(ends[-1])
    return doc.replace(input_ids=ids[:cut], features={name: values[:cut] for name, values in doc.features.items()})


BUILTINS = ("identity", "length_chars", "length_tokens", "drop_metadata", "drop_regex", "truncate_tokens",
            "truncate_turns")
