"""Lane streams for ``zephon audit``: document lengths instead of tokens, and each token's origin.

:class:`ProvenanceStream` is a :class:`~loader.io.lane_reader.LaneTokenStream` whose blocks are
built from a row group's *lengths* (the ``num_tokens`` column of pre-tokenized lane files,
4 bytes per document) instead of its ``input_ids``: the tokens are zeros, and two audit-only
per-token features (:data:`loader.stages.features.FEATURES`) say where every token comes from:

* ``audit_document``: ``epoch << 40 | lane_row``, ``lane_row`` being the document's row in the
  lane's epoch-0 order (rows of the earlier files, then of the earlier row groups, then the
  row in its group, as the Beam job wrote them);
* ``audit_offset``: the token's offset in its wrapped document (``[BOS] ids [EOS]`` as
  configured).

Packers never look at token values, only at lengths and document starts, so a lane built on
these streams (``Lane.stream_class``) cuts, carries and bins exactly as the training lane
does, and the features travel with the tokens through cuts, carries, best-fit bins and
token mixing like any feature. A training loader never builds these streams.

Reads: every row group is read at most once per stream, one column (``num_tokens``); text
lanes (no ``num_tokens``) read ``text`` and tokenize the whole row group for its lengths.
:attr:`ProvenanceStream.reads` records every read, for the audit's report and its tests.

A best-fit checkpoint's open bins name each piece by the stream cursor of its first token
(``piece_origins``, state version 2); :meth:`ProvenanceStream.piece_features` turns one into
the piece's provenance features, reading the lengths of that one row group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from loader.errors import LaneDataError, OriginError
from loader.io import storage
from loader.io.blocks import Block, tokenize_documents
from loader.io.integrity import FIX, check_row_group
from loader.io.manifest import TOMBSTONE_COLUMN
from loader.io.lane_reader import LaneTokenStream
from loader.transforms.chain import TransformCounts
from loader.transforms.rows import with_tombstones

AUDIT_FEATURES = ("audit_document", "audit_offset")
EPOCH_SHIFT = 40  # audit_document = epoch << EPOCH_SHIFT | lane_row
ROW_MASK = (1 << EPOCH_SHIFT) - 1


@dataclass
class ReadLog:
    """Row-group reads of the audit, as ``(source, lane, file path, row group, column)``."""

    reads: list[tuple[str, int, str, int, str]] = field(default_factory=list)

    def note(self, source: str, lane: int, path: str, row_group: int, column: str) -> None:
        self.reads.append((source, lane, path, row_group, column))

    def count(self, column: Optional[str] = None) -> int:
        return sum(1 for r in self.reads if column is None or r[4] == column)


@dataclass(frozen=True)
class DocumentLocation:
    """Where a document of a lane lives: its file, row group and row (in the group and file)."""

    file_ordinal: int
    path: str  # relative to the dataset directory
    row_group: int
    row_in_group: int
    row_in_file: int


class ProvenanceStream(LaneTokenStream):
    """A lane stream of lengths and provenance features (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.features = ()  # no lane-file feature columns are read
        # Its blocks are built from lengths, not TextBlocks: a text cursor's document is not
        # needed to restore one (and the states the audit reports come from the lane files).
        self.resumes_at_document = False
        self.reads = ReadLog()
        self._origin_blocks: dict[tuple[int, int], Block] = {}  # blocks of resolved bin pieces (piece_features)
        self._lengths: dict[tuple[int, int], np.ndarray] = {}
        self._tombstones: dict[tuple[int, int], np.ndarray] = {}  # per offline transform, of a row group
        self._group_row_starts: dict[int, np.ndarray] = {}
        file_rows = [entry.rows for entry in self.files]
        self._file_row_starts = np.concatenate([[0], np.cumsum(file_rows)]).astype(np.int64)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return AUDIT_FEATURES

    # -- lengths -----------------------------------------------------------------------
    def lengths(self, file_ordinal: int, row_group: int) -> np.ndarray:
        """Token ids per document of a row group (epoch-0 row order), read once; -1 for the
        tombstones of ``zephon shard --transform`` (rows the training stream skips)."""
        key = (file_ordinal, row_group)
        if key not in self._lengths:
            entry = self.files[file_ordinal]
            path = storage.join(self.dataset_path, entry.path)
            column = "num_tokens" if self.pretokenized else "text"
            parquet = self.lane_files.parquet(file_ordinal)
            try:
                values = parquet.read_row_group(row_group, columns=[column], use_threads=False).column(0)
            except Exception as exc:  # whatever pyarrow raises on bad bytes, or a missing column
                raise LaneDataError(f"{path}: row group {row_group}: column {column!r} cannot be read "
                                    f"({type(exc).__name__}: {exc}); {FIX}") from exc
            self.reads.note(self.source_name, self.lane_id, entry.path, row_group, column)
            check_row_group(len(values), parquet.metadata, row_group, path)
            if self.pretokenized:
                lengths = np.asarray(values.to_pylist(), dtype=np.int64)  # small: one int per document
            else:
                texts = [t or "" for t in values.to_pylist()]
                lengths = tokenize_documents(self.tokenizer, texts)[1]
            if self.tombstone_transforms:  # dropped offline: no document at all (lane_reader skips them)
                dropped = parquet.read_row_group(row_group, columns=[TOMBSTONE_COLUMN], use_threads=False).column(0)
                dropped_by = np.asarray(dropped.to_pylist(), dtype=np.int64)
                lengths[dropped_by >= 0] = -1
                self._tombstones[key] = np.bincount(dropped_by[dropped_by >= 0],
                                                    minlength=len(self.tombstone_transforms))
            self._lengths[key] = lengths
        return self._lengths[key]

    def block_tokens(self, file_ordinal: int, row_group: int) -> int:
        """Wrapped tokens of a row group (what a block of it holds)."""
        lengths = self.lengths(file_ordinal, row_group)
        lengths = lengths[lengths >= 0]
        return int(lengths.sum()) + self.token_format.extra * len(lengths)

    # -- where documents live -----------------------------------------------------------
    def _row_starts(self, file_ordinal: int) -> np.ndarray:
        if file_ordinal not in self._group_row_starts:
            metadata = self.lane_files.parquet(file_ordinal).metadata
            rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._group_row_starts[file_ordinal] = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        return self._group_row_starts[file_ordinal]

    def lane_row(self, file_ordinal: int, row_group: int, row_in_group: int) -> int:
        return int(self._file_row_starts[file_ordinal] + self._row_starts(file_ordinal)[row_group] + row_in_group)

    def locate(self, lane_row: int) -> DocumentLocation:
        """The file, row group and row of the document at ``lane_row`` (epoch-0 order)."""
        file_ordinal = int(np.searchsorted(self._file_row_starts, lane_row, side="right")) - 1
        row_in_file = lane_row - int(self._file_row_starts[file_ordinal])
        starts = self._row_starts(file_ordinal)
        row_group = int(np.searchsorted(starts, row_in_file, side="right")) - 1
        return DocumentLocation(file_ordinal, self.files[file_ordinal].path, row_group,
                                row_in_file - int(starts[row_group]), row_in_file)

    # -- blocks ------------------------------------------------------------------------
    def _read_block(self, epoch: int, file_ordinal: int, row_group: int, order: Optional[np.ndarray] = None) -> Block:
        lengths = self.lengths(file_ordinal, row_group)
        rows = np.arange(len(lengths), dtype=np.int64)
        if epoch > 0:  # the row order the training stream replays this epoch in
            rows = self.lane_files.row_order(epoch, file_ordinal, row_group, len(lengths)).astype(np.int64)
        rows = rows[lengths[rows] >= 0]  # tombstones out (see lengths)
        wrapped = lengths[rows] + self.token_format.extra
        doc_starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(wrapped, out=doc_starts[1:])
        total = int(doc_starts[-1])
        first_row = self.lane_row(file_ordinal, row_group, 0)
        documents = (epoch << EPOCH_SHIFT) | (first_row + rows)
        offsets = np.arange(total, dtype=np.int64) - np.repeat(doc_starts[:-1], wrapped)
        block = Block(tokens=np.zeros(total, dtype=np.int32), doc_starts=doc_starts,
                      features={"audit_document": np.repeat(documents, wrapped), "audit_offset": offsets})
        if self.counting:  # the tombstones' counters, as the training stream's block has them (restores use them)
            counts = with_tombstones(self._tombstones.get((file_ordinal, row_group)), None, self.transforms)
            block.transform_counts = counts if counts is not None else TransformCounts.zeros(self.counted_transforms)
        return block

    # -- open best-fit bins of a checkpoint ----------------------------------------------
    def piece_features(self, origin: tuple[int, int, int], length: int, doc_starts: np.ndarray,
                       where: str) -> dict[str, np.ndarray]:
        """The audit features of the ``length`` tokens from cursor ``origin`` = ``(epoch, block,
        offset)`` on: a saved bin piece resolved to its document. ``doc_starts`` (the piece's
        own, from the checkpoint) must be where that span's documents start, else the origin is
        not of this dataset; ``where``: the piece's JSON path, for the error."""
        epoch, block, offset = (int(x) for x in origin)
        blocks = self.blocks_of_epoch(epoch)
        if block < len(blocks):
            built = self._origin_blocks.get((epoch, block))
            if built is None:
                built = self._origin_blocks[(epoch, block)] = self._read_block(epoch, *blocks[block])
            document_offsets = built.features["audit_offset"][offset:offset + length]
            if offset + length <= len(built.tokens) and np.array_equal(
                    np.flatnonzero(document_offsets == 0), np.asarray(doc_starts, dtype=np.int64)):
                return {"audit_document": built.features["audit_document"][offset:offset + length],
                        "audit_offset": document_offsets}
        raise OriginError(
            f"{where}: piece origin {[epoch, block, offset]} ({length} tokens) is not a span of lane {self.lane_id} "
            f"of source {self.source_name!r} whose documents start where the piece's do: the checkpoint is not "
            "of this dataset (or was edited); audit with the run's own checkpoint and datasets")


