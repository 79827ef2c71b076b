"""Micro-batches from packed sequences: NumPy arrays first, torch as a thin adapter.

:class:`Collator` builds one micro-batch as a dict of NumPy arrays (plus the ints ``step``
and ``micro_step``); :func:`to_torch` wraps each array with ``torch.from_numpy`` (no copy).
``ZephonLoader`` returns torch tensors by default and the NumPy dict with
``output="numpy"`` (JAX and other non-torch trainers).

Fields: ``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens`` as selected by the config's
``batch_fields``, then one field per per-token feature of the loader (``loss_mask``,
``token_source_ids``), built by one rule (:func:`loader.stages.features.batch_feature`), and the
per-sequence ``source_ids`` and ``global_indices``; with finite data whose tails are filled
(``epoch_tail = "fill"``), the per-sequence bool ``fill``: the row is a fill row (all
padding, labels -100, ``loss_mask`` 0, source id -1; docs/guides/finite-epochs.md). A feature with a label rule masks
``labels`` whatever ``batch_fields`` holds. With online chat sources, ``chat_rejects``: the
conversations refused online (:mod:`loader.chat.block`) reported with this micro-batch's
sequences, ``{reason: count}`` with every reason (zeros included); with image sources, the
same for image documents dropped online as ``image_rejects`` (:mod:`loader.vision.block`), and
``pixel_values`` with its image fields (the image policy's ``batch_fields``: :mod:`loader.vision.policies`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from loader.stages.features import FEATURES, IGNORE_INDEX, batch_feature
from loader.stages.packing import ConcatRow

OUTPUTS = ("torch", "numpy")
_TRUE = np.ones(1, dtype=bool)


class Collator:
    """Builds the micro-batches of one loader (keeps an ``arange`` across batches)."""

    def __init__(self, *, seq_len: int, global_batch_size: int, micro_batch_size: int, per_rank_batch: int,
                 batch_fields: Sequence[str], features: Sequence[str] = (),
                 chat_reject_reasons: Sequence[str] = (), empty: Callable[..., np.ndarray] = np.empty,
                 image_policy=None, image_reject_reasons: Sequence[str] = (), fill_rows: bool = False) -> None:
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank_batch = per_rank_batch
        self.fields = tuple(batch_fields)
        # The loader's features (every micro-batch holds the same keys, whichever sources its
        # rows come from): those to put into the batch, and those that mask labels.
        self.batched = tuple(n for n in features if FEATURES[n].batch_field in self.fields)
        self.label_masks = tuple(n for n in features if FEATURES[n].masks_labels) if "labels" in self.fields else ()
        self.needed_features = tuple(dict.fromkeys(self.batched + self.label_masks))  # the features a batch reads
        # Whether collate reads each sequence's labels and segment (document) starts: not for a
        # batch of input_ids (and features) alone, whose workers then do not ship them.
        self.reads_segments = "labels" in self.fields or "position_ids" in self.fields or "cu_seqlens" in self.fields
        self._positions: Optional[np.ndarray] = None  # arange(rows * seq_len)
        self.chat_reject_reasons = tuple(chat_reject_reasons)  # empty: no online chat source, no field
        # Where the large arrays are written: np.empty, or pinned memory (loader.stages.pinned).
        self.empty = empty
        # Image sources (loader.vision): every micro-batch holds pixel_values and its image fields.
        self.image_policy = image_policy
        self.image_reject_reasons = tuple(image_reject_reasons)  # loader.vision.block; empty: no field
        # Finite data with filled tails: every micro-batch says which rows are fill rows.
        self.fill_rows = fill_rows

    def collate(self, items: list, rank_position: int) -> dict[str, Any]:
        """The micro-batch of ``items`` (NumPy); ``rank_position``: sequences handed out so far,
        these included. Releases the items' shared-memory leases (everything is copied)."""
        seq_len = self.seq_len
        rows = len(items)
        sequences = [it.sequence for it in items]
        # One call per array, converting int32 -> int64 while copying (not stack + astype);
        # the per-call overhead, not the bytes, is what costs at these sizes.
        input_ids = self._rows([s.input_ids for s in sequences], rows, seq_len)
        batch = self._header(input_ids, [it.source_id for it in items], [it.global_index for it in items],
                             rank_position)
        # Datasets without features: no loop, no arrays (self.needed_features is empty).
        feature_arrays = {name: batch_feature(name, [s.features for s in sequences], rows, seq_len)
                          for name in self.needed_features}
        if self.reads_segments:
            # Rows of concat fills (nearly all rows of concat packing) carry only where their
            # documents start: labels and segments of all of them come from one flat array.
            # Other rows (best fit, rows across a block boundary) bring their own arrays.
            concat_rows = [r for r, s in enumerate(sequences) if type(s) is ConcatRow]
            other_rows = [r for r, s in enumerate(sequences) if type(s) is not ConcatRow]
            doc_flat = _flat_positions([sequences[r].doc_starts for r in concat_rows], seq_len, concat_rows)
            self._segments(batch, input_ids, feature_arrays, doc_flat, sequences, concat_rows, other_rows)
        for name in self.batched:
            batch[FEATURES[name].batch_field] = feature_arrays[name]
        if self.image_policy is not None:
            batch.update(self.image_policy.batch_fields(sequences))
        if self.chat_reject_reasons or self.image_reject_reasons:
            # Items carry the online rejects of chat and image blocks in one dict (disjoint names).
            rejects: dict[str, int] = {}
            for item in items:
                for reason, count in (item.chat_rejects or {}).items():
                    rejects[reason] = rejects.get(reason, 0) + count
            if self.chat_reject_reasons:
                batch["chat_rejects"] = {reason: rejects.get(reason, 0) for reason in self.chat_reject_reasons}
            if self.image_reject_reasons:
                batch["image_rejects"] = {reason: rejects.get(reason, 0) for reason in self.image_reject_reasons}
        for item in items:  # copied out: a worker's shared-memory slot may be written again
            if item.lease is not None:
                item.lease.item_done()
        return batch

    def collate_rows(self, fills: list, rows: list[int], source_ids: list[int], first_index: int, stride: int,
                     rank_position: int) -> dict[str, Any]:
        """:meth:`collate` of full concat rows given as ``(fill, row)`` pairs (``fills[k]``'s row
        ``rows[k]``, :meth:`loader.stages.packing.ConcatPacker.take_fill_row`) at global indices
        ``first_index, first_index + stride, ...``: the same batch, without a sequence object
        per row. Only for loaders without image or chat sources and without fill rows."""
        seq_len = self.seq_len
        count = len(rows)
        input_ids = self._rows([fill.input_ids[row] for fill, row in zip(fills, rows)], count, seq_len)
        batch = self._header(input_ids, source_ids, range(first_index, first_index + count * stride, stride),
                             rank_position)
        feature_arrays = {}
        if self.needed_features:
            row_features = [fill.row_features(row) for fill, row in zip(fills, rows)]
            feature_arrays = {name: batch_feature(name, row_features, count, seq_len) for name in self.needed_features}
        if self.reads_segments:
            doc_flat = _flat_positions([fill.row_doc_starts(row) for fill, row in zip(fills, rows)], seq_len)
            self._segments(batch, input_ids, feature_arrays, doc_flat, None, rows, ())
        for name in self.batched:
            batch[FEATURES[name].batch_field] = feature_arrays[name]
        return batch

    def _header(self, input_ids: np.ndarray, source_ids, global_indices, rank_position: int) -> dict[str, Any]:
        """A batch's ``input_ids`` and per-sequence fields (``rank_position``: see :meth:`collate`)."""
        rows = len(input_ids)
        first_index = global_indices[0]
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "source_ids": np.array(source_ids, dtype=np.int64),
            "global_indices": np.array(global_indices, dtype=np.int64),
            "step": first_index // self.global_batch_size,
            "micro_step": ((rank_position - rows) % self.per_rank_batch) // self.micro_batch_size,
        }
        if self.fill_rows:  # fill rows: source id -1 (loader.stages.producer.FILL_SOURCE)
            batch["fill"] = batch["source_ids"] < 0
        return batch

    def _segments(self, batch: dict[str, Any], input_ids: np.ndarray, feature_arrays: dict, doc_flat: np.ndarray,
                  sequences: Optional[list], concat_rows: Sequence[int], other_rows: Sequence[int]) -> None:
        """``labels``, ``position_ids`` and ``cu_seqlens`` as the fields ask: concat rows' (at
        ``concat_rows``) from ``doc_flat``, their document starts in the flattened batch; the
        ``other_rows`` of ``sequences`` from their own labels and segment starts."""
        fields, seq_len = self.fields, self.seq_len
        rows = len(input_ids)
        if "labels" in fields:
            if not concat_rows:
                labels = self._rows([s.labels for s in sequences], rows, seq_len)
            else:
                # From the input ids just written (still in cache), not from per-row copies.
                if self.empty is np.empty:
                    labels = input_ids.copy()
                else:
                    labels = self.empty((rows, seq_len), np.int64)
                    np.copyto(labels, input_ids)
                labels.reshape(-1)[doc_flat] = IGNORE_INDEX
                for r in other_rows:
                    labels[r] = sequences[r].labels
                # Concat rows' label rules over the whole batch (other rows have theirs already).
                for name in self.label_masks:
                    labels[feature_arrays[name] == 0] = IGNORE_INDEX
            batch["labels"] = labels
        if "position_ids" in fields or "cu_seqlens" in fields:
            # Segment starts of the whole micro-batch (row r's shifted by r * seq_len) plus the
            # end: that is cu_seqlens. Every row starts a segment, so position ids restart at
            # row boundaries without a per-row loop. A concat row's segments start at the row
            # start and at its documents' starts, which may coincide: the few starts are sorted
            # and the repeats dropped (half the time of marking a flag per token and reading
            # the marks back, bench/HISTORY.md, "Issue 35: in-process replay in bulk").
            if not concat_rows:
                cu = np.append(_flat_positions([s.segment_starts for s in sequences], seq_len), rows * seq_len)
            else:
                parts = [doc_flat, np.arange(0, rows * seq_len + 1, seq_len, dtype=np.int64)]  # row starts, the end
                if other_rows:
                    parts.append(_flat_positions([sequences[r].segment_starts for r in other_rows], seq_len, other_rows))
                cu = np.concatenate(parts)
                cu.sort()
                if len(cu) > 1:
                    cu = cu[np.concatenate((_TRUE, cu[1:] != cu[:-1]))]
            if "position_ids" in fields:
                # position = index - start of its segment; the subtraction runs in place on
                # the repeated starts, against an arange built once per loader.
                if self._positions is None or len(self._positions) != rows * seq_len:
                    self._positions = np.arange(rows * seq_len, dtype=np.int64)
                starts = np.repeat(cu[:-1], np.diff(cu))
                position_ids = (starts.reshape(rows, seq_len) if self.empty is np.empty
                                else self.empty((rows, seq_len), np.int64))
                np.subtract(self._positions, starts, out=position_ids.reshape(-1))
                batch["position_ids"] = position_ids
            if "cu_seqlens" in fields:
                batch["cu_seqlens"] = cu.astype(np.int32)

    def loss_tokens(self, items: Sequence) -> int:
        """Tokens of ``items`` a causal-LM loss counts, ``labels[:, 1:] != -100`` of the labels
        :meth:`collate` builds for them, without building the batch (the loader counts a whole
        step before its first micro-batch: loader.model_inputs.loss_tokens)."""
        total = 0
        for item in items:
            sequence = item.sequence
            if type(sequence) is ConcatRow:  # labels = input ids but document starts and label rules
                counted = np.ones(self.seq_len, dtype=bool)
                counted[sequence.doc_starts] = False
                for name in self.label_masks:
                    values = sequence.features.get(name)
                    if values is not None:
                        counted &= values != 0
                    elif FEATURES[name].default == 0:
                        counted[:] = False
            else:
                counted = sequence.labels != IGNORE_INDEX
            total += int(np.count_nonzero(counted[1:]))
        return total

    def _rows(self, arrays: list, rows: int, seq_len: int) -> np.ndarray:
        """``arrays`` (one per row) as one int64 ``(rows, seq_len)`` array, in :attr:`empty`'s memory."""
        if self.empty is np.empty:  # ~4 us faster per batch than writing into a given array
            return np.concatenate(arrays, dtype=np.int64).reshape(rows, seq_len)
        out = self.empty((rows, seq_len), np.int64)
        np.concatenate(arrays, out=out.reshape(-1))
        return out


