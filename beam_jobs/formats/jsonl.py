"""``jsonl`` input: one JSON object per line (plain, gzip or zstd); see :mod:`beam_jobs.readers`.

Lines are decoded as strict UTF-8 here, not by a text wrapper, so one bad line is one
``invalid_utf8`` rejection instead of a failed file. The record index is the 0-based line
number; lines holding only whitespace are not records (skipped, not rejected). A line ends at
``\\n``; a ``\\r`` before it is dropped (CRLF files). A record nested deeper than
:data:`MAX_JSON_DEPTH` arrays/objects is ``malformed_json`` (checked before parsing, so the
outcome never depends on the interpreter's stack depth).
"""

from __future__ import annotations

import json
import re
from typing import Iterator, NamedTuple, Union

import numpy as np

from beam_jobs.input_streams import open_stream
from beam_jobs.inputs import InputFile
from beam_jobs.records import (
    UTF8_BOM, RecordConverter, _corrupt_stream_rejection, _guarded, _json_type_name, _ReadFailure, _unreadable,
    register_format,
)

# Deeper JSON is a malformed_json rejection. Python's parser recurses once per level against
# the interpreter's recursion limit (1000 by default) shared with the caller's stack, so an
# explicit limit well below it makes the outcome the same on every runner; real records
# nest a few levels.
MAX_JSON_DEPTH = 256

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal (unrolled loop)
_JSON_DECODER = json.JSONDecoder()


def json_nesting_depth(line: str) -> int:
    """How many arrays/objects deep ``line`` nests, ignoring brackets inside strings."""
    structure = _JSON_STRING.sub("", line).encode("utf-8", "surrogatepass")
    codes = np.frombuffer(structure, dtype=np.uint8)
    steps = np.isin(codes, (0x5B, 0x7B)).astype(np.int64) - np.isin(codes, (0x5D, 0x7D))
    return int(np.cumsum(steps).max(initial=0))


class LineRejection(NamedTuple):
    """Why a JSONL line is not a record; ``incomplete`` when its bytes are not whole JSON text."""

    reason: str
    detail: str
    incomplete: bool


def parse_jsonl_line(raw_line: bytes) -> Union[dict, LineRejection]:
    """The record on one JSONL line (without its newline), or why it is rejected."""
    try:
        line = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LineRejection("invalid_utf8", f"byte {exc.start}: {exc.reason}", True)
    # Cheap bound first (two C-speed counts); only a line with many brackets is scanned.
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH:
        depth = json_nesting_depth(line)
        if depth > MAX_JSON_DEPTH:
            return LineRejection("malformed_json", f"nested {depth} arrays/objects deep, more than the "
                                 f"limit of {MAX_JSON_DEPTH}", False)
    try:
        record = _JSON_DECODER.decode(line)
    except RecursionError:  # only reachable when the caller's stack is already very deep
        return LineRejection("malformed_json", f"nested too deeply for the JSON parser (limit {MAX_JSON_DEPTH})", False)
    except ValueError as exc:
        return LineRejection("malformed_json", str(exc), True)
    if not isinstance(record, dict):
        return LineRejection("malformed_json",
                             f"a JSONL record must be a JSON object (got {_json_type_name(record)})", False)
    return record


@register_format("jsonl")
def _read_jsonl(input_file: InputFile, converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    def lines() -> Iterator[bytes]:
        with open_stream(input_file, converter.spec.storage) as stream:
            yield from stream

    corrupt = _corrupt_stream_rejection(input_file, converter)
    if corrupt is not None:
        yield False, corrupt
        return
    record_index = -1
    for item in _guarded(lines()):
        if isinstance(item, _ReadFailure):
            yield False, _unreadable(converter, record_index + 1, item.error)
            return
        record_index += 1
        # Only the file's last line can lack its newline (a stream hands out whole lines).
        terminated = item.endswith(b"\n")
        raw_line = item.rstrip(b"\n").rstrip(b"\r")
        if record_index == 0 and raw_line.startswith(UTF8_BOM):
            raw_line = raw_line[len(UTF8_BOM):]
        if not raw_line.strip():
            continue
        parsed = parse_jsonl_line(raw_line)
        if isinstance(parsed, dict):
            yield converter.convert(parsed, record_index, raw_line)
            continue
        if not terminated and parsed.incomplete:
            # The file ends inside a record: it was cut, not written that way.
            yield False, _unreadable(converter, record_index, EOFError(
                f"the file ends inside record {record_index} (its last line has no newline and is not "
                f"whole JSON: {parsed.detail}): the file is truncated"), raw_line)
            return
        yield False, converter.reject(record_index, parsed.reason, parsed.detail, raw_line)
