"""Transforms that misbehave on purpose, named by import path by the adversarial tests
(``tests.adversarial.hostile_transforms:...``)."""

from __future__ import annotations

import numpy as np

from loader.transforms import transform


@transform(stage="tokens")
def set_id(doc, value: int, dtype: str = "int64"):
    """Every document's first id replaced by ``value`` (as ``dtype``): out-of-range ids on demand."""
    ids = np.asarray(doc.input_ids).astype(dtype)
    if len(ids):
        ids[0] = value
    return doc.replace(input_ids=ids, features=dict(doc.features))


@transform(stage="text")
def keep_only(doc, key: str):
    """Drops every document but the one with ``key``: a lane with one non-empty block."""
    return doc if doc.key == key else None
