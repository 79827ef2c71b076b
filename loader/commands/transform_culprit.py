"""``zephon diff``: which transform makes two runs differ, by trying each on a lane's documents.

When two runs of one config part, and a source of the differing sequence has transforms, the
culprit is usually a transform that is not a function of its document
(:mod:`loader.transforms.probe`). :func:`find_culprit` reads the first documents of that lane
(the first row group of each of its files, at most :data:`DOCUMENTS`) and tries the source's
transforms on them, stage by stage:

1. a fresh :class:`~loader.transforms.chain.TransformChain` on them, its every check forced
   (two calls, the global generators, the later re-check, the other interpreter);
2. then each transform again on the inputs it had, in reverse order: a result that differs
   from the first pass names the transform and the document.

The first finding is reported with the transform's name, position, version and its spec's
SHA-256 (what the config fingerprint holds of it). None found does not clear the transforms:
hidden state may drift later than these documents show.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import numpy as np
import pyarrow.parquet as pq

from loader.config import LoaderConfig
from loader.errors import TransformError
from loader.io.manifest import TOMBSTONE_COLUMN, Manifest
from loader.io.storage import open_lane_file
from loader.stages.features import FEATURES
from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document
from loader.transforms.probe import result_digest
from loader.transforms.rows import metadata_columns

DOCUMENTS = 64  # documents of the lane tried


def _ids(value: Any) -> np.ndarray:
    if isinstance(value, (bytes, bytearray)):
        array = np.frombuffer(value, dtype="<i4").astype(np.int32)
    else:
        array = np.asarray(value, dtype=np.int32)
    array.flags.writeable = False
    return array


def column_feature_names(manifest: Manifest) -> list[str]:
    """The features a dataset's lane files hold a column of (``loss_mask``)."""
    names = {c.get("name") for c in manifest.schema}
    return [name for name, feature in FEATURES.items() if feature.column and feature.column in names]


def lane_documents(config: LoaderConfig, source: int, manifest: Manifest, lane: int,
                   limit: int = DOCUMENTS) -> list[Document]:
    """The first ``limit`` live documents of ``lane`` of ``config``'s dataset ``source`` (the
    first row group of each file, in part order)."""
    metadata = metadata_columns(manifest)
    features = column_feature_names(manifest)
    documents: list[Document] = []
    for entry in manifest.lane_files(lane):
        if len(documents) >= limit or not entry.rows:
            break
        with open_lane_file(config.datasets[source].path, entry, config.storage_options()) as fh:
            table = pq.ParquetFile(fh).read_row_group(0).to_pylist()
        for row in table:
            if len(documents) >= limit:
                break
            if row.get(TOMBSTONE_COLUMN, -1) not in (None, -1):
                continue
            ids = _ids(row["input_ids"]) if manifest.pretokenized else None
            documents.append(Document(
                row["key"], text=row.get("text"), input_ids=ids, metadata=tuple((n, row.get(n)) for n in metadata),
                features={n: np.asarray(row[FEATURES[n].column], dtype=FEATURES[n].dtype) for n in features}
                if manifest.pretokenized else {}, seed_base=config.seed))
    return documents


def _identity(config: LoaderConfig, source: int, position: int) -> dict[str, Any]:
    spec = config.source_transforms(source)[position]
    entry = spec.to_entry()
    return {"function": spec.qualified_name, "position": position, "version": spec.version,
            "spec_sha256": hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()}


def find_culprit(config: LoaderConfig, source: int, manifest: Manifest, name: str, lane: int) -> Optional[dict]:
    """The transform of ``config``'s source ``source`` that is not deterministic on the first
    documents of ``lane`` (see the module docstring), or None."""
    configured = config.source_transforms(source)
    if not configured or manifest.online_chat:
        return None
    specs = tuple(spec.resolved(manifest.pretokenized) for spec in configured)
    feature_names = column_feature_names(manifest)
    documents = lane_documents(config, source, manifest, lane)
    found = _forced_checks(specs, documents, config.seed, name, manifest.pretokenized, feature_names)
    if found is None:
        found = _reverse_pass(specs, documents)
    if found is None:
        return None
    position, document, message = found
    return {"source": name, "lane": lane, "documents_tried": len(documents), "document": document,
            **_identity(config, source, position), "message": message}


def _forced_checks(specs, documents, seed, name, pretokenized, feature_names) -> Optional[tuple]:
    chain = TransformChain(specs, seed=seed, source=name, pretokenized=pretokenized, feature_names=feature_names)
    try:
        for document in documents:
            chain.apply(document.fresh_copy(), TransformCounts.zeros(len(specs)))
        chain._recheck()
    except TransformError as exc:
        text = str(exc)
        position = next((p for p in range(len(specs)) if f"(transforms[{p}] of source" in text), 0)
        key = text.split("document ", 1)[1].split(" ", 1)[0].strip("'") if "document " in text else None
        return position, key, text
    return None


def _reverse_pass(specs, documents) -> Optional[tuple]:
    """Each transform on its inputs forward, then in reverse order: a changed result names it."""
    inputs = [document.fresh_copy() for document in documents]
    for position, spec in enumerate(specs):
        function = spec.load()
        results = [function(doc.at_position(position), **spec.args) for doc in inputs]
        forward = [result_digest(result) for result in results]
        backward = [result_digest(function(doc.at_position(position), **spec.args)) for doc in reversed(inputs)][::-1]
        for doc, first, again in zip(inputs, forward, backward):
            if first[0] != again[0]:
                return position, doc.key, (f"transform {spec.qualified_name} (transforms[{position}]) gave "
                                           f"{first[1]} for document {doc.key!r}, then {again[1]} when its inputs "
                                           "went through again in reverse order: it keeps state between calls")
        inputs = [result for result in results if isinstance(result, Document)]
    return None
