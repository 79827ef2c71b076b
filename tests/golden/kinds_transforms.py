"""Transform functions of the golden pins, named by import path (``tests.golden.kinds_transforms:...``).

They live beside the pins rather than in the transform suite's ``tests/transforms/functions.py``
because a transform's import path is part of the config and manifest fingerprints: moving the
suite's test modules must not move a pin. The filters of the pins are built-ins; these are the
maps (one per stage), each seeded by the document (``doc.seed``), so the pins also cover the
per-document seed.
"""

from __future__ import annotations

import numpy as np

from loader.transforms import transform


@transform(stage="text", version="1")
def title_seeded_words(doc):
    """A seeded text map: each word put in title case with probability 1/2, drawn from ``doc.seed``."""
    draws = np.random.default_rng(doc.seed).random(doc.text.count(" ") + 1)
    return doc.replace(text=" ".join(w.title() if d < 0.5 else w for w, d in zip(doc.text.split(" "), draws)))


@transform(stage="tokens", version="1")
def rotate_ids_by_seed(doc):
    """A seeded token map: the ids (and every feature) rotated left by ``doc.seed mod length``."""
    if len(doc.input_ids) == 0:
        return doc
    shift = doc.seed % len(doc.input_ids)
    return doc.replace(input_ids=np.roll(doc.input_ids, -shift),
                       features={name: np.roll(values, -shift) for name, values in doc.features.items()})
