"""Topology errors: a world size or micro-batch the lane layout cannot serve is refused clearly.

The dataset has L = 8 lanes; the config's global batch is B = 16.
"""

from __future__ import annotations

import pytest

from loader.order.ordering import Topology, TopologyError, lanes_of_rank, lanes_of_worker
from loader.pipeline import ZephonLoader


def test_world_size_that_does_not_divide_the_lane_count(make_config):
    with pytest.raises(TopologyError) as info:
        ZephonLoader(make_config(global_batch_size=24, micro_batch_size=1), rank=0, world_size=3)
    message = str(info.value)
    assert "world_size=3 does not divide the dataset's lane count L=8" in message
    assert "[1, 2, 4, 8]" in message and "--num-lanes" in message


def test_world_size_that_does_not_divide_the_global_batch(make_config):
    with pytest.raises(TopologyError) as info:
        ZephonLoader(make_config(global_batch_size=12, micro_batch_size=1), rank=0, world_size=8)
    assert "world_size=8 does not divide global_batch_size=12" in str(info.value)


def test_micro_batch_that_does_not_divide_the_per_rank_batch(make_config):
    with pytest.raises(TopologyError) as info:
        ZephonLoader(make_config(micro_batch_size=3), rank=1, world_size=2)
    message = str(info.value)
    assert "micro_batch_size=3 does not divide the per-rank batch" in message
    assert "16/2 = 8" in message and "[1, 2, 4, 8]" in message


@pytest.mark.parametrize("rank,world_size", [(2, 2), (-1, 2)])
def test_rank_outside_the_world(make_config, rank, world_size):
    with pytest.raises(TopologyError, match=r"rank must be in \[0, world_size\)"):
        ZephonLoader(make_config(), rank=rank, world_size=world_size)


def test_world_size_and_rank_come_from_the_torchrun_environment(make_config, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with ZephonLoader(make_config()) as loader:
        assert (loader.topology.rank, loader.topology.world_size) == (3, 4)
        assert loader.rank_lanes == [3, 7]
        assert next(loader)["global_indices"].tolist() == [3, 7]
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(TopologyError, match="world_size=3"):
        ZephonLoader(make_config(global_batch_size=24))


@pytest.mark.parametrize("name,value", [("world_size", 0), ("micro_batch_size", 0), ("num_lanes", -4)])
def test_non_positive_values(name, value):
    kwargs = dict(num_lanes=8, global_batch_size=16, micro_batch_size=2, world_size=1, rank=0)
    kwargs[name] = value
    with pytest.raises(TopologyError, match=f"{name} must be a positive integer"):
        Topology(**kwargs)


def test_ownership_covers_every_lane_once():
    for world_size in (1, 2, 4, 8):
        ranks = [lanes_of_rank(r, world_size, 8) for r in range(world_size)]
        assert sorted(l for lanes in ranks for l in lanes) == list(range(8))
        for lanes in ranks:  # 3 workers need not divide a rank's lanes
            owned = [lanes_of_worker(lanes, w, 3) for w in range(3)]
            assert sorted(l for o in owned for l in o) == lanes
    assert [lanes_of_worker(list(range(8)), w, 3) for w in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
