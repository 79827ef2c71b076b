"""State as of a step boundary (``state_dict(step=t)``) and the data-parallel identity.

Frameworks fetch micro-batches ahead of the model; a checkpoint must hold the state of
what was trained. These tests fetch ahead like a framework would, take the boundary state,
resume on another world size and compare every later step's fingerprint with an
uninterrupted run.
"""

from __future__ import annotations

import json
import logging

import pytest

from loader.order import data_parallel
from loader.order.ordering import TopologyError
from loader.pipeline import ZephonLoader
from loader.checkpoint.state import StateError, dumps, merge_rank_states
from tests.resume_harness import LoaderRun

STEPS = 12


def _fetch(loader: ZephonLoader, micro_batches: int) -> None:
    for _ in range(micro_batches):
        next(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("ahead", [1, 3])
def test_boundary_state_after_fetching_ahead_resumes_exactly(make_config, baseline, packing, num_workers, ahead):
    config = make_config(packing, num_workers=num_workers, micro_batch_size=2)
    expected = baseline(packing, STEPS)
    cut = 5
    loaders = [ZephonLoader(config, rank=r, world_size=2) for r in range(2)]
    try:
        micro_steps = loaders[0].topology.micro_steps_per_step
        for loader in loaders:
            # What a framework does: the model trained `cut` steps, the fetcher holds more.
            _fetch(loader, cut * micro_steps + ahead)
            assert loader.rank_position > cut * loader.topology.per_rank_batch
        states = [loader.state_dict(step=cut) for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()
    merged = merge_rank_states(states)
    assert merged["next_global_index"] == cut * config.global_batch_size
    for world_size in (1, 4):
        run = LoaderRun(config.replace(num_workers=0, micro_batch_size=1), world_size=world_size)
        try:
            run.load(json.loads(dumps(merged)))
            assert run.run(STEPS - cut) == expected[cut:], f"resume on W={world_size} from a fetched-ahead rank"
        finally:
            run.close()


def test_boundary_state_equals_the_state_taken_at_the_boundary(make_config, packing):
    """Bytes of state_dict(step=t) taken later == state_dict() taken right at boundary t."""
    config = make_config(packing)
    with ZephonLoader(config, rank=1, world_size=2) as at_boundary, \
            ZephonLoader(config, rank=1, world_size=2) as later:
        per_step = at_boundary.topology.micro_steps_per_step
        exact = {}
        for step in range(1, 7):
            _fetch(at_boundary, per_step)
            exact[step] = dumps(at_boundary.state_dict())
        _fetch(later, 6 * per_step + 1)  # one micro-batch into step 6
        kept = later.state_dict(step=6)
        assert dumps(kept) == exact[6]
        for step in (3, 4, 5):  # step_states_kept = 4: boundaries 3..6 are kept
            assert dumps(later.state_dict(step=step)) == exact[step]
        with pytest.raises(StateError, match=r"no state is kept for the boundary before step 2.*steps \[3, 4, 5, 6\]"):
            later.state_dict(step=2)
        with pytest.raises(StateError, match="only be taken for a step already reached"):
            later.state_dict(step=8)
        with pytest.raises(StateError, match="step number >= 0"):
            later.state_dict(step=-1)


def test_step_zero_and_a_restored_boundary_are_kept(make_config):
    config = make_config("concat")
    with ZephonLoader(config) as loader:
        fresh = dumps(loader.state_dict(step=0))
        _fetch(loader, 3)
        assert dumps(loader.state_dict(step=0)) == fresh
        _fetch(loader, loader.topology.micro_steps_per_step * 3 - 3)
        saved = loader.state_dict()
    with ZephonLoader(config) as resumed:
        resumed.load_state_dict(saved)
        _fetch(resumed, 1)
        assert dumps(resumed.state_dict(step=3)) == dumps(saved)
        with pytest.raises(StateError, match="steps \\[3\\]"):
            resumed.state_dict(step=2)  # before the restore: not ours to know


def test_no_kept_states_still_gives_the_current_boundary(make_config):
    config = make_config("concat", step_states_kept=0)
    with ZephonLoader(config) as loader:
        _fetch(loader, loader.topology.micro_steps_per_step * 2)
        assert dumps(loader.state_dict(step=2)) == dumps(loader.state_dict())
        _fetch(loader, 1)
        with pytest.raises(StateError, match="step_states_kept, now 0"):
            loader.state_dict(step=2)


def test_global_state_dict_on_one_rank_and_mid_step(make_config):
    config = make_config("concat")
    with ZephonLoader(config) as loader:
        _fetch(loader, loader.topology.micro_steps_per_step * 2)
        merged = loader.global_state_dict()
        assert merged == merge_rank_states([loader.state_dict()])
        _fetch(loader, 1)
        with pytest.raises(StateError, match="mid-step"):
            loader.global_state_dict()
        assert loader.global_state_dict(step=2) == merged
    with ZephonLoader(config, rank=0, world_size=2) as loader:
        with pytest.raises(StateError, match="torch.distributed, which is not initialised"):
            loader.global_state_dict(step=0)


def test_dp_rank_names_the_same_identity_as_rank(make_config):
    config = make_config("concat")
    with ZephonLoader(config, dp_rank=1, dp_world_size=2) as a, ZephonLoader(config, rank=1, world_size=2) as b:
        assert a.rank_lanes == b.rank_lanes
        assert [dumps({"x": next(a)["input_ids"].tolist()}) for _ in range(3)] == \
               [dumps({"x": next(b)["input_ids"].tolist()}) for _ in range(3)]
    for kwargs, message in [
        (dict(rank=0, world_size=2, dp_rank=0, dp_world_size=2), "one way only"),
        (dict(dp_rank=0), "together"),
        (dict(rank=1), "together"),
        (dict(dp_rank="0", dp_world_size=2), "must be an integer"),
        (dict(dp_mesh_dim="dp"), "no device_mesh"),
    ]:
        with pytest.raises(TopologyError, match=message):
            ZephonLoader(config, **kwargs)


class _FakeMesh:
    """The part of DeviceMesh the loader reads (a real mesh is tested under torchrun)."""

    mesh_dim_names = ("dp", "tp")

    def __init__(self, coords: dict, sizes: dict) -> None:
        self.coords, self.sizes = coords, sizes

    def get_local_rank(self, dim=None):
        return self.coords[dim]

    def size(self, dim=None):  # like DeviceMesh.size: the dimension's index, not its name
        return self.sizes[self.mesh_dim_names[dim]]

    def get_group(self, dim=None):
        return f"group-{dim}"


def test_device_mesh_gives_the_data_parallel_coordinate(make_config):
    config = make_config("concat")
    mesh = _FakeMesh({"dp": 1, "tp": 0}, {"dp": 2, "tp": 2})
    with ZephonLoader(config, device_mesh=mesh, dp_mesh_dim="dp") as loader:
        assert (loader.topology.rank, loader.topology.world_size) == (1, 2)
        assert loader.dp_group == "group-dp"
    with pytest.raises(TopologyError, match="name the data-parallel one"):
        ZephonLoader(config, device_mesh=mesh)
    with pytest.raises(TopologyError, match="not a dimension"):
        ZephonLoader(config, device_mesh=mesh, dp_mesh_dim="data")


def test_identity_from_the_environment_is_logged_once(make_config, monkeypatch, caplog):
    monkeypatch.setattr(data_parallel, "_logged_env_identity", False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = make_config("concat")
    with caplog.at_level(logging.INFO, logger="loader.order.data_parallel"):
        with ZephonLoader(config) as loader:
            assert (loader.topology.rank, loader.topology.world_size) == (1, 2)
        with ZephonLoader(config):
            pass
    warnings = [r for r in caplog.records if r.name == "loader.order.data_parallel"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "dp_rank" in warnings[0].getMessage() and "device_mesh" in warnings[0].getMessage()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(TopologyError, match="WORLD_SIZE='two'"):
        ZephonLoader(config)


def test_merge_takes_identical_peer_states_once_and_refuses_different_ones(make_config):
    config = make_config("concat")
    loaders = [ZephonLoader(config, rank=r, world_size=2) for r in (0, 1, 0, 1)]  # 2 DP x 2 TP peers
    try:
        for loader in loaders:
            _fetch(loader, loader.topology.micro_steps_per_step)
        states = [loader.state_dict() for loader in loaders]
        assert merge_rank_states(states) == merge_rank_states(states[:2])
        _fetch(loaders[2], loaders[2].topology.micro_steps_per_step)  # a peer that drifted
        with pytest.raises(StateError, match="two different states claim rank 0.*dp_rank"):
            merge_rank_states(states[:2] + [loaders[2].state_dict()])
    finally:
        for loader in loaders:
            loader.close()
