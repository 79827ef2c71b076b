"""Transforms that misbehave on purpose, named by import path by the adversarial tests
(``tests.adversarial.hostile_transforms:...``)."""

from __future__ import annotations

import os

import numpy as np

from loader.transforms import transform


@transform(stage="tokens")
def set_id(doc, value: int, dtype: str = "int64", outside_pid: int = 0):
    """Every document's first id replaced by ``value`` (as ``dtype``): out-of-range ids on demand.
    With ``outside_pid``, only in processes other than that one (a loader worker's, not the trainer's)."""
    if outside_pid and os.getpid() == outside_pid:
        return doc
    ids = np.asarray(doc.input_ids).astype(dtype)
    if len(ids):
        ids[0] = value
    return doc.replace(input_ids=ids, features=dict(doc.features))


@transform(stage="text")
def keep_only(doc, key: str, outside_pid: int = 0):
    """Drops every document but the one with ``key``: a lane with one non-empty block.
    With ``outside_pid``, only in processes other than that one."""
    if outside_pid and os.getpid() == outside_pid:
        return doc
    return doc if doc.key == key else None
