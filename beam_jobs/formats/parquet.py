"""``parquet`` input: one row per record; see :mod:`beam_jobs.readers`.

Read row group by row group in batches of rows; the record index is the row number in the
file. ``string`` and ``binary`` text columns are checked for UTF-8 per value.
"""

from __future__ import annotations

import json
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from beam_jobs import job_files
from beam_jobs.input_streams import check_parquet_magic
from beam_jobs.inputs import InputFile
from beam_jobs.records import EXCERPT_CHARS, RecordConverter, _guarded, _InvalidUtf8, _ReadFailure, _unreadable, register_format

PARQUET_BATCH_ROWS = 1024


def _utf8_values(column) -> list:
    """Python values of a string/binary Arrow column; bad UTF-8 becomes :class:`_InvalidUtf8`."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            column.validate(full=True)  # checks UTF-8 of the whole batch at C speed
            return column.to_pylist()
        except pa.ArrowInvalid:
            column = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    values = []
    for raw in column.to_pylist():
        if raw is None:
            values.append(None)
            continue
        try:
            values.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            values.append(_InvalidUtf8(raw, exc))
    return values


@register_format("parquet")
def _read_parquet(input_file: InputFile, converter: RecordConverter) -> Iterator[tuple[bool, tuple]]:
    spec = converter.spec
    wanted = [*spec.content_fields, *([spec.id_field] if spec.id_field else []), *spec.keep_fields]

    def batches():
        with job_files.open_read(input_file.path, spec.storage) as handle:
            check_parquet_magic(handle)
            parquet_file = pq.ParquetFile(handle, page_checksum_verification=True)
            present = [n for n in dict.fromkeys(wanted) if n in parquet_file.schema_arrow.names]
            for group in range(parquet_file.num_row_groups):
                promised = parquet_file.metadata.row_group(group).num_rows
                rows = 0
                for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group],
                                                       columns=present):
                    rows += batch.num_rows
                    yield batch
                if rows != promised:
                    raise ValueError(f"row group {group} decoded as {rows} rows but the footer promises "
                                     f"{promised}: a page is damaged")

    record_index = 0
    for batch in _guarded(batches()):
        if isinstance(batch, _ReadFailure):
            yield False, _unreadable(converter, record_index, batch.error)
            return
        columns = {}
        for name in batch.schema.names:
            column = batch.column(name)
            textual = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            binary_text = name == spec.text_field and (
                pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type))
            columns[name] = _utf8_values(column) if textual or binary_text else column.to_pylist()
        for row in range(batch.num_rows):
            record = {name: values[row] for name, values in columns.items()}
            # Parquet has no "absent" value: a null text is reported like a JSON null.
            yield converter.convert(record, record_index, _row_excerpt(record))
            record_index += 1


def _row_excerpt(record: dict) -> str:
    shown = {k: (v.raw if isinstance(v, _InvalidUtf8) else v) for k, v in record.items()}
    return json.dumps(shown, ensure_ascii=False, default=str)[:EXCERPT_CHARS]
