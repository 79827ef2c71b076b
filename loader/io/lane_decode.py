"""One row group of a lane file read and decoded into a block: columns, replay order, tombstones, transforms."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from loader.errors import LaneDataError, ZephonError
from loader.io import storage
from loader.io.blocks import Block
from loader.io.integrity import FIX, check_row_group
from loader.io.manifest import CONVERSATION_COLUMN, TOMBSTONE_COLUMN
from loader.kinds.base import BlockSource
from loader.metrics import note_row_group_read
from loader.transforms.rows import LazyColumns, apply_transforms, tombstone_rows, with_tombstones


class LaneBlockDecoder:
    """A base of :class:`~loader.io.lane_reader.LaneTokenStream`: a row group as a block.

    The lane kind (``kind``) decodes the columns; the replay order of the epoch, the
    tombstones of ``zephon shard --transform`` and the source's transforms are applied here.
    """

    def _read_block(self, epoch: int, file_ordinal: int, row_group: int, order: Optional[np.ndarray] = None) -> Block:
        """``order``: the row order of ``epoch`` > 0 if already computed (else computed here).

        Errors name the file and row group; on a read-ahead thread they travel in the read's
        future and are raised to whoever takes the block (in a worker process, inside the
        ``WorkerError`` that carries the worker's traceback).
        """
        entry = self.files[file_ordinal]
        path = storage.join(self.dataset_path, entry.path)
        column = "input_ids" if self.pretokenized else CONVERSATION_COLUMN if self.chat is not None else "text"
        try:
            parquet = self.lane_files.parquet(file_ordinal)
            # One column: pyarrow's thread pool parallelises across columns, so for us it is
            # only a hand-off (and more threads per worker process); ~8% less CPU without.
            columns = [column] + [f.column for f in self.features] + list(self._kind_columns) + (
                [TOMBSTONE_COLUMN] if self.tombstone_transforms else [])  # last: popped below
            table = parquet.read_row_group(row_group, columns=columns, use_threads=False)
            note_row_group_read(parquet.metadata.row_group(row_group), columns, self.owner.io)  # loader.metrics
            # combine_chunks copies even a single chunk
            values, *feature_columns = [c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in table.columns]
            check_row_group(len(values), parquet.metadata, row_group, path)
            self._group_rows[(file_ordinal, row_group)] = len(values)
            if epoch > 0 and (order is None or len(order) != len(values)):
                order = self.lane_files.row_order(epoch, file_ordinal, row_group, len(values))
            rows = order if epoch > 0 else None  # the rows in replay order (None: all, as stored)
            tombstones = None
            if self.tombstone_transforms:  # skipped as online drops, in the same replay order
                rows, tombstones = tombstone_rows(feature_columns.pop(), rows, self.tombstone_transforms, path,
                                                  row_group)
            if rows is not None:
                # Arrow's take copies the rows in C++ without the GIL (on the read-ahead thread a
                # Python loop over the rows would stall the trainer's thread). Indices from the
                # buffer: pa.array(ndarray) imports pandas when it is installed, a fraction of a
                # second on the first call, paid by a restore's first batch.
                indices = pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])
                values = pc.take(values, indices)
                feature_columns = [pc.take(c, indices) for c in feature_columns]
            if self.transforms is not None:  # key, metadata (...) columns: read if a function asks
                transform_columns = LazyColumns(
                    lambda names: self.lane_files.extra_columns(parquet, row_group, names, indices if rows is not None else None),
                    self._transform_columns)
            counts = None
            if self.transforms is not None and not self.pretokenized and self.chat is None:  # text: before tokenization
                texts = values.to_pylist()
                kept, counts = apply_transforms(self.transforms, transform_columns, texts=texts)
                if kept is not texts:
                    values = pa.array(kept, pa.string())
            block = self.kind.decode(BlockSource(
                values=values, columns=feature_columns, column_names=self._kind_columns, features=self.features,
                token_format=self.token_format, tokenizer=None if self.pretokenized else self.tokenizer, where=path,
                row_group=row_group, chat=self.chat, images=self.images, epoch=epoch,
                block_of=lambda: self.blocks_of_epoch(epoch).index((file_ordinal, row_group)), owner=self.owner))
            if self.chat is not None and self.transforms is not None:  # around the render (loader.chat.block)
                block.transform(self.transforms, transform_columns)
                counts = block.transform_counts
            if not self.pretokenized:
                block.transform_counts = with_tombstones(tombstones, counts, self.transforms)
                return block  # text: the manifest has no token totals to check against
        except ZephonError:
            raise  # already names the file (a StorageError also says what to do about storage)
        except Exception as exc:  # whatever pyarrow or numpy raise on bad bytes
            raise LaneDataError(
                f"{path}: row group {row_group} cannot be read ({type(exc).__name__}: {exc}); the file is "
                f"corrupt: {FIX}"
            ) from exc
        documents = len(block.doc_starts) - 1
        self.lane_files.note_group_tokens(file_ordinal, row_group, len(block.tokens) - self.token_format.extra * documents)
        counts = None
        if self.transforms is not None:  # pre-tokenized: on the ids and features, after the checks
            block, counts = apply_transforms(self.transforms, transform_columns, block=block,
                                             token_format=self.token_format)
        if self.counting:
            block.transform_counts = with_tombstones(tombstones, counts, self.transforms)
        return block
