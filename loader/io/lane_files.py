"""The files of one lane: their Parquet handles and footers, row groups, epoch layout and token totals."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.errors import LaneDataError, ZephonError
from loader.io import storage
from loader.io.integrity import FIX, check_footer, verify_local_file
from loader.io.manifest import FileEntry
from loader.io.owner import StreamOwner
from loader.metrics import counting_into
from loader.order.epochs import epoch_blocks, row_order


class LaneFiles:
    """The files of one (source, lane), a member of :class:`~loader.io.lane_reader.LaneTokenStream`
    (``stream.lane_files``) with state of its own.

    One file open at a time (its footer checked against the manifest entry as it opens, its
    reads counted into the owner's I/O counters), the row groups of each file, the order each
    epoch replays them in (:meth:`blocks_of_epoch`), each row group's row order
    (:meth:`row_order`), and the check that a file's row groups hold the manifest's token total
    (:meth:`note_group_tokens`). Called once per block, never per sequence.
    """

    def __init__(self, *, files: Sequence[FileEntry], dataset_path: str, storage_options: storage.StorageOptions,
                 owner: StreamOwner, seed: int, source_name: str, lane_id: int) -> None:
        self.files = files
        self.dataset_path = dataset_path
        self.storage_options = storage_options
        self.owner = owner
        self.seed, self.source_name, self.lane_id = seed, source_name, lane_id
        self._row_groups: dict[int, int] = {}
        # Tokens of each row group read so far, per file, until the file's total is checked.
        self._file_group_tokens: dict[int, dict[int, int]] = {}
        self._tokens_checked: set[int] = set()
        self._epoch_blocks: dict[int, list[tuple[int, int]]] = {}
        self._open_file: Optional[tuple[int, pq.ParquetFile, object]] = None

    def num_row_groups(self, file_ordinal: int) -> int:
        if file_ordinal not in self._row_groups:
            entry = self.files[file_ordinal]
            if entry.row_groups > 0:
                self._row_groups[file_ordinal] = entry.row_groups
            else:
                self._row_groups[file_ordinal] = self.parquet(file_ordinal).metadata.num_row_groups
        return self._row_groups[file_ordinal]

    def blocks_of_epoch(self, epoch: int) -> list[tuple[int, int]]:
        """``(file_ordinal, row_group)`` pairs in the order epoch ``epoch`` replays them."""
        if epoch not in self._epoch_blocks:
            if len(self._epoch_blocks) > 2:
                self._epoch_blocks.clear()
            row_groups = [self.num_row_groups(f) for f in range(len(self.files))]
            self._epoch_blocks[epoch] = epoch_blocks(self.seed, self.source_name, self.lane_id, epoch, row_groups)
        return self._epoch_blocks[epoch]

    def parquet(self, file_ordinal: int) -> pq.ParquetFile:
        if self._open_file is None or self._open_file[0] != file_ordinal:
            self.close()
            entry = self.files[file_ordinal]
            path = storage.join(self.dataset_path, entry.path)
            with counting_into(self.owner.io):  # the cache's hits and misses (loader.metrics)
                handle = storage.open_lane_file(self.dataset_path, entry, self.storage_options)
            try:
                if self.storage_options.verify_local_files and not storage.is_remote(path):
                    verify_local_file(path, handle, entry)
                # pre_buffer (pyarrow's default) sends every local row-group read through
                # Arrow's I/O thread pool with an fadvise first: 150-350 us per read for
                # nothing when the file is in the page cache (bench/HISTORY.md, "Token column
                # codec and lane file access"). Remote files keep it: it coalesces ranged reads.
                parquet = pq.ParquetFile(handle, page_checksum_verification=True,
                                         pre_buffer=storage.is_remote(self.dataset_path))
                check_footer(parquet.metadata, entry, path)
            except BaseException as exc:
                handle.close()  # pyarrow closes only sources it opened itself
                if isinstance(exc, ZephonError) or not isinstance(exc, Exception):
                    raise  # already names the file and the fix (a 403 is not corruption), or Ctrl-C
                # Whatever pyarrow raises on bad bytes (ArrowInvalid, OSError, ...) names the file.
                raise LaneDataError(
                    f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc}); it is corrupt "
                    f"or truncated: {FIX}"
                ) from exc
            self._open_file = (file_ordinal, parquet, handle)
        return self._open_file[1]

    def close(self) -> None:  # also on the read-ahead thread, which must not settle itself
        if self._open_file is not None:
            _, parquet, handle = self._open_file
            parquet.close()
            handle.close()  # pyarrow closes only sources it opened itself
            self._open_file = None

    def row_order(self, epoch: int, file_ordinal: int, row_group: int, rows: int) -> np.ndarray:
        """The order epoch ``epoch`` replays the rows of a row group in (int64)."""
        return row_order(self.seed, self.source_name, self.lane_id, epoch, file_ordinal, row_group, rows)

    @staticmethod
    def extra_columns(parquet: pq.ParquetFile, row_group: int, names, indices) -> dict:
        """Columns of a row group the transforms asked for, in the block's (epoch) row order."""
        table = parquet.read_row_group(row_group, columns=list(names), use_threads=False)
        columns = {n: c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for n, c in zip(names, table.columns)}
        return columns if indices is None else {n: pc.take(c, indices) for n, c in columns.items()}

    def note_group_tokens(self, file_ordinal: int, row_group: int, tokens: int) -> None:
        """Once every row group of a file has been read, its tokens must be the manifest's."""
        if file_ordinal in self._tokens_checked:
            return
        seen = self._file_group_tokens.setdefault(file_ordinal, {})
        seen[row_group] = tokens
        if len(seen) < self.num_row_groups(file_ordinal):
            return
        entry = self.files[file_ordinal]
        total = sum(seen.values())
        del self._file_group_tokens[file_ordinal]
        self._tokens_checked.add(file_ordinal)
        if entry.tokens is not None and total != entry.tokens:
            raise LaneDataError(
                f"{storage.join(self.dataset_path, entry.path)}: its {len(seen)} row groups hold {total} tokens, "
                f"the manifest says {entry.tokens}: the file or the manifest is corrupt; {FIX}"
            )
