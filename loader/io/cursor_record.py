"""The checkpoint record of a lane stream's cursor (:class:`~loader.io.lane_reader.LaneTokenStream`).

State keys::

    epoch, block, offset      the stream position: the ``offset``-th token of block ``block`` (a row
                              group in epoch order) of epoch ``epoch``
    exhausted                 finite data: the stream has ended (then epoch max_epochs, block 0, offset 0)
    transforms (optional)     per transform ``[dropped, changed]`` counters (loader.transforms.lane_counts)
    document (optional)       version 3, text lanes: ``{index, token_start, char_start}``, the document
                              the cursor is in, so that a restore tokenizes from it

Version 3 (the state format's): a version-2 cursor is one without ``document``, restored by
tokenizing its block up to the offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loader.checkpoint.records import RecordContext, RecordType, register_record
from loader.validation import Problems, fields_of, json_bool, json_int, show, type_name

EPOCH = "epoch"
BLOCK = "block"
OFFSET = "offset"
EXHAUSTED = "exhausted"
TRANSFORMS = "transforms"
DOCUMENT = "document"
DOCUMENT_KEYS = ("index", "token_start", "char_start")  # a text cursor's document (version 3)


def cursor_state(epoch: int, block: int, offset: int, exhausted: bool) -> dict:
    """A cursor's state without counters or document (what a plain stream's ``get_state`` is)."""
    return {EPOCH: epoch, BLOCK: block, OFFSET: offset, EXHAUSTED: exhausted}


@dataclass(frozen=True)
class Cursor:
    """A :class:`~loader.io.lane_reader.LaneTokenStream` position, as parsed."""

    epoch: int
    block: int
    offset: int
    exhausted: bool
    transforms: tuple[tuple[int, int], ...] = ()  # per transform (dropped, changed): counters only
    document: Optional[tuple[int, int, int]] = None  # text lanes, version 3: (index, token_start, char_start)


def parse_cursor(raw: Any, path: str, problems: Problems, context: Optional[RecordContext] = None) -> Optional[Cursor]:
    entry = CURSOR.fields(raw, path, problems)
    if entry is None:
        return None
    values = (
        json_int(entry[EPOCH], f"{path}.{EPOCH}", problems),
        json_int(entry[BLOCK], f"{path}.{BLOCK}", problems),
        json_int(entry[OFFSET], f"{path}.{OFFSET}", problems),
        json_bool(entry[EXHAUSTED], f"{path}.{EXHAUSTED}", problems),
    )
    counts = _parse_transform_counts(entry[TRANSFORMS], f"{path}.{TRANSFORMS}", problems) \
        if TRANSFORMS in entry else ()
    document = _parse_document(entry[DOCUMENT], f"{path}.{DOCUMENT}", values[2], values[3], problems) \
        if DOCUMENT in entry else ()
    if None in values or counts is None or document is None:
        return None
    return Cursor(*values, transforms=counts, document=document or None)


def _parse_document(value: Any, path: str, offset: Optional[int], exhausted: Optional[bool],
                    problems: Problems) -> Optional[tuple]:
    """A text cursor's document: ``{index, token_start, char_start}``, starting at or before ``offset``."""
    entry = fields_of(value, path, DOCUMENT_KEYS, problems)
    if entry is None:
        return None
    before = problems.count
    index, token_start, char_start = (json_int(entry[k], f"{path}.{k}", problems) for k in DOCUMENT_KEYS)
    if problems.count > before:
        return None
    if exhausted:
        stream = path.rsplit(".", 1)[0]
        problems.at(path, f"must be absent: an exhausted stream has no document ({stream}.exhausted is true)")
    elif offset is not None and token_start > offset:
        problems.at(f"{path}.token_start", f"must be at or before the cursor's offset {offset} (got {token_start})")
    elif index == 0 and (token_start, char_start) != (0, 0):
        problems.at(path, f"document 0 starts at token 0 and character 0 (got {value})")
    elif index > 0 and token_start == 0 and char_start == 0:
        problems.at(path, f"only document 0 starts at token 0 and character 0 (got {value})")
    else:
        return index, token_start, char_start
    return None


def _parse_transform_counts(value: Any, path: str, problems: Problems) -> Optional[tuple]:
    """A stream's transform counters: a list of ``[dropped, changed]`` pairs of integers >= 0."""
    if not isinstance(value, list):
        problems.at(path, f"must be a list of [dropped, changed] pairs (got {type_name(value)} {show(value)})")
        return None
    pairs = []
    for k, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            problems.at(f"{path}[{k}]", f"must be a [dropped, changed] pair of counts (got {show(pair)})")
            return None
        counts = (json_int(pair[0], f"{path}[{k}][0]", problems), json_int(pair[1], f"{path}[{k}][1]", problems))
        if None in counts:
            return None
        pairs.append(counts)
    return tuple(pairs)


CURSOR = register_record(RecordType(
    name="cursor", version=3, keys=(EPOCH, BLOCK, OFFSET, EXHAUSTED), optional=(TRANSFORMS, DOCUMENT),
    parse=parse_cursor))
