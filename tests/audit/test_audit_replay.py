"""The audit's best-fit replay on integers (``loader.commands.audit_replay``) gives the very lane
state the per-sequence replay does: same cursors, bins, pieces, origins and serials."""

from __future__ import annotations

import json

import pytest

from loader.checkpoint.state import to_jsonable
from loader.commands import audit as audit_module
from loader.commands.audit_replay import replayed_lane_state
from loader.pipeline import ZephonLoader
from loader.stages.lane import LaneExhausted
from tests.audit.conftest import NUM_LANES


def _lanes(config):
    loader = ZephonLoader(config.replace(num_workers=0, read_ahead=False))
    spec = audit_module.replace(loader.spec, features=audit_module.AUDIT_FEATURES, read_ahead=False)
    return loader, (lambda: audit_module._build(spec, list(range(NUM_LANES)), loader))


def _compare(config, outputs: list[int]) -> tuple[int, int]:
    """Per lane, the states after each count of ``outputs`` both ways; returns the bins compared
    and the lanes that ended before the last count."""
    loader, build = _lanes(config)
    bins = ended = 0
    try:
        slow, fast = build(), build()
        for lane_id in range(NUM_LANES):
            done = 0
            for count in outputs:
                try:
                    for k in range(done, count):
                        slow[lane_id].next_sequence(k * NUM_LANES + lane_id)
                except LaneExhausted:
                    with pytest.raises(LaneExhausted):
                        replayed_lane_state(build()[lane_id], 0, count)
                    ended += 1
                    break
                done = count
                lane = build()[lane_id]
                replayed = audit_module._resolved_lane_state(lane, replayed_lane_state(lane, 0, count))
                expected = to_jsonable(slow[lane_id].get_state())
                assert json.dumps(to_jsonable(replayed), sort_keys=True) == json.dumps(expected, sort_keys=True), \
                    (lane_id, count)
                bins += sum(len(s["packer"]["bins"]) for s in expected["sources"].values())
                lane.close()
    finally:
        loader.close()
    return bins, ended


@pytest.mark.parametrize("overrides", [
    {},
    {"add_bos": True, "best_fit_open_bins": 1},
    {"mix": True, "schedule": [{"step": 4, "weights": {"web": 1, "code": 3}}]},
])
def test_the_integer_replay_is_the_lanes_replay(make_config, overrides):
    overrides = dict(overrides)
    mix = overrides.pop("mix", False)
    bins, _ = _compare(make_config("best_fit", mix=mix, **overrides), [0, 1, 9, 120])
    assert bins >= NUM_LANES


def test_the_integer_replay_of_sources_that_stop(make_config, sources):
    config = make_config("best_fit", mix=True, datasets=[
        {"path": sources.web, "weight": 0.6, "max_epochs": 2},
        {"path": sources.code, "weight": 0.4, "exhaustion": "stop"}])
    bins, ended = _compare(config, [10, 150, 400])  # code stops, then web after two epochs: the lanes end
    assert bins and ended == NUM_LANES


def test_token_mixing_is_left_to_the_lane(make_config):
    loader, build = _lanes(make_config("best_fit", mix=True, mixing_unit="token"))
    try:
        assert replayed_lane_state(build()[0], 0, 5) is None
    finally:
        loader.close()
