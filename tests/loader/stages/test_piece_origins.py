"""Best-fit checkpoints say where each open-bin piece came from (``piece_origins``, state version 2).

An origin is the stream cursor ``[epoch, block, offset]`` of the piece's first token: the
piece's tokens are that block's tokens from that offset on. Version-1 states (no origins)
still load and continue the identical stream; their bins save no origins until emitted.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from loader.checkpoint.state import STATE_VERSION, StateError, dumps
from loader.pipeline import ZephonLoader
from loader.stages.producer import build_lanes
from tests.loader.settings import NUM_LANES


def _state_after(config, steps: int) -> dict:
    with ZephonLoader(config) as loader:
        while loader.step < steps:
            next(loader)
        return json.loads(dumps(loader.global_state_dict(step=steps)))


def _packers(state: dict):
    for key, lane in state["lanes"].items():
        if "mixed" in lane:
            yield int(key), None, lane["mixed"]
        else:
            for name, source in lane["sources"].items():
                yield int(key), name, source["packer"]


@pytest.mark.parametrize("pretokenized", [True, False])
def test_every_piece_is_its_origins_tokens(make_config, pretokenized):
    config = make_config("best_fit", pretokenized=pretokenized)
    state = _state_after(config, 9)
    checked = 0
    with ZephonLoader(config) as loader:
        lanes = build_lanes(loader.spec, list(range(NUM_LANES)), {})
        for lane_id, _, packer in _packers(state):
            stream = lanes[lane_id].source_streams()[0]
            cursor = packer["stream"]
            for bin_ in packer["bins"]:
                starts = bin_["piece_starts"] + [len(bin_["tokens"])]
                for (epoch, block, offset), lo, hi in zip(bin_["piece_origins"], starts[:-1], starts[1:]):
                    assert (epoch, block, offset) < (cursor["epoch"], cursor["block"], cursor["offset"])
                    built = stream._read_block(epoch, *stream.blocks_of_epoch(epoch)[block])
                    built.ensure(offset + hi - lo)  # text blocks tokenize as far as asked
                    assert built.tokens[offset:offset + hi - lo].tolist() == bin_["tokens"][lo:hi]
                    checked += 1
        for lane in lanes.values():
            lane.close()
    assert checked >= 4


def test_a_version_1_state_continues_and_saves_origins_only_for_new_bins(make_config):
    config = make_config("best_fit", pretokenized=True)
    state = _state_after(config, 6)
    old = json.loads(json.dumps(state))
    for _, _, packer in _packers(old):
        for bin_ in packer["bins"]:
            del bin_["piece_origins"]
    old["version"] = 1
    with ZephonLoader(config) as straight, ZephonLoader(config) as resumed:
        straight.load_state_dict(state)
        resumed.load_state_dict(old)
        while resumed.step < 12:
            a, b = next(straight), next(resumed)
            np.testing.assert_array_equal(a["input_ids"].numpy(), b["input_ids"].numpy())
        later = json.loads(dumps(resumed.global_state_dict(step=12)))
    assert later["version"] == STATE_VERSION  # saved as today's format
    restored = {(lane, bin_["serial"]) for lane, _, packer in _packers(old) for bin_ in packer["bins"]}
    seen = {True: 0, False: 0}
    for lane, _, packer in _packers(later):
        for bin_ in packer["bins"]:
            old_bin = (lane, bin_["serial"]) in restored
            assert ("piece_origins" in bin_) != old_bin  # a bin from the v1 state cannot know; a new one does
            seen[old_bin] += 1
    assert seen[False]


def test_bad_piece_origins_are_refused_by_path(make_config):
    config = make_config("best_fit", pretokenized=True)
    state = _state_after(config, 6)
    lane, _, packer = next(p for p in _packers(state) if p[2]["bins"])
    path = re.escape(f"lanes.{lane:05d}.sources.synthetic.packer.bins[0].piece_origins")
    cases = {
        "short": (lambda b: b["piece_origins"].pop(), rf"{path}: must be a list of"),
        "negative": (lambda b: b["piece_origins"][0].__setitem__(2, -1), rf"{path}\[0\]\[2\]: must be >= 0"),
        "future": (lambda b: b["piece_origins"][0].__setitem__(0, 10_000), rf"{path}\[0\]\[0\]: a piece comes from "
                   "before its stream's cursor"),
    }
    with ZephonLoader(config) as loader:
        for name, (tamper, message) in cases.items():
            bad = json.loads(json.dumps(state))
            tamper(next(p for p in _packers(bad) if p[0] == lane)[2]["bins"][0])
            with pytest.raises(StateError, match=message):
                loader.load_state_dict(bad)
