"""The determinism promise, by batch fingerprint, for both packing modes.

The global batch at every step is the same for every world size W, worker count, micro-batch
size, prefetch depth, resume point (also resuming on another W / worker count), and for
text lanes tokenized online versus the same lanes pre-tokenized. The reference is always
one uninterrupted W=1 in-process ``collect_fingerprints`` run.
"""

from __future__ import annotations

import json

import pytest

from loader.commands.fingerprints import collect_fingerprints
from loader.commands.fingerprints import main as fingerprints_main
from tests.loader.settings import GLOBAL_BATCH
from tests.resume_harness import LoaderRun, check_resume, lane_epochs, loader_runs

STEPS = 30  # crosses every lane's first epoch boundary (an epoch is ~10 steps)


def lines(results) -> list[str]:
    return [r.line() for r in results]


def test_the_baseline_crosses_epoch_boundaries(make_config, packing):
    """The comparisons below are only meaningful if the runs reach epochs > 0 of every lane."""
    run = LoaderRun(make_config(packing))
    try:
        run.run(STEPS)
        epochs = lane_epochs(run.save())
    finally:
        run.close()
    assert all(e[0] >= 1 for e in epochs.values()), f"some lane never left epoch 0 in {STEPS} steps: {epochs}"


# (world_size, micro_batch_size, pre-tokenized): every W in {1, 2, 4, 8} and several micro-batches.
SIMULATED = [(1, 16, False), (1, 1, True), (2, 1, False), (2, 8, True), (4, 4, False), (4, 2, True),
             (8, 2, False), (8, 1, True)]


@pytest.mark.parametrize("world_size,micro,pretokenized", SIMULATED)
def test_world_size_and_micro_batch_do_not_change_batches(make_config, baseline, packing, world_size, micro,
                                                          pretokenized):
    config = make_config(packing, micro_batch_size=micro, pretokenized=pretokenized)
    results, _ = collect_fingerprints(config, world_size=world_size, end_step=STEPS)
    assert lines(results) == baseline(packing, STEPS)


def test_online_tokenization_equals_pretokenized_lanes(make_config, baseline, packing):
    text = baseline(packing, STEPS)
    pre, _ = collect_fingerprints(make_config(packing, pretokenized=True), world_size=1, end_step=STEPS)
    assert lines(pre) == text
    assert len(set(text)) == STEPS  # sanity: the steps really differ from each other


# (world_size, num_workers, micro_batch_size, prefetch): 3 workers do not divide a rank's lanes.
WITH_WORKERS = [(1, 3, 1, 1), (2, 1, 4, 3)]


@pytest.mark.parametrize("world_size,workers,micro,prefetch", WITH_WORKERS)
def test_worker_processes_and_prefetch_do_not_change_batches(make_config, baseline, packing, world_size, workers,
                                                             micro, prefetch):
    config = make_config(packing, num_workers=workers, micro_batch_size=micro, prefetch=prefetch)
    results, _ = collect_fingerprints(config, world_size=world_size, end_step=STEPS)
    assert lines(results) == baseline(packing, STEPS)


def test_harness_fingerprints_equal_collect_fingerprints(make_config, baseline, packing):
    """The resume harness and the audit command hash the same bytes."""
    run = LoaderRun(make_config(packing), world_size=2)
    try:
        assert run.run(5) == baseline(packing, STEPS)[:5]
    finally:
        run.close()


def test_resume_at_many_steps_on_other_topologies(make_config, baseline, epoch_edges, packing):
    """Cuts: before step 0, mid-epoch, right after a lane's epoch edge (twice in a row), later.

    Each segment runs on another W / worker count / micro-batch / prefetch than the one that
    saved, including a 3-worker segment whose state the next (in-process W=2) segment loads.
    """
    config = make_config(packing)
    edge = epoch_edges(packing)[0]
    topologies = [
        dict(world_size=1),  # the uninterrupted run
        dict(world_size=4, micro_batch_size=1),
        dict(world_size=1, num_workers=3, micro_batch_size=4, prefetch=1),
        dict(world_size=2, micro_batch_size=8),
        dict(world_size=8, micro_batch_size=1),
        dict(world_size=2, micro_batch_size=2),
        dict(world_size=4, micro_batch_size=4),
    ]
    cuts = [0, 3, edge, edge, 22]
    check_resume(loader_runs(config, topologies), steps=STEPS, cut_points=cuts, expected=baseline(packing, STEPS))


def test_collect_fingerprints_saves_and_loads_across_world_sizes(make_config, baseline, packing):
    config = make_config(packing)
    first, state = collect_fingerprints(config, world_size=4, end_step=9, save_state_step=9)
    rest, _ = collect_fingerprints(config.replace(micro_batch_size=1), world_size=8, start_step=9,
                                   end_step=STEPS, load_state=json.loads(json.dumps(state)))
    assert lines(first) + lines(rest) == baseline(packing, STEPS)
    assert state["next_global_index"] == 9 * GLOBAL_BATCH


def test_fingerprints_cli_round_trip(tmp_path, make_config, baseline, packing, capsys):
    config = make_config(packing)
    config_path = tmp_path / "loader.json"
    data = config.to_dict()
    data["datasets"] = [{"path": d["path"]} for d in data["datasets"]]
    config_path.write_text(json.dumps(data))
    state_path = tmp_path / "state.json"

    assert fingerprints_main([str(config_path), "--world-size", "2", "--steps", "0:6",
                              "--save-state", "6", str(state_path)]) == 0
    first = capsys.readouterr().out.splitlines()
    assert fingerprints_main([str(config_path), "--world-size", "8", "--micro-batch", "1", "--steps", "6:12",
                              "--load-state", str(state_path)]) == 0
    second = capsys.readouterr().out.splitlines()
    assert first + second == baseline(packing, STEPS)[:12]
