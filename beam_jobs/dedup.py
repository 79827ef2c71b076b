"""``zephon shard --dedup exact``: one document per normalised text, chosen by a stable rule.

A shuffle by text hash, never a set in memory, so it scales like the rest of the job::

    documents -> KeyByTextHash -> GroupByTextHash -> KeepOnePerText -+- kept documents
                                                                     +- removed: (hash, kept key, removed key)
        removed -> KeyRemovedByBucket -> GroupRemovedByBucket -> WriteRemovedList
                   (_dedup/removed-BBBBB.jsonl, one line per removed document, sorted)
        removed -> CountRemoved, groups -> CountDuplicateGroups        -> manifest "dedup"

Normalisation (:func:`normalize_text`, version :data:`NORMALIZATION`): Unicode NFKC, then
``str.casefold``, then every run of whitespace (``str.split``) becomes one space, with none at
either end. Two documents are duplicates when the SHA-256 of their normalised UTF-8 text is
equal. Of a group, the document with the smallest key (code point order) is kept, ties (the
same key twice) broken by text and then kept fields: a rule of the documents alone, so the
same input gives the same kept set on every runner and runner mode, and for any split or
order of the records into input files (with ``--id-field``; without it keys name the input
file and record index).

A group's values are read twice (find the kept document, then emit the others): Beam's
grouped values are re-iterable on every runner, so nothing is held in memory beyond the
runner's own buffering.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Iterable, Iterator

import apache_beam as beam

from beam_jobs.outputs import DEDUP_DIR, join_output, write_atomically
from loader.io.storage_options import StorageOptions

DEDUP_MODES = ("exact",)
NORMALIZATION = "nfkc-casefold-whitespace-v1"
REMOVED_FILE_FORMAT = "removed-{bucket:05d}.jsonl"
REMOVED_BUCKETS = 16  # list files by hash prefix: a fixed, content-derived layout
REMOVED_TAG = "removed"
GROUPS_TAG = "duplicate_groups"


def normalize_text(text: str) -> str:
    """The text duplicates are compared by (see the module docstring)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def text_hash(text: str) -> str:
    return hashlib.sha256(normalize_text(text).encode("utf-8", "surrogatepass")).hexdigest()


def _keyed_by_text_hash(document: tuple) -> tuple[str, tuple]:
    return text_hash(document[1]), document


def keep_rank(document: tuple) -> tuple:
    """The stable order of a group: smallest key first, then text, then kept fields."""
    key, text, _nbytes, kept_values, *_ = document
    return key, text, tuple((value is not None, value or "") for value in kept_values)


class KeepOnePerTextFn(beam.DoFn):
    """``(hash, documents)`` -> the kept document; tagged: removed triples and one per duplicate group."""

    def process(self, element: tuple) -> Iterator:
        digest, documents = element
        kept = None
        kept_rank = None
        for document in documents:
            rank = keep_rank(document)
            if kept is None or rank < kept_rank:
                kept, kept_rank = document, rank
        yield kept
        removed_any = False
        skipped_kept = False
        for document in documents:  # grouped values are re-iterable
            if not skipped_kept and keep_rank(document) == kept_rank:
                skipped_kept = True  # the kept one itself (an identical twin is still removed)
                continue
            removed_any = True
            yield beam.pvalue.TaggedOutput(REMOVED_TAG, (digest, kept[0], document[0]))
        if removed_any:
            yield beam.pvalue.TaggedOutput(GROUPS_TAG, digest)


def _bucket_of(removed: tuple) -> tuple[int, tuple]:
    return int(removed[0][:8], 16) % REMOVED_BUCKETS, removed


class WriteRemovedListFn(beam.DoFn):
    """``(bucket, removed triples)`` -> ``_dedup/removed-BBBBB.jsonl``, sorted; yields its relative path."""

    def __init__(self, output: str, *, storage_options: StorageOptions = StorageOptions()):
        self.output = output
        self.storage_options = storage_options

    def process(self, element: tuple) -> Iterator[str]:
        bucket, removed = element
        lines = [json.dumps({"hash": digest, "kept": kept, "removed": key}, ensure_ascii=False)
                 for digest, kept, key in sorted(removed)]
        relative_path = f"{DEDUP_DIR}/{REMOVED_FILE_FORMAT.format(bucket=bucket)}"
        body = "".join(line + "\n" for line in lines)
        write_atomically(join_output(self.output, relative_path), body.encode("utf-8", "backslashreplace"),
                         self.storage_options)
        yield relative_path


class DedupExact(beam.PTransform):
    """documents -> ``(kept documents, removed count, duplicate groups count, list files)``."""

    def __init__(self, output: str, label=None, *, storage_options: StorageOptions = StorageOptions()):
        super().__init__(label)
        self.output = output
        self.storage_options = storage_options

    def expand(self, documents):
        grouped = (
            documents
            | "KeyByTextHash" >> beam.Map(_keyed_by_text_hash)
            | "GroupByTextHash" >> beam.GroupByKey()
            | "KeepOnePerText" >> beam.ParDo(KeepOnePerTextFn()).with_outputs(REMOVED_TAG, GROUPS_TAG, main="kept")
        )
        removed = grouped[REMOVED_TAG]
        list_files = (
            removed
            | "KeyRemovedByBucket" >> beam.Map(_bucket_of)
            | "GroupRemovedByBucket" >> beam.GroupByKey()
            | "WriteRemovedList" >> beam.ParDo(WriteRemovedListFn(self.output, storage_options=self.storage_options))
        )
        removed_count = removed | "CountRemoved" >> beam.combiners.Count.Globally()
        groups_count = grouped[GROUPS_TAG] | "CountDuplicateGroups" >> beam.combiners.Count.Globally()
        return grouped.kept, removed_count, groups_count, list_files


def dedup_report(removed: int, groups: int) -> dict:
    """The manifest's ``dedup`` entry."""
    return {"mode": "exact", "normalization": NORMALIZATION, "removed": int(removed),
            "duplicate_groups": int(groups), "removed_list": f"{DEDUP_DIR}/"}


def read_removed(dataset: str) -> Iterable[dict]:
    """Every removed document of a local dataset's ``_dedup/`` list, in file order."""
    import glob
    import os

    for path in sorted(glob.glob(os.path.join(dataset, DEDUP_DIR, "removed-*.jsonl"))):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                yield json.loads(line)