_from_numpy = None  # torch.from_numpy, looked up once (torch is imported only by torch users)


def load_torch() -> None:
    """Import torch for :func:`to_torch` now: a torch loader's constructor calls it, so that the
    import (a second or more) is not paid inside its first micro-batch."""
    global _from_numpy
    if _from_numpy is None:
        import torch  # optional heavy dependency: only for output="torch" (never for "numpy")

        _from_numpy = torch.from_numpy


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with every array as a torch tensor sharing its memory (``from_numpy``: ~1 us
    per array, where ``torch.tensor`` of a list costs ~30 us). Per batch this is as cheap as
    calling ``from_numpy`` field by field: no import or ``isinstance`` per call."""
    if _from_numpy is None:
        load_torch()
    from_numpy, ndarray = _from_numpy, np.ndarray
    return {k: from_numpy(v) if type(v) is ndarray else v for k, v in batch.items()}


def _flat_positions(per_row: list[np.ndarray], seq_len: int, row_ids: Optional[list[int]] = None) -> np.ndarray:
    """Offsets inside rows of a micro-batch, as positions in the flattened batch (row ``r``'s
    shifted by ``r * seq_len``), int64. ``per_row[k]`` belongs to row ``row_ids[k]``
    (default: row ``k``)."""
    if not per_row:
        return np.zeros(0, dtype=np.int64)
    flat = np.concatenate(per_row, dtype=np.int64)
    row_starts = (np.arange(0, len(per_row) * seq_len, seq_len, dtype=np.int64) if row_ids is None
                  else np.array(row_ids, dtype=np.int64) * seq_len)
    flat += np.repeat(row_starts, [len(p) for p in per_row])
    return flat
