"""A source's transforms applied to one document after another, with the determinism check.

:class:`TransformChain` holds the imported functions of one source (the global transforms,
then the dataset's own, in config order) and applies them to a document: each gets the result
of the one before; ``None`` drops the document and ends the chain. It is shared by every lane
of the source in a process; what each lane's stream counted goes into the caller's
:class:`TransformCounts`.

Determinism check (:mod:`loader.transforms.probe`): each function is called twice on each of
the first :data:`CHECK_DOCUMENTS` documents it sees in a process, on independent copies, and
the two results must be equal (both dropped, or the same text, ids, features and metadata);
neither call may draw from Python's or NumPy's global generator; those documents go through
again, last first, when the chain has seen 64, 1,024, 16,384 and 262,144 documents, and once
through a fresh interpreter with another string-hash seed. A function that draws from an
unseeded generator, the clock, hidden state or the process fails here, by name, long before it
could make two ranks or a resume disagree.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from loader.caches import BoundedCache
from loader.errors import TransformError
from loader.transforms.document import Document, RowFetcher
from loader.transforms.probe import (CHECK_DOCUMENTS, RECHECK_AT, Probed, call_watched, compare_in_child,
                                     document_entry, needs_child, recheck, result_digest)
from loader.transforms.spec import TransformSpec

ID_LIMIT = 2**31  # lane files store ids as int32
UNCHANGED = object()  # apply_rows: the row's document came back as it was


@dataclass
class TransformCounts:
    """Per transform of a chain: ``[dropped, changed]`` documents (JSON: a list of pairs)."""

    counts: list[list[int]] = field(default_factory=list)

    @classmethod
    def zeros(cls, transforms: int) -> "TransformCounts":
        return cls([[0, 0] for _ in range(transforms)])

    @classmethod
    def from_state(cls, value: Sequence[Sequence[int]]) -> "TransformCounts":
        return cls([[int(d), int(c)] for d, c in value])

    def to_state(self) -> list[list[int]]:
        return [list(pair) for pair in self.counts]

    def add(self, other: "TransformCounts") -> None:
        for mine, theirs in zip(self.counts, other.counts):
            mine[0] += theirs[0]
            mine[1] += theirs[1]

    def plus(self, other: Optional["TransformCounts"]) -> "TransformCounts":
        total = TransformCounts(self.to_state())
        if other is not None:
            total.add(other)
        return total


def _same_array(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    return np.array_equal(np.asarray(a), np.asarray(b))


def _same_features(a: Any, b: Any) -> bool:
    if a is b:
        return True
    a, b = dict(a or {}), dict(b or {})
    return a.keys() == b.keys() and all(_same_array(a[k], b[k]) for k in a)


class TransformChain:
    """The transforms of one source, imported and ready (see the module docstring)."""

    def __init__(self, specs: Sequence[TransformSpec], *, seed: int, source: str, pretokenized: bool,
                 feature_names: Sequence[str] = (), first_position: int = 0, records: bool = False,
                 vocab_size: Optional[int] = None) -> None:
        self.specs = tuple(specs)  # resolved: stage and version filled in
        # Ids a tokens transform may return: [0, vocab_size), or [0, 2**31) when the vocabulary is
        # unknown (lane files hold int32: a larger id would wrap into another valid-looking one).
        self.id_limit = int(vocab_size) if vocab_size else ID_LIMIT
        # Position of specs[0] in the whole chain (its seeds, its name in messages): the Beam job
        # runs a chain's tokens-stage tail as a chain of its own, after tokenization.
        self.first_position = first_position
        self.functions: list[Callable] = [spec.load() for spec in self.specs]
        self.seed = seed
        self.source = source
        self.pretokenized = pretokenized
        self.feature_names = tuple(feature_names)
        self._checked = [0] * len(self.specs)
        self._checked_all = False
        self._probes: list[Probed] = []  # the probe documents, for the later and the other-process checks
        self._seen = 0  # documents given to the chain in this process
        self._rechecks = 0  # RECHECK_AT points passed
        self._next_recheck = RECHECK_AT[0]
        self._child_checked = not needs_child(self.specs)
        self._single: Optional[tuple] = None  # (function, args) once a one-function chain is checked
        self._steps = [(position, first_position + position, function, spec.args) for position, (function, spec) in
                       enumerate(zip(self.functions, self.specs))]
        for position, spec in enumerate(self.specs):
            if spec.stage == "records" and not records:
                raise TransformError(
                    f"transform {spec.qualified_name} (transforms[{first_position + position}] of source {source!r}) "
                    f"works on records (a chat conversation before rendering), but source {source!r} is not a chat "
                    "source rendered online; use a text or tokens transform")
            if spec.stage == "tokens" and not pretokenized:
                raise TransformError(
                    f"transform {spec.qualified_name} (transforms[{first_position + position}] of source {source!r}) "
                    "works on tokens, "
                    f"but source {source!r} is text tokenized by the loader: shard it with --tokenizer (its lane "
                    "files then hold input_ids), or use a text transform")

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def needs_text(self) -> bool:
        return any(spec.stage == "text" for spec in self.specs)

    def _where(self, position: int) -> str:
        return (f"transform {self.specs[position].qualified_name} (transforms[{self.first_position + position}] of "
                f"source {self.source!r})")

    def apply(self, document: Document, counts: TransformCounts) -> Optional[Document]:
        """The document after every transform (``None``: dropped); counts go to ``counts``."""
        self._seen += 1
        if self._seen >= self._next_recheck:
            self._recheck()
        if self._checked_all:
            return self._apply_checked(document, counts)
        for position, function in enumerate(self.functions):
            document.at_position(self.first_position + position)
            before = document
            result = self._call(position, function, document)
            if result is None:
                counts.counts[position][0] += 1
                document = None
                break
            if result is not before:
                self._check_result(position, before, result)
                if self._changed(before, result):
                    counts.counts[position][1] += 1
            document = result
        self._checked_all = all(n >= CHECK_DOCUMENTS for n in self._checked)
        if self._checked_all:
            self._probed()
        return document

    def _probed(self) -> None:
        """Every function has its probe documents: the other interpreter checks them once, and a
        one-function chain takes the fast path."""
        if not self._child_checked:
            self._child_checked = True
            compare_in_child(list(self._probes), self.specs, self._where)
        if len(self._steps) == 1 and not self.first_position:
            self._single = (self.functions[0], self.specs[0].args)

    def apply_rows(self, fetch: RowFetcher, rows: int, counts: TransformCounts) -> Optional[list]:
        """Every row of a row group through the chain: None when every document came back as it
        was, else per row :data:`UNCHANGED`, ``None`` (dropped) or the new document."""
        if self._single is not None:
            return self._rows_one(fetch, rows, counts)
        results: list = []
        changed = False
        document: Optional[Document] = None
        seed = self.seed
        for k in range(rows):
            if document is None:
                document = Document.of_row(fetch, k, seed)
            else:
                document.reset_row(k)  # returned as it was, or dropped: reused for the next row
            result = self.apply(document, counts)
            if result is document:
                results.append(UNCHANGED)
                continue
            changed = True
            results.append(result)
            if result is not None:
                document = None  # it is the result now
        return results if changed else None

    def _rows_one(self, fetch: RowFetcher, rows: int, counts: TransformCounts) -> Optional[list]:
        """:meth:`apply_rows` of a checked one-function chain: the loop per document is one call
        and a re-pointed document (what an identity transform costs, bench/loader_throughput.py)."""
        function, args = self._single
        self._seen += rows
        if self._seen >= self._next_recheck:
            self._recheck()
        if args:  # a call with no **{} for the argument-free functions (identity: its whole cost)
            function = functools.partial(function, **args)
        results: Optional[list] = None
        document = Document.of_row(fetch, 0, self.seed)
        reset = document.reset_row
        for k in range(rows):
            if k:
                reset(k)
            try:
                result = function(document)
            except Exception as exc:
                raise TransformError(f"{self._where(0)} failed on document {document.key!r} "
                                     f"({type(exc).__name__}: {exc}); fix the function or its args") from exc
            if result is document:
                continue
            if results is None:
                results = [UNCHANGED] * k
            results.extend([UNCHANGED] * (k - len(results)))
            if result is None:
                counts.counts[0][0] += 1
            else:
                self._check_result(0, document, result)
                if self._changed(document, result):
                    counts.counts[0][1] += 1
                document = Document.of_row(fetch, k, self.seed)  # the result keeps the old object
                reset = document.reset_row
            results.append(result)
        if results is not None:
            results.extend([UNCHANGED] * (rows - len(results)))
        return results

    def _apply_checked(self, document: Document, counts: TransformCounts) -> Optional[Document]:
        """:meth:`apply` once every function has passed the determinism check: the per-document
        path, kept to a call per transform for a function that returns its document as is."""
        position = 0
        try:
            for position, seed_position, function, args in self._steps:
                if seed_position:
                    document.at_position(seed_position)
                result = function(document, **args)
                if result is document:
                    continue
                if result is None:
                    counts.counts[position][0] += 1
                    return None
                self._check_result(position, document, result)
                if self._changed(document, result):
                    counts.counts[position][1] += 1
                document = result
        except TransformError:
            raise
        except Exception as exc:
            raise TransformError(f"{self._where(position)} failed on document {document.key!r} "
                                 f"({type(exc).__name__}: {exc}); fix the function or its args") from exc
        return document

    def _recheck(self) -> None:
        """The probe documents through their functions again (:func:`loader.transforms.probe.recheck`)."""
        self._rechecks += 1
        self._next_recheck = RECHECK_AT[self._rechecks] if self._rechecks < len(RECHECK_AT) else sys.maxsize
        recheck(list(self._probes), self.functions, self.specs, self._where, self._seen)
        if not self._child_checked:  # a filter before a function may leave it short of probe documents
            self._child_checked = True
            compare_in_child(list(self._probes), self.specs, self._where)

    def _call(self, position: int, function: Callable, document: Document) -> Optional[Document]:
        spec = self.specs[position]
        try:
            if self._checked[position] < CHECK_DOCUMENTS:
                self._checked[position] += 1
                where = self._where(position)
                entry = document_entry(document)
                first = call_watched(function, document.fresh_copy(), spec.args, where)
                second = call_watched(function, document, spec.args, where)
                if not self._same_result(first, second):
                    raise TransformError(
                        f"{self._where(position)} is not deterministic: called twice on document {document.key!r} "
                        f"it returned {first!r} and then {second!r}. A transform must be a function of the document "
                        "and its arguments only: draw random numbers from doc.seed (random.Random(doc.seed)), "
                        "never from a global generator, the clock or state kept between calls")
                self._probes.append(Probed(position, entry, result_digest(second)))
                return second
            return function(document, **spec.args)
        except TransformError:
            raise
        except Exception as exc:
            raise TransformError(f"{self._where(position)} failed on document {document.key!r} "
                                 f"({type(exc).__name__}: {exc}); fix the function or its args") from exc

    @staticmethod
    def _same_result(a: Optional[Document], b: Optional[Document]) -> bool:
        if a is None or b is None:
            return a is None and b is None
        if not isinstance(a, Document) or not isinstance(b, Document):
            return type(a) is type(b) and a == b
        return (a.text == b.text and _same_array(a.input_ids, b.input_ids)
                and _same_features(a.features, b.features) and a.metadata == b.metadata and a.record == b.record)

    def _check_result(self, position: int, before: Document, result: Any) -> None:
        if not isinstance(result, Document):
            raise TransformError(f"{self._where(position)} returned {type(result).__name__} for document "
                                 f"{before.key!r}; return the Document (doc, doc.replace(...)) or None to drop it")
        if (result._fetch is not before._fetch or result._index != before._index) and result.key != before.key:
            raise TransformError(f"{self._where(position)} changed the key of document {before.key!r} to "
                                 f"{result.key!r}; keys identify documents (seeds, deduplication) and cannot change")
        if result.loaded("record") and result.record is not None and not (
                isinstance(result.record, dict) and isinstance(result.record.get("messages"), list)):
            raise TransformError(f"{self._where(position)} returned a record that is not a conversation for document "
                                 f"{before.key!r} (got {str(result.record)[:80]!r}); return a dict with a 'messages' "
                                 "list (and 'tools' if any), or None to drop it")
        if result.loaded("text") and result.text is not None and not isinstance(result.text, str):
            raise TransformError(f"{self._where(position)} returned a text of type {type(result.text).__name__} "
                                 f"for document {before.key!r}; the text must be a str")
        if self.pretokenized and result.loaded("text") and result.text != before.text:
            raise TransformError(
                f"{self._where(position)} changed the text of document {before.key!r} of pre-tokenized source "
                f"{self.source!r}: its input_ids are not re-tokenized. Change input_ids instead (stage = \"tokens\"), "
                "apply the transform in `zephon shard --transform` before tokenization, or shard without --tokenizer")
        if self.pretokenized and result.loaded("input_ids"):
            ids = result.input_ids
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise TransformError(f"{self._where(position)} returned input_ids that are not a 1-D integer "
                                     f"array for document {before.key!r} (got {type(ids).__name__})")
            if ids.size:
                low, high = int(ids.min()), int(ids.max())
                if low < 0 or high >= self.id_limit:
                    bad = low if low < 0 else high
                    limit = (f"the vocabulary size {self.id_limit}" if self.id_limit != ID_LIMIT
                             else "2**31 (ids are stored as int32)")
                    raise TransformError(
                        f"{self._where(position)} returned input_id {bad} for document {before.key!r}: ids must be "
                        f">= 0 and below {limit}; return ids of the source's tokenizer")
            features = dict(result.features)
            if sorted(features) != sorted(self.feature_names):
                raise TransformError(f"{self._where(position)} returned features {sorted(features)} for document "
                                     f"{before.key!r}; source {self.source!r} has {sorted(self.feature_names)}")
            for name, values in features.items():
                if len(values) != len(ids):
                    raise TransformError(
                        f"{self._where(position)} returned {len(ids)} input_ids but {len(values)} values of feature "
                        f"{name!r} for document {before.key!r}: change both (every feature holds one value per id)")

    @staticmethod
    def _changed(before: Document, after: Document) -> bool:
        for name in ("text", "input_ids", "features", "metadata", "record"):
            if not after.loaded(name):
                continue
            if name == "record" and after.record != before.record:
                return True
            if name == "text" and after.text != before.text:
                return True
            if name == "input_ids" and not _same_array(after.input_ids, before.input_ids):
                return True
            if name == "features" and not _same_features(after.features, before.features):
                return True
            if name == "metadata" and after.metadata != before.metadata:
                return True
        return False


_chains: BoundedCache[TransformChain] = BoundedCache(64)


def chain_for(specs: Sequence[TransformSpec], *, seed: int, source: str, pretokenized: bool,
              feature_names: Sequence[str] = (), vocab_size: Optional[int] = None) -> Optional[TransformChain]:
    """The process's chain of these transforms for one source (None without transforms): the
    lanes of a source share it, so each function is imported and checked once per process."""
    if not specs:
        return None
    import json

    key = (json.dumps([s.to_entry() for s in specs], sort_keys=True), seed, source, pretokenized,
           tuple(feature_names), vocab_size)
    return _chains.get_or_make(key, lambda: TransformChain(specs, seed=seed, source=source, pretokenized=pretokenized,
                                                           feature_names=feature_names, vocab_size=vocab_size))
