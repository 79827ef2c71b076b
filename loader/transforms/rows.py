"""A row group's documents through a source's transforms: what the lane reader calls.

The lane reader builds one block per row group (:mod:`loader.io.lane_reader`). With
transforms it calls :func:`apply_transforms` once per block, in replay order; the other columns
a document may need (:func:`extra_columns`: ``key``, ``text`` of a pre-tokenized source when a
text transform needs it, the ``--keep-fields`` columns) are read from the row group only when a
function first touches one (:class:`LazyColumns`):

* text lanes: on the texts, before tokenization; the kept texts go to the ``TextBlock``;
* pre-tokenized lanes: on the finished :class:`~loader.io.lane_reader.Block` (ids and
  features wrapped with BOS/EOS); a block whose documents all come back unchanged is returned
  as it is (no copy), otherwise a new block is built from the kept documents.

A dataset sharded with ``zephon shard --transform`` keeps each document it dropped as a
*tombstone* row (``dropped_by`` >= 0, :data:`loader.io.manifest.TOMBSTONE_COLUMN`):
:func:`tombstone_rows` leaves those rows out of the block's replay order, which is computed over
every row exactly as for the untransformed dataset, and counts them per transform
(:func:`with_tombstones` puts those counts before the config's own).

A dropped document just yields no tokens: the stream's cursor counts tokens of the
transformed block, which every process rebuilds identically, so cursors, packers and
checkpoints need nothing new. A row group whose documents are all dropped is an empty block,
which the stream steps over.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from loader.errors import LaneDataError
from loader.io.blocks import wrap_documents  # the same wrapping as an untransformed block
from loader.io.manifest import CONVERSATION_COLUMN, TOMBSTONE_COLUMN, Manifest
from loader.stages.features import FEATURES, wrap_feature
from loader.transforms.chain import UNCHANGED, TransformChain, TransformCounts
from loader.transforms.document import RowFetcher

# Lane-file columns that are not --keep-fields metadata (beam_jobs.lane_files.RESERVED_COLUMNS).
_NOT_METADATA = ("key", "order_key", "text", "input_ids", "num_tokens", "loss_mask", TOMBSTONE_COLUMN,
                 CONVERSATION_COLUMN)


def metadata_columns(manifest: Manifest) -> tuple[str, ...]:
    """The ``--keep-fields`` columns of a dataset (each a JSON-encoded string)."""
    return tuple(c["name"] for c in manifest.schema if c.get("name") not in _NOT_METADATA)


def extra_columns(chain: Optional[TransformChain], manifest: Manifest) -> tuple[str, ...]:
    """The columns a block read needs beyond ids/text and features, for ``chain``."""
    if chain is None:
        return ()
    columns = ["key"]
    if manifest.pretokenized and chain.needs_text:
        columns.append("text")
    return tuple(columns) + metadata_columns(manifest)


class LazyColumns:
    """A row group's :func:`extra_columns`, read all at once the first time a document asks
    for one of them (``read(names)`` -> arrays in replay order): a function that looks only at
    the ids, or returns its document as is, costs no extra column read."""

    def __init__(self, read: Callable[[Sequence[str]], Mapping[str, pa.Array]], names: Sequence[str]) -> None:
        self._read, self.names = read, tuple(names)
        self._lists: Optional[dict[str, list]] = None

    def values(self, name: str) -> list:
        if self._lists is None:
            self._lists = {n: a.to_pylist() for n, a in self._read(self.names).items()}
        return self._lists[name]


def fetcher(columns: LazyColumns, **fields) -> RowFetcher:
    """The :class:`RowFetcher` of a row group's documents: key and ``--keep-fields`` metadata from
    ``columns``, the other fields (``texts``, ``ids``, ``features``, ``records``) as given."""
    metadata_names = [name for name in columns.names if name not in ("key", "text")]

    def metadata(k: int):
        return tuple((name, columns.values(name)[k]) for name in metadata_names)

    text = (lambda k: columns.values("text")[k]) if "text" in columns.names else None
    return RowFetcher(keys=lambda k: columns.values("key")[k], texts=fields.pop("texts", text),
                      metadata=metadata if metadata_names else None, **fields)


def apply_transforms(chain: TransformChain, columns: LazyColumns, *, texts: Optional[list] = None,
                     block: Any = None, token_format: Any = None) -> tuple[Any, TransformCounts]:
    """``(kept texts or transformed block, counts)`` of one row group (see the module docstring).

    ``columns``: the :func:`extra_columns` of the row group, read on demand; ``texts`` (text
    lanes) or ``block`` plus ``token_format`` (pre-tokenized lanes).
    """
    counts = TransformCounts.zeros(len(chain))
    if texts is not None:
        return _transform_texts(chain, texts, columns, counts), counts
    return _transform_block(chain, block, columns, token_format, counts), counts


def _transform_texts(chain: TransformChain, texts: list, columns: LazyColumns, counts: TransformCounts) -> list:
    results = chain.apply_rows(fetcher(columns, texts=texts.__getitem__), len(texts), counts)
    if results is None:
        return texts
    return [text if result is UNCHANGED else result.text
            for text, result in zip(texts, results) if result is not None]


def _transform_block(chain: TransformChain, block: Any, columns: LazyColumns, fmt: Any,
                     counts: TransformCounts) -> Any:
    starts = block.doc_starts
    bos, eos = int(fmt.bos_id is not None), int(fmt.eos_id is not None)
    tokens, features = block.tokens, block.features

    def ids_of(k: int) -> np.ndarray:
        return tokens[starts[k] + bos : starts[k + 1] - eos]

    def features_of(k: int) -> dict:
        return {name: values[starts[k] + bos : starts[k + 1] - eos] for name, values in features.items()}

    fetch = fetcher(columns, ids=ids_of, features=features_of if features else None)
    results = chain.apply_rows(fetch, len(starts) - 1, counts)
    if results is None:  # every document as it was: the block itself
        return block
    return _rebuilt_block(block, results, ids_of, features_of, fmt)


def _rebuilt_block(block: Any, results: list, ids_of, features_of, fmt: Any) -> Any:
    """A block of the kept documents, each with its (possibly new) ids and feature values."""
    id_parts, lengths = [], []
    feature_parts: dict[str, list] = {name: [] for name in block.features}
    for k, result in enumerate(results):
        if result is None:
            continue
        if result is UNCHANGED:
            result = None
        ids = ids_of(k) if result is None or not result.loaded("input_ids") \
            else np.asarray(result.input_ids, dtype=np.int32)
        id_parts.append(ids)
        lengths.append(len(ids))
        if feature_parts:
            values = result.features if result is not None and result.loaded("features") else features_of(k)
            for name in feature_parts:
                feature_parts[name].append(np.asarray(values[name], dtype=FEATURES[name].dtype))
    flat = np.concatenate(id_parts).astype(np.int32, copy=False) if id_parts else np.zeros(0, np.int32)
    length_array = np.asarray(lengths, dtype=np.int64)
    rebuilt = wrap_documents(flat, length_array, fmt)
    if feature_parts:
        rebuilt.features = {
            name: wrap_feature(FEATURES[name],
                               np.concatenate(parts) if parts else np.zeros(0, FEATURES[name].dtype),
                               length_array, rebuilt.doc_starts, fmt.bos_id is not None, fmt.eos_id is not None)
            for name, parts in feature_parts.items()}
    return rebuilt


def tombstone_rows(dropped_by: pa.Array, order: Optional[np.ndarray], transforms: Sequence[str], where: str,
                   row_group: int) -> tuple[Optional[np.ndarray], np.ndarray]:
    """``(rows to replay, tombstones per transform)`` of a row group's ``dropped_by`` column.

    ``order``: the epoch's row order (None: the rows as stored); the rows returned are it
    without the tombstones (None when the row group holds none and ``order`` is None).
    """
    if dropped_by.null_count or not pa.types.is_integer(dropped_by.type):
        raise LaneDataError(f"{where}: row group {row_group}: {TOMBSTONE_COLUMN} must be integers without nulls "
                            f"(got {dropped_by.type}, {dropped_by.null_count} nulls); re-run the Beam job")
    values = np.frombuffer(dropped_by.buffers()[1], dtype=np.dtype(str(dropped_by.type)), count=len(dropped_by),
                           offset=dropped_by.offset * dropped_by.type.bit_width // 8)
    if not len(values) or int(values.max()) < 0:
        return order, np.zeros(len(transforms), np.int64)
    if int(values.max()) >= len(transforms) or int(values.min()) < -1:
        raise LaneDataError(f"{where}: row group {row_group}: {TOMBSTONE_COLUMN} holds {int(values.max())}, but the "
                            f"manifest lists {len(transforms)} transforms; re-run the Beam job")
    live = values < 0
    rows = np.flatnonzero(live) if order is None else order[live[order]]
    return np.ascontiguousarray(rows, dtype=np.int64), np.bincount(values[~live], minlength=len(transforms))


def with_tombstones(tombstones: Optional[np.ndarray], counts: Optional[TransformCounts],
                    chain: Optional[TransformChain]) -> Optional[TransformCounts]:
    """A block's counters: the tombstones per offline transform, then the chain's ``counts``."""
    if tombstones is None:
        return counts
    online = counts.counts if counts is not None else [[0, 0] for _ in range(len(chain) if chain else 0)]
    return TransformCounts([[int(n), 0] for n in tombstones] + online)
