"""Transform functions the transform tests name by import path (``tests.transforms.functions:...``):
importable in worker processes and Beam workers alike (the repository root is on their path)."""

from __future__ import annotations

import itertools
import random

import numpy as np

from loader.transforms import transform


@transform(stage="text", version="1")
def drop_multiple_of_three(doc):
    """A filter: drops documents whose text length is a multiple of 3."""
    return None if len(doc.text) % 3 == 0 else doc


@transform(stage="text")
def shout_every_other_word(doc):
    """A map: every other word in capitals (changes the tokens)."""
    words = doc.text.split(" ")
    return doc.replace(text=" ".join(w.upper() if k % 2 else w for k, w in enumerate(words)))


@transform(stage="text")
def drop_random_words(doc, p: float = 0.3):
    """A seeded random map: each word dropped with probability ``p``, drawn from ``doc.seed``."""
    rng = random.Random(doc.seed)
    words = [w for w in doc.text.split(" ") if rng.random() >= p]
    return doc.replace(text=" ".join(words))


@transform(stage="tokens")
def drop_odd_length(doc):
    """A token filter: drops documents with an odd number of ids."""
    return None if len(doc.input_ids) % 2 else doc


@transform(stage="tokens")
def reverse_ids(doc):
    """A token map: the ids (and every feature) in reverse order."""
    return doc.replace(input_ids=doc.input_ids[::-1].copy(),
                       features={name: values[::-1].copy() for name, values in doc.features.items()})


@transform(stage="tokens")
def drop_random_tokens(doc, p: float = 0.2):
    """A seeded random token map: each id (with its feature values) kept with probability 1 - p."""
    keep = np.random.default_rng(doc.seed).random(len(doc.input_ids)) >= p
    return doc.replace(input_ids=doc.input_ids[keep],
                       features={name: values[keep] for name, values in doc.features.items()})


def unseeded_random_filter(doc):
    """Not deterministic: a global generator decides."""
    return doc if random.random() < 0.5 else None


_calls = itertools.count()


def hidden_state_map(doc):
    """Not deterministic: a counter kept between calls changes the text."""
    return doc.replace(text=f"{next(_calls)} {doc.text}")


def drop_all(doc):
    """Drops every document (a whole row group, a whole lane)."""
    return None


def drop_key_prefix(doc, prefix: str):
    """Drops the documents whose key starts with ``prefix``."""
    return None if doc.key.startswith(prefix) else doc


@transform(stage="records")
def drop_long_conversations(doc, max_messages: int = 3):
    """A records filter (online chat): drops conversations of more than ``max_messages`` messages."""
    return None if len(doc.record["messages"]) > max_messages else doc


@transform(stage="records")
def shout_replies(doc):
    """A records map (online chat): the assistant's text replies in capitals, before rendering."""
    record = doc.record
    for message in record["messages"]:
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            message["content"] = message["content"].upper()
    return doc.replace(record=record)


@transform(stage="tokens")
def drop_unsupervised_halves(doc):
    """A token filter that reads a feature: drops documents with more unmasked than masked tokens."""
    mask = doc.features["loss_mask"]
    return None if 2 * int(mask.sum()) < len(mask) else doc


def drop_lane(doc, lane: int, lanes: int, seed: int = 0):
    """Drops every document the sharding job puts in ``lane`` of ``lanes`` (with ``--seed seed``)."""
    from loader.order.hashing import lane_of_key

    return None if lane_of_key(seed, doc.key, lanes) == lane else doc
