"""``text`` input: the whole file is one document (record index 0); see :mod:`beam_jobs.readers`.

Use JSONL for one document per line.
"""

from __future__ import annotations

from typing import Iterator

from beam_jobs.input_streams import open_stream
from beam_jobs.inputs import InputFile
from beam_jobs.records import (
    UTF8_BOM, RecordConverter, _corrupt_stream_rejection, _guarded, _json_type_name, _ReadFailure, _unreadable,
    register_format,
)


@register_format("text")
def _read_text(input_file: InputFile, converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    def whole_file() -> Iterator[bytes]:
        with open_stream(input_file, converter.spec.storage) as stream:
            yield stream.read()

    corrupt = _corrupt_stream_rejection(input_file, converter)
    if corrupt is not None:
        yield False, corrupt
        return
    for data in _guarded(whole_file()):
        if isinstance(data, _ReadFailure):
            yield False, _unreadable(converter, 0, data.error)
            return
        if data.startswith(UTF8_BOM):
            data = data[len(UTF8_BOM):]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield False, converter.reject(0, "invalid_utf8", f"byte {exc.start}: {exc.reason}", data)
            return
        yield converter.convert({converter.spec.text_field: text}, 0, data)
