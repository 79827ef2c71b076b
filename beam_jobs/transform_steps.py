"""``zephon shard --transform``: the loader's transforms applied in the Beam job, before lanes.

The ``Transform`` step runs right after ``ReadFiles`` on each valid document, with the same
:class:`loader.transforms.chain.TransformChain` the loader uses online (same functions, same
per-document seeds from ``--seed`` and the key, same determinism check). A dropped document is
kept as a *tombstone*: its key and order key, empty text, no kept fields, and in the lane files'
``dropped_by`` column the position of the transform that dropped it (kept rows: -1). Lane
files therefore hold the same rows in the same order, cut into the same row groups, as without
the transforms (the layout is decided by the documents' original text bytes), so every epoch's
row permutation (:mod:`loader.order.epochs`) is the same offline and online, and the loader
skips a tombstone exactly as it skips a document dropped online::

    documents -> Transform -+- documents + (dropped_by, layout bytes): kept (text possibly changed)
                            |                                          or tombstones
                            +- counts: (transform position, "dropped" | "changed")
                                 -> CountTransformOutcomes -> manifest "transforms"

Text-stage transforms run here; the tokens-stage ones (after every text-stage one in the list)
run in ``WriteLaneFiles`` right after tokenization (:class:`TokenStage`, needs ``--tokenizer``),
their counts carried by the file entries. ``--dedup`` sees only live documents (tombstones pass
it untouched). A chat job's conversations may be filtered but not rewritten (their encodings
are made before).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import apache_beam as beam
import numpy as np

from beam_jobs.records import _encode_kept
from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document
from loader.transforms.spec import TransformSpec

COUNTS_TAG = "transform_counts"
OUTCOMES = ("dropped", "changed")
KEPT = -1  # the dropped_by value of a live document (loader.io.manifest.TOMBSTONE_COLUMN)
ENTRY_COUNTS = "transform_counts"  # a file entry's tokens-stage counts: [[position, dropped, changed], ...]


def is_live(document: tuple) -> bool:
    """Not a tombstone: a transformed document ends with ``(dropped_by, layout text bytes)``."""
    return document[-1][0] == KEPT


def _emptied(value: Any) -> Any:
    """A tombstone's copy of a chat row's encoding: no ids, no mask, no conversation."""
    if isinstance(value, str):
        return ""
    if isinstance(value, tuple):
        return tuple(_emptied(v) for v in value)
    if isinstance(value, bytes):
        return b""
    raise TypeError(f"internal error: no tombstone form for a document part of type {type(value).__name__}")


class TransformDocumentsFn(beam.DoFn):
    """Document tuple -> the transformed document (or nothing), plus tagged outcome counts."""

    def __init__(self, specs: Sequence[TransformSpec], *, seed: int, source: str, keep_fields: Sequence[str],
                 text_is_fixed: bool = False):
        self.specs = tuple(specs)
        self.seed = seed
        self.source = source
        self.keep_fields = tuple(keep_fields)
        self.text_is_fixed = text_is_fixed  # chat jobs: the text is a rendering of the conversation
        self.chain: Optional[TransformChain] = None

    def setup(self) -> None:
        # pretokenized=True makes the chain refuse text changes (chat: the conversation is the content).
        self.chain = TransformChain(self.specs, seed=self.seed, source=self.source, pretokenized=self.text_is_fixed)

    def process(self, document: tuple) -> Iterator:
        # Element 2 (text bytes) stays the original's: files per lane and row groups are cut by it.
        key, text, text_nbytes, kept_values, *encoded = document
        counts = TransformCounts.zeros(len(self.specs))
        metadata = tuple(zip(self.keep_fields, kept_values))
        result = self.chain.apply(Document(key, text=text, metadata=metadata, seed_base=self.seed), counts) \
            if self.specs else Document(key, text=text)
        dropped_by = KEPT
        for position, (dropped, changed) in enumerate(counts.counts):
            if dropped:
                dropped_by = position
                yield beam.pvalue.TaggedOutput(COUNTS_TAG, (position, "dropped"))
            if changed:
                yield beam.pvalue.TaggedOutput(COUNTS_TAG, (position, "changed"))
        if result is None:  # a tombstone: the key holds the document's place in its lane
            yield (key, "", text_nbytes, (None,) * len(kept_values), *map(_emptied, encoded),
                   (dropped_by, text_nbytes))
            return
        new_text, new_kept = result.text, kept_values
        if result.loaded("metadata") and result._metadata is not metadata:
            values = result.metadata
            new_kept = tuple(_encode_kept(values.get(name)) for name in self.keep_fields)
        yield (key, new_text, text_nbytes, new_kept, *encoded, (KEPT, text_nbytes))


class TokenStage:
    """The tokens-stage transforms of ``--transform``, applied in ``WriteLaneFiles`` to each live
    row of a row group right after tokenization: the same chain (and seeds, by their position in
    the whole list) as the loader's online on a pre-tokenized source. A dropped row becomes a
    tombstone like a text-stage drop."""

    def __init__(self, specs: Sequence[TransformSpec], *, first_position: int, seed: int, source: str,
                 keep_fields: Sequence[str], with_text: bool) -> None:
        self.chain = TransformChain(specs, seed=seed, source=source, pretokenized=True,
                                    first_position=first_position)
        self.first_position = first_position
        self.seed = seed
        self.keep_fields = tuple(keep_fields)
        self.with_text = with_text  # online, a pre-tokenized document has its text only for text-stage transforms
        self.counts = TransformCounts.zeros(len(specs))

    def apply(self, rows: Sequence[tuple], flat_ids: np.ndarray, num_tokens: np.ndarray,
              dropped_by: np.ndarray) -> Optional[tuple[list, np.ndarray]]:
        """``(id arrays per row, num_tokens)`` after the transforms, or None when every row came
        back as it was; ``dropped_by`` (this row group's) is updated in place.

        ``rows``: the row group's lane rows (key, text, kept fields); ``flat_ids``/``num_tokens``: their ids.
        """
        ends = np.cumsum(num_tokens, dtype=np.int64)
        results, changed = [], False
        for k, row in enumerate(rows):
            ids = flat_ids[ends[k] - num_tokens[k]: ends[k]]
            if dropped_by[k] != KEPT:
                results.append(ids)
                continue
            ids.flags.writeable = False
            document = Document(row[1], text=row[2] if self.with_text else None, input_ids=ids, features={},
                                metadata=tuple(zip(self.keep_fields, row[3])), seed_base=self.seed)
            before = [pair[0] for pair in self.counts.counts]
            result = self.chain.apply(document, self.counts)
            if result is None:
                dropped_by[k] = self.first_position + next(
                    p for p, pair in enumerate(self.counts.counts) if pair[0] != before[p])
                results.append(ids[:0])
                changed = True
                continue
            if result is not document and result.loaded("input_ids") and result.input_ids is not ids:
                ids = np.asarray(result.input_ids, dtype=np.int32)
                changed = True
            results.append(ids)
        if not changed:
            return None
        return results, np.fromiter(map(len, results), dtype=np.int32, count=len(results))

    def begin_file(self) -> None:
        """Counts start from zero for each lane file (a retried bundle counts its file again)."""
        self.counts = TransformCounts.zeros(len(self.counts.counts))

    def entry_counts(self) -> list[list[int]]:
        """What this stage did to the file, as its entry carries it."""
        return [[self.first_position + p, d, c] for p, (d, c) in enumerate(self.counts.counts)]


def add_entry_counts(report: list[dict], file_entries: Sequence[dict]) -> None:
    """Add the tokens-stage counts the file entries carry (:data:`ENTRY_COUNTS`) to the report."""
    for entry in file_entries:
        for position, dropped, changed in entry.get(ENTRY_COUNTS, ()):
            report[position]["dropped"] += int(dropped)
            report[position]["changed"] += int(changed)


def transforms_report(specs: Sequence[TransformSpec], outcome_counts: dict) -> list[dict]:
    """The manifest's ``transforms`` entry: per transform, its spec and what it did."""
    report = []
    for position, spec in enumerate(specs):
        entry = spec.to_entry()
        entry.update(dropped=int(outcome_counts.get((position, "dropped"), 0)),
                     changed=int(outcome_counts.get((position, "changed"), 0)))
        report.append(entry)
    return report
