"""The document a transform function sees, and its per-document seed.

A :class:`Document` is ``key`` plus what its source holds: ``text`` (text sources, and the
text column of pre-tokenized ones), ``input_ids`` (pre-tokenized sources: the ids without the
BOS/EOS the loader adds, int32, read-only), ``features`` (per-token arrays aligned with the
ids, e.g. ``loss_mask``, read-only), ``record`` (online chat sources, records stage: the
conversation as a dict, ``{"messages": [...]}`` plus ``"tools"`` when it has some), ``metadata``
(the ``--keep-fields`` values, decoded from JSON; a fresh dict per call) and ``seed``. Fields are fetched from the row group only when a
function reads them, so a transform that looks at one field costs one field.

``seed`` is the document's only source of randomness: ``stable_hash64(seed, "transform",
position, key)`` for the transform at ``position`` of the source's chain (each transform of a
chain draws independently). It is the same in every process, rank, worker, epoch and in the
Beam job, which is what makes a random map deterministic. Use it as ``random.Random(doc.seed)``
or ``numpy.random.default_rng(doc.seed)``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional

import numpy as np

from loader.order.hashing import stable_hash64

_UNSET = object()


def document_seed(seed: int, position: int, key: str) -> int:
    """The seed of the document ``key`` for the transform at ``position`` of its chain (uint64)."""
    return stable_hash64(seed, "transform", position, key)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class Document:
    """One document, as a transform sees it (see the module docstring). Return it unchanged,
    a :meth:`replace`-d copy, or ``None`` to drop it."""

    __slots__ = ("_key", "_text", "_ids", "_features", "_metadata", "_fetch", "_index", "_seed_base", "_position",
                 "_seed", "_record")

    def __init__(self, key: Any, *, text: Any = _UNSET, input_ids: Any = _UNSET, features: Any = _UNSET,
                 metadata: Any = _UNSET, fetch: Optional["RowFetcher"] = None, index: int = -1,
                 seed_base: int = 0, record: Any = _UNSET) -> None:
        self._key = key  # _UNSET: read from the row group when first asked for
        self._text = text
        self._ids = input_ids
        self._features = features
        self._metadata = metadata  # JSON text per field (as stored) or a dict
        self._record = record
        self._fetch = fetch
        self._index = index
        self._seed_base = seed_base
        self._position = 0
        self._seed: Optional[int] = None

    @classmethod
    def of_row(cls, fetch: "RowFetcher", index: int, seed_base: int) -> "Document":
        """Row ``index`` of a row group, every field read on demand (the per-document hot path)."""
        doc = cls.__new__(cls)
        doc._key = doc._text = doc._ids = doc._features = doc._metadata = doc._record = _UNSET
        doc._fetch, doc._index, doc._seed_base, doc._position, doc._seed = fetch, index, seed_base, 0, None
        return doc

    def reset_row(self, index: int) -> None:
        """Become row ``index`` of the same row group (a document its function returned as is
        is reused for the next row: no object per row on the hot path)."""
        self._key = self._text = self._ids = self._features = self._metadata = self._record = _UNSET
        self._index, self._position, self._seed = index, 0, None

    # -- fields ----------------------------------------------------------------------------
    @property
    def key(self) -> str:
        if self._key is _UNSET:
            self._key = self._fetch.key(self._index)
        return self._key

    @property
    def text(self) -> Optional[str]:
        if self._text is _UNSET:
            self._text = self._fetch.text(self._index) if self._fetch is not None else None
        return self._text

    @property
    def input_ids(self) -> Optional[np.ndarray]:
        if self._ids is _UNSET:
            self._ids = self._fetch.input_ids(self._index) if self._fetch is not None else None
        return self._ids

    @property
    def features(self) -> Mapping[str, np.ndarray]:
        if self._features is _UNSET:
            self._features = self._fetch.features(self._index) if self._fetch is not None else {}
        return self._features

    @property
    def record(self) -> Optional[dict]:
        """The conversation of an online chat document (records stage), else None; a fresh copy
        per call (like ``metadata``): change it, then return ``doc.replace(record=...)``."""
        if self._record is _UNSET:
            self._record = self._fetch.record(self._index) if self._fetch is not None else None
        return None if self._record is None else json.loads(json.dumps(self._record))

    @property
    def metadata(self) -> dict[str, Any]:
        if self._metadata is _UNSET:
            self._metadata = self._fetch.metadata(self._index) if self._fetch is not None else {}
        if isinstance(self._metadata, dict):
            return dict(self._metadata)
        return {name: None if value is None else json.loads(value) for name, value in self._metadata}

    @property
    def seed(self) -> int:
        """This document's seed for the transform being applied (see :func:`document_seed`)."""
        if self._seed is None:
            self._seed = document_seed(self._seed_base, self._position, self.key)
        return self._seed

    # -- building results --------------------------------------------------------------------
    def replace(self, *, text: Any = _UNSET, input_ids: Any = _UNSET, features: Any = _UNSET,
                metadata: Any = _UNSET, record: Any = _UNSET) -> "Document":
        """A copy with the given fields changed (``input_ids`` and ``features`` together when
        a map changes the number of ids: every feature holds one value per id)."""
        copy = self.fresh_copy()  # fields not given stay as they are (unread ones unread)
        for slot, value in (("_text", text), ("_ids", input_ids), ("_features", features), ("_metadata", metadata),
                            ("_record", record)):
            if value is not _UNSET:
                setattr(copy, slot, value)
        return copy

    def at_position(self, position: int) -> "Document":
        """The document as the transform at ``position`` sees it (its seed)."""
        if position != self._position:
            self._position = position
            self._seed = None
        return self

    def fresh_copy(self) -> "Document":
        """An independent copy with the same content (the determinism check calls twice)."""
        copy = Document(self._key, fetch=self._fetch, index=self._index, seed_base=self._seed_base)
        for slot in ("_text", "_ids", "_features", "_record"):  # a record is read as a copy (see record)
            setattr(copy, slot, getattr(self, slot))
        copy._metadata = self._metadata if not isinstance(self._metadata, dict) else dict(self._metadata)
        copy._position = self._position
        return copy

    def loaded(self, name: str) -> bool:
        """Whether field ``name`` (``text``, ``input_ids``, ``features``, ``metadata``, ``record``) was read or set."""
        return getattr(self, {"text": "_text", "input_ids": "_ids", "features": "_features",
                              "metadata": "_metadata", "record": "_record"}[name]) is not _UNSET

    def __repr__(self) -> str:
        parts = [f"key={self.key!r}"]  # reads the key: only for messages
        if self.loaded("text") and self._text is not None:
            parts.append(f"text={self._text[:40]!r}{'...' if len(self._text) > 40 else ''}")
        if self.loaded("input_ids") and self._ids is not None:
            parts.append(f"input_ids=<{len(self._ids)} ids>")
        return f"Document({', '.join(parts)})"


