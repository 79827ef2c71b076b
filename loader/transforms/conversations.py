"""Transforms of an online chat source: on the conversation before rendering, on its tokens after.

An online chat source's row group becomes a :class:`loader.chat.block.ChatBlock`; with
transforms the block runs them around its encoding, through the same row-group hook as text
and pre-tokenized lanes (:mod:`loader.transforms.rows`: a :class:`LazyColumns` of the row
group's ``key`` and ``--keep-fields`` columns, read only if a function asks)::

    conversation JSON -> record -> records-stage chain  -> kept records (possibly changed)
                                   (doc.record)             -> render + tokenize + mask
                                                               (online rejects counted apart)
                              -> tokens-stage chain on input_ids + loss_mask -> the block

The records-stage transforms must come before the tokens-stage ones in the source's list (text
transforms do not apply: an online chat document has no text before it is rendered). Seeds are
those of the whole list (a transform's position in it), counters one pair per transform in list
order, as for any source. A document dropped or rejected yields no tokens, so the cursor stays
exact and the checkpoint holds only counters.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

import numpy as np

from loader.caches import BoundedCache
from loader.errors import TransformError
from loader.transforms.chain import UNCHANGED, TransformChain, TransformCounts
from loader.transforms.rows import fetcher  # the text and pre-tokenized lanes' own
from loader.transforms.spec import TransformSpec


class RowsOf:
    """The :class:`LazyColumns` of a row group seen through a list of its row indices (the
    documents left after a stage), so that document ``k`` gets row ``rows[k]``'s key and fields."""

    def __init__(self, columns, rows: Sequence[int]) -> None:
        self._columns, self._rows, self.names = columns, list(rows), columns.names
        self._lists: dict[str, list] = {}

    def values(self, name: str) -> list:
        if name not in self._lists:
            values = self._columns.values(name)
            self._lists[name] = [values[r] for r in self._rows]
        return self._lists[name]


class ChatTransforms:
    """One online chat source's transforms, split at the render (see the module docstring)."""

    def __init__(self, specs: Sequence[TransformSpec], *, seed: int, source: str) -> None:
        self.specs = tuple(specs)
        first_tokens = next((k for k, spec in enumerate(self.specs) if spec.stage == "tokens"), len(self.specs))
        for position, spec in enumerate(self.specs):
            if spec.stage == "text":
                raise TransformError(
                    f"transform {spec.qualified_name} (transforms[{position}] of source {source!r}) works on text, but "
                    f"source {source!r} holds conversations rendered online: use stage \"records\" (doc.record, the "
                    "conversation before rendering) or \"tokens\" (input_ids and loss_mask after it)")
            if spec.stage == "records" and position > first_tokens:
                raise TransformError(
                    f"transform {spec.qualified_name} (transforms[{position}] of source {source!r}) works on records "
                    f"but follows the tokens transform {self.specs[first_tokens].qualified_name}: a conversation is "
                    "rendered once, after its records transforms; put them first")
        self.records = TransformChain(self.specs[:first_tokens], seed=seed, source=source, pretokenized=False,
                                      records=True) if first_tokens else None
        self.tokens = TransformChain(self.specs[first_tokens:], seed=seed, source=source, pretokenized=True,
                                     feature_names=("loss_mask",), first_position=first_tokens) \
            if first_tokens < len(self.specs) else None
        self.source = source

    def __len__(self) -> int:
        return len(self.specs)

    needs_text = False  # extra_columns: the key and --keep-fields columns only

    def zeros(self) -> TransformCounts:
        return TransformCounts.zeros(len(self.specs))

    def apply_records(self, columns, records: list, counts: TransformCounts) -> tuple[list, list[int]]:
        """``(kept records, their row indices)`` after the records-stage transforms."""
        rows = list(range(len(records)))
        if self.records is None:
            return records, rows
        stage = TransformCounts.zeros(len(self.records))
        results = self.records.apply_rows(fetcher(columns, records=records.__getitem__), len(records), stage)
        for position, (dropped, changed) in enumerate(stage.counts):
            counts.counts[position][0] += dropped
            counts.counts[position][1] += changed
        if results is None:
            return records, rows
        kept, kept_rows = [], []
        for row, (record, result) in enumerate(zip(records, results)):
            if result is None:
                continue
            kept.append(record if result is UNCHANGED else result.record)
            kept_rows.append(row)
        return kept, kept_rows

    def apply_tokens(self, columns, rows: list[int], ids: list, masks: list,
                     counts: TransformCounts) -> tuple[list, list]:
        """``(ids, masks)`` of the encoded conversations (of row group rows ``rows``) after the
        tokens-stage transforms."""
        if self.tokens is None or not ids:
            return ids, masks
        stage = TransformCounts.zeros(len(self.tokens))
        fetch = fetcher(RowsOf(columns, rows), ids=lambda k: np.asarray(ids[k], dtype=np.int32),
                         features=lambda k: {"loss_mask": np.asarray(masks[k])})
        results = self.tokens.apply_rows(fetch, len(ids), stage)
        offset = len(self.specs) - len(self.tokens)
        for position, (dropped, changed) in enumerate(stage.counts):
            counts.counts[offset + position][0] += dropped
            counts.counts[offset + position][1] += changed
        if results is None:
            return ids, masks
        new_ids, new_masks = [], []
        for k, result in enumerate(results):
            if result is None:
                continue
            if result is UNCHANGED:
                new_ids.append(ids[k])
                new_masks.append(masks[k])
                continue
            new_ids.append(np.asarray(result.input_ids, dtype=np.int32))
            new_masks.append(np.asarray(result.features["loss_mask"], dtype=np.uint8))
        return new_ids, new_masks


_chains: BoundedCache[ChatTransforms] = BoundedCache(64)


def chat_transforms_for(specs: Sequence[TransformSpec], *, seed: int, source: str) -> Optional[ChatTransforms]:
    """The process's :class:`ChatTransforms` of these specs for one source (None without any)."""
    if not specs:
        return None
    key = (json.dumps([s.to_entry() for s in specs], sort_keys=True), seed, source)
    return _chains.get_or_make(key, lambda: ChatTransforms(specs, seed=seed, source=source))
