"""Transforms that misbehave on purpose, named by import path by the adversarial tests
(``tests.adversarial.hostile_transforms:...``)."""

from __future__ import annotations

import itertools
import os
import random
import time

import numpy as np

from loader.transforms import transform
from loader.transforms.probe import probe_pid


@transform(stage="tokens")
def set_id(doc, value: int, dtype: str = "int64", outside_pid: int = 0):
    """Every document's first id replaced by ``value`` (as ``dtype``): out-of-range ids on demand.
    With ``outside_pid``, only in processes other than that one (a loader worker's, not the trainer's)."""
    if outside_pid and probe_pid() == outside_pid:
        return doc
    ids = np.asarray(doc.input_ids).astype(dtype)
    if len(ids):
        ids[0] = value
    return doc.replace(input_ids=ids, features=dict(doc.features))


@transform(stage="text")
def keep_only(doc, key: str, outside_pid: int = 0):
    """Drops every document but the one with ``key``: a lane with one non-empty block.
    With ``outside_pid``, only in processes other than that one."""
    if outside_pid and probe_pid() == outside_pid:
        return doc
    return doc if doc.key == key else None


# -- not deterministic, each in a way the 8-document double call does not see ------------------
_calls = itertools.count()


@transform(stage="text")
def quota(doc, after: int = 20):
    """A counter: keeps the first ``after`` calls' documents, drops every later one."""
    return doc if next(_calls) < after else None


_pairs = itertools.count()


@transform(stage="text")
def pair_counter(doc):
    """A counter read as calls // 2: the probe's two calls of one document agree."""
    return doc.replace(text=f"{next(_pairs) // 2} {doc.text}")


@transform(stage="text")
def rare_random(doc, p: float = 0.02):
    """Python's global generator, rarely decisive: drops about ``p`` of the documents."""
    return None if random.random() < p else doc


@transform(stage="text")
def rare_numpy_random(doc, p: float = 0.02):
    """NumPy's legacy global generator, rarely decisive."""
    return None if np.random.random() < p else doc


@transform(stage="text")
def clock_stamp(doc):
    """The clock in the text."""
    return doc.replace(text=f"{doc.text} {time.perf_counter_ns()}")


@transform(stage="text")
def object_address(doc):
    """``id()`` of the document object in the text."""
    return doc.replace(text=f"{doc.text} {id(doc) % 997}")


@transform(stage="text")
def word_set(doc):
    """The words in ``set`` order: stable inside a process, another order in the next one."""
    return doc.replace(text=" ".join(set(doc.text.split())))


@transform(stage="text")
def salted_hash(doc):
    """``hash()`` of the key (salted per process) in the text."""
    return doc.replace(text=f"{doc.text} {hash(doc.key) % 1000}")


def _remembering():
    seen: list = []

    @transform(stage="text")
    def remembering(doc):
        seen.append(doc.key)
        return doc.replace(text=f"{doc.text} {len(set(seen)) // 16}")

    remembering.seen = seen
    return remembering


remembering = _remembering()  # a closure over a list: how many distinct documents it has seen, / 16


def reset_counters() -> None:
    """The counters back at 0 (a test's first call is then the process's first)."""
    global _calls, _pairs
    _calls, _pairs = itertools.count(), itertools.count()
    remembering.seen.clear()
NOT_DETERMINISTIC = ("quota", "pair_counter", "rare_random", "rare_numpy_random", "clock_stamp", "object_address",
                     "word_set", "salted_hash", "remembering")
SEEN_BY_TWO_CALLS = ("clock_stamp", "object_address")  # the others pass two calls on each of 8 documents
