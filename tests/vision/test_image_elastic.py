"""The elastic-determinism suite with an image source, alone and mixed with a text source.

The step line (``tests/resume_harness.LoaderRun``, the same bytes as ``zephon fingerprints``)
covers each sequence's ids and labels and, for image configs, its images' positions, grids and
``pixel_values``: two lines agree only when the pixels do. Every topology (W 1/2/4, workers 0/2,
micro-batch sizes) gives the reference lines, and so does a run cut twice and resumed each
time on another W and worker count (best-fit bins holding image refs travel in the checkpoint).
"""

from __future__ import annotations

import pytest

from image_loader_data import DYNAMIC, NUM_LANES, image_config, image_tokenizer, shard_images
from loader.commands.fingerprints import collect_fingerprints
from loader.stages.tokenizer import load_tokenizer
from tests.dataset_factory import synthetic_texts, write_dataset
from tests.resume_harness import LoaderRun, check_resume, loader_runs

STEPS = 4
# (world_size, num_workers, micro_batch_size); global batch 8. The first is the reference.
TOPOLOGIES = ((1, 0, 2), (2, 2, 2), (4, 0, 1))
RESUME = ({"world_size": 1, "num_workers": 0, "micro_batch_size": 4},
          {"world_size": 2, "num_workers": 2, "micro_batch_size": 2},
          {"world_size": 4, "num_workers": 0, "micro_batch_size": 1})


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_elastic")
    tokenizer = image_tokenizer(root / "tokenizer.json")
    images = {"path": shard_images(root, root / "images", 40, DYNAMIC), "name": "images", "weight": 0.5}
    texts = synthetic_texts(48, seed=5, max_words=40)
    write_dataset(str(root / "text"), texts, num_lanes=NUM_LANES, source_name="text",
                  tokenizer=load_tokenizer(tokenizer), keys=[f"text-{k}" for k in range(len(texts))])
    text = {"path": str(root / "text"), "name": "text", "weight": 0.5}
    return {"images": image_config([images], tokenizer, images={"max_images_per_sequence": 3}),
            "images+text": image_config([images, text], tokenizer)}


def _lines(config, world_size: int, num_workers: int, micro: int) -> list[str]:
    run = LoaderRun(config.replace(num_workers=num_workers, micro_batch_size=micro), world_size)
    try:
        return run.run(STEPS)
    finally:
        run.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mix", ("images", "images+text"))
def test_image_batches_are_the_same_on_every_topology_and_across_a_resume(configs, mix):
    config = configs[mix]
    reference = _lines(config, *TOPOLOGIES[0])
    assert len(reference) == STEPS
    results, _ = collect_fingerprints(config, world_size=1, end_step=STEPS)
    # the harness hashes what `zephon fingerprints` does (which adds supervised-token counts)
    assert [r.line().split(" supervised:")[0] for r in results] == reference
    assert all(r.supervised_counts["images"] > 0 for r in results)
    for topology in TOPOLOGIES[1:]:
        assert _lines(config, *topology) == reference, f"(W, workers, micro) = {topology}"
    check_resume(loader_runs(config, RESUME), steps=STEPS, cut_points=[1, 3], expected=reference)
    if mix == "images+text":
        assert all(" images=" in line and " text=" in line for line in reference)
