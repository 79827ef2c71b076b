"""The checkpoint record of a token mix's stream (:class:`~loader.stages.token_mixing.MixedTokenStream`).

State keys::

    sources        one cursor record per source (loader.io.cursor_record), in the config's order
    tokens         per source, the tokens drawn in the current window
    current        the source of the open document (-1: none open)
    phase_start    the schedule phase the window belongs to
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loader.checkpoint.records import RecordContext, RecordType, register_record
from loader.io.cursor_record import Cursor, parse_cursor
from loader.validation import Problems, json_int, show

SOURCES = "sources"
TOKENS = "tokens"
CURRENT = "current"
PHASE_START = "phase_start"


def mixed_stream_state(sources: list, tokens: list, current: int, phase_start: int) -> dict:
    return {SOURCES: sources, TOKENS: tokens, CURRENT: current, PHASE_START: phase_start}


@dataclass(frozen=True)
class MixedStream:
    """A :class:`~loader.stages.token_mixing.MixedTokenStream`: one cursor per source plus its window."""

    sources: tuple[Cursor, ...]
    tokens: tuple[int, ...]
    current: int
    phase_start: int


def parse_mixed_stream(raw: Any, path: str, problems: Problems, context: RecordContext) -> Optional[MixedStream]:
    count = len(context.source_names)
    entry = MIXED_STREAM.fields(raw, path, problems)
    if entry is None:
        return None
    for name, kind in ((SOURCES, "cursors"), (TOKENS, "token counts")):
        if not isinstance(entry[name], list) or len(entry[name]) != count:
            problems.at(f"{path}.{name}", f"must be a list of {count} {kind}, one per source (got {show(entry[name])})")
            return None
    cursors = [parse_cursor(item, f"{path}.{SOURCES}[{k}]", problems) for k, item in enumerate(entry[SOURCES])]
    tokens = [json_int(item, f"{path}.{TOKENS}[{k}]", problems) for k, item in enumerate(entry[TOKENS])]
    current = json_int(entry[CURRENT], f"{path}.{CURRENT}", problems, low=-1, high=count - 1)
    phase_start = json_int(entry[PHASE_START], f"{path}.{PHASE_START}", problems)
    if None in cursors or None in tokens or current is None or phase_start is None:
        return None
    return MixedStream(tuple(cursors), tuple(tokens), current, phase_start)


MIXED_STREAM = register_record(RecordType(
    name="mixed_stream", version=1, keys=(SOURCES, TOKENS, CURRENT, PHASE_START), parse=parse_mixed_stream))
