"""A checkpoint written by the landed code (before the per-token-features refactor) resumes
today's loader on the identical stream, on another world size and worker count.

The fixture and how it was made: :mod:`tests.golden.landed_checkpoint`. Its checkpoints are
``version`` 1; today's format is 2 (best-fit bins say where each piece came from), and
:mod:`loader.checkpoint.migrations` upgrades them on load: this test is what says the upgraded
state continues the identical stream.
"""

from __future__ import annotations

import json
import os

import pytest

from loader.checkpoint.state import STATE_VERSION
from loader.commands.fingerprints import collect_fingerprints
from loader.io.manifest import read_manifest
from tests.resume_harness import LoaderRun
from tests.golden.landed_checkpoint import CONFIGS, END_STEP, SAVE_STEP, build_datasets, config_of

FIXTURE = os.path.join(os.path.dirname(__file__), "landed_checkpoint.json")


@pytest.fixture(scope="module")
def landed() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return build_datasets(str(tmp_path_factory.mktemp("landed")))


def fingerprints(lines) -> list[list]:
    return [[f.step, f.sha256, f.source_counts] for f in lines]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_todays_datasets_and_stream_are_the_landed_ones(landed, paths, name) -> None:
    saved = landed["configs"][name]
    config = config_of(name, paths)
    for source in saved["state"]["sources"]:
        manifest = read_manifest(paths[source["name"]])
        assert manifest.dataset_fingerprint == source["dataset_fingerprint"], (
            f"today's factory writes {source['name']} differently from the landed code's: the fixture's "
            "datasets must be rebuilt identically for its checkpoints to mean anything")
    lines, _ = collect_fingerprints(config, world_size=1, end_step=END_STEP)
    assert fingerprints(lines) == saved["fingerprints"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("world_size,num_workers", [(4, 0), (1, 2)])
def test_a_landed_checkpoint_continues_identically(landed, paths, name, world_size, num_workers) -> None:
    saved = landed["configs"][name]
    assert saved["state"]["version"] == 1 < STATE_VERSION  # loaded through loader.checkpoint.migrations
    run = LoaderRun(config_of(name, paths).replace(num_workers=num_workers), world_size=world_size)
    try:
        run.load(saved["state"])
        for loader in run.loaders:
            loader.wait_for_workers(timeout_s=120)  # else the warm start serves these steps in-process
        lines = run.run(END_STEP - SAVE_STEP)
    finally:
        run.close()
    assert [line.split()[:2] for line in lines] == [[str(step), sha] for step, sha, _ in saved["fingerprints"][SAVE_STEP:]]


def test_the_audit_of_a_landed_best_fit_checkpoint_replays_and_says_why(landed, paths) -> None:
    """A version-1 best-fit checkpoint's bins do not say where their pieces came from: the audit
    replays from step 0 (the same report as without the checkpoint) and its notes say why."""
    from loader.commands.audit import audit_step

    config = config_of("best_fit_mix", paths)
    audit = audit_step(config, SAVE_STEP + 2, load_state=landed["configs"]["best_fit_mix"]["state"])
    assert audit.method == "replay" and "version-1 checkpoint" in audit.notes[0]
    assert audit.sequences == audit_step(config, SAVE_STEP + 2).sequences
