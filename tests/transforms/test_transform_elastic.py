"""The elastic-determinism suite with transforms: a filter, a map and a seeded random map.

Text transforms on a text source (applied before tokenization) and token transforms on a
pre-tokenized source (after), in both packings: the same global batches for every world size,
worker count (workers import the functions themselves) and micro-batch size, and across resumes
on another world size and worker count, through epoch boundaries; the saved states are the same
whichever way they were reached, and they hold counters only.
"""

from __future__ import annotations

import json
from contextlib import closing

import pytest

from tests.resume_harness import LoaderRun, check_resume
from tests.transforms.conftest import TEXT_TRANSFORMS, TOKEN_TRANSFORMS, loader_config

STEPS = 12  # an epoch of a lane ends within ~10 steps: the last segment crosses epoch boundaries
# (world_size, num_workers, micro_batch_size); global batch 8. The first is the reference.
TOPOLOGIES = ((1, 0, 2), (2, 2, 4), (4, 0, 1))
RESUME = ((1, 0, 8), (2, 2, 2), (4, 0, 1))
CASES = (("text", "concat"), ("pretokenized", "best_fit"))


def _lines(config, world_size: int, num_workers: int, micro: int) -> list[str]:
    with closing(LoaderRun(config.replace(num_workers=num_workers, micro_batch_size=micro), world_size)) as run:
        return run.run(STEPS)


@pytest.mark.parametrize("kind,packing", CASES)
def test_transformed_batches_are_the_same_on_every_topology_and_across_resumes(transform_corpus, kind, packing):
    path = transform_corpus.text_path if kind == "text" else transform_corpus.pretokenized_path
    transforms = TEXT_TRANSFORMS if kind == "text" else TOKEN_TRANSFORMS
    config = loader_config(path, transforms, packing=packing)
    reference = _lines(config, *TOPOLOGIES[0])
    assert len(reference) == STEPS
    assert reference != _lines(loader_config(path, packing=packing), *TOPOLOGIES[0])  # the transforms act
    for topology in TOPOLOGIES[1:]:
        assert _lines(config, *topology) == reference, f"(W, workers, micro) = {topology}"

    def make(k: int) -> LoaderRun:
        world_size, num_workers, micro = RESUME[k % len(RESUME)]
        return LoaderRun(config.replace(num_workers=num_workers, micro_batch_size=micro), world_size)

    report = check_resume(make, steps=STEPS, cut_points=[4, 9], expected=reference)
    state = json.loads(report.states[9])
    streams = [s["packer"]["stream"] for lane in state["lanes"].values() for s in lane["sources"].values()]
    counts = [stream["transforms"] for stream in streams]
    assert all(len(c) == len(transforms) for c in counts)
    dropped = sum(c[0][0] for c in counts)
    changed = sum(c[1][1] for c in counts)
    assert dropped > 0 and changed > 0  # the filter dropped, the map changed (counted in the state)
    assert state["transforms"]["sources"]["synthetic"][0]["function"] == transforms[0]["function"]


def test_transforms_under_token_mixing_are_the_same_on_every_topology(transform_corpus):
    """Token mixing takes documents of two sources in bulk (states inside the next row group)."""
    datasets = [{"path": transform_corpus.text_path, "name": "text", "weight": 0.5,
                 "transforms": list(TEXT_TRANSFORMS)},
                {"path": transform_corpus.pretokenized_path, "name": "pre", "weight": 0.5,
                 "transforms": list(TOKEN_TRANSFORMS)}]
    config = loader_config(transform_corpus.text_path, datasets=datasets, mixing_unit="token")
    reference = _lines(config, 1, 0, 2)
    assert _lines(config, 2, 2, 2) == reference

    def make(k: int) -> LoaderRun:
        world_size, num_workers, micro = RESUME[k % len(RESUME)]
        return LoaderRun(config.replace(num_workers=num_workers, micro_batch_size=micro), world_size)

    check_resume(make, steps=STEPS, cut_points=[5], expected=reference)