class RowFetcher:
    """The fields of a row group's documents by index, fetched on demand (see :mod:`loader.transforms.rows`)."""

    def __init__(self, *, keys: Optional[Callable[[int], str]] = None, texts: Optional[Callable[[int], str]] = None,
                 ids: Optional[Callable[[int], np.ndarray]] = None,
                 features: Optional[Callable[[int], Mapping[str, np.ndarray]]] = None,
                 metadata: Optional[Callable[[int], Any]] = None, records: Optional[Callable[[int], dict]] = None) -> None:
        self._keys, self._texts, self._ids, self._features_of, self._metadata = keys, texts, ids, features, metadata
        self._records = records

    def key(self, index: int) -> str:
        return self._keys(index)

    def text(self, index: int) -> Optional[str]:
        return None if self._texts is None else self._texts(index)

    def input_ids(self, index: int) -> Optional[np.ndarray]:
        return None if self._ids is None else _read_only(self._ids(index))

    def features(self, index: int) -> Mapping[str, np.ndarray]:
        if self._features_of is None:
            return {}
        return {name: _read_only(values) for name, values in self._features_of(index).items()}

    def metadata(self, index: int) -> Any:
        return {} if self._metadata is None else self._metadata(index)

    def record(self, index: int) -> Optional[dict]:
        return None if self._records is None else self._records(index)
