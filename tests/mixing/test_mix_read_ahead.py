"""Read-ahead in a mix: each source reads ahead by its share of the lane's output, and no
depth (nor waiting for the reads) changes a batch."""

from __future__ import annotations

from fractions import Fraction

import pytest

from loader.commands.fingerprints import collect_fingerprints
from loader.io.read_ahead import READ_AHEAD_BLOCKS, read_ahead_depth
from loader.pipeline import ZephonLoader
from loader.stages.producer import build_lanes
from tests.mixing.conftest import THIRDS, WEIGHTS

STEPS = 30


def test_depth_covers_the_time_of_a_lone_sources_read_ahead() -> None:
    assert READ_AHEAD_BLOCKS == 2  # the values below assume it
    assert read_ahead_depth(Fraction(1)) == 2
    assert read_ahead_depth(Fraction(51, 100)) == 2
    assert read_ahead_depth(Fraction(1, 2)) == 1
    assert read_ahead_depth(Fraction(15, 100)) == 1
    assert read_ahead_depth(Fraction(0)) == 1  # a weight-0 source still reads ahead when it runs
    assert read_ahead_depth(Fraction(1, 2), takes_next_block_early=True) == 2


def _depths(config) -> list[int]:
    loader = ZephonLoader(config)
    (lane,) = build_lanes(loader.spec, [0], {}).values()
    try:
        return [stream.read_ahead_blocks for stream in lane.source_streams()]
    finally:
        lane.close()


@pytest.mark.parametrize("unit", ["sequence", "token"])
def test_each_source_reads_ahead_by_its_largest_share(mix_config, unit) -> None:
    extra = 1 if unit == "token" else 0  # a token mix's bulk reader takes the next block early
    # web 0.55 -> 2 blocks, code 0.3 -> 1, math 0.15 -> 1 ...
    assert _depths(mix_config(WEIGHTS, mixing_unit=unit)) == [2 + extra, 1 + extra, 1 + extra]
    assert _depths(mix_config(THIRDS, mixing_unit=unit)) == [1 + extra] * 3
    # ... and a later phase that gives math 0.6 of the output raises its depth for the run.
    later = {"step": 10, "weights": {"web": 0.2, "code": 0.2, "math": 0.6}}
    assert _depths(mix_config(WEIGHTS, mixing_unit=unit, schedule=[later])) == [2 + extra, 1 + extra, 2 + extra]


def test_a_lone_source_keeps_the_full_depth(mix_config) -> None:
    assert _depths(mix_config({"web": 1.0})) == [READ_AHEAD_BLOCKS]


@pytest.mark.parametrize("unit", ["sequence", "token"])
def test_read_ahead_depths_do_not_change_a_mix(mix_config, unit) -> None:
    on = collect_fingerprints(mix_config(WEIGHTS, mixing_unit=unit, read_ahead=True), end_step=STEPS)[0]
    off = collect_fingerprints(mix_config(WEIGHTS, mixing_unit=unit, read_ahead=False), end_step=STEPS)[0]
    assert [r.line() for r in on] == [r.line() for r in off]


def test_waiting_for_the_read_ahead_leaves_the_stream_as_it_was(mix_config) -> None:
    config = mix_config(WEIGHTS, mixing_unit="token")
    expected = [b["input_ids"].tolist() for b, _ in zip(ZephonLoader(config), range(12))]
    loader = ZephonLoader(config)
    got, waited_for = [], 0
    for _ in range(12):
        got.append(next(loader)["input_ids"].tolist())
        loader.wait_for_read_ahead()
        pending = [f for lane in loader._run.in_process_lanes.values() for s in lane.source_streams()
                   for _, f in s._ahead]
        assert all(f.done() for f in pending)
        waited_for += len(pending)
    loader.close()
    assert waited_for > 0  # blocks were queued ahead (else the waiting was not exercised)
    assert got == expected
