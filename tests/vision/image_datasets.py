"""Small generated image datasets for the job tests: WebDataset tars, Parquet and JSONL with image files."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> str:
    """A tar of ``(member name, bytes)`` in the given order (a WebDataset shard when names share keys)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            archive.addfile(info, io.BytesIO(data))
    return str(path)


def write_jsonl(path: Path, records: Iterable[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return str(path)


def write_parquet(path: Path, columns: dict[str, pa.Array]) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)
