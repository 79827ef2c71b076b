"""A run reads every lane's current row group in the background from its start, side by side.

Before, a lane's first block was read when its first sequence was asked for: the second
micro-batch of a fresh loader (the first to use the other half of the lanes) waited for
those reads. The stream is the same (the golden pins); here: the reads are queued at the
start, in the order of the lanes' next use, and a bad cursor still fails where it did.
"""

from __future__ import annotations

import pytest

from loader.checkpoint.state import StateError
from loader.pipeline import ZephonLoader
from tests.loader.settings import NUM_LANES


def _queued_or_read(lane) -> bool:
    return all(len(s._ahead) > 0 or s._block is not None for s in lane.source_streams())


@pytest.mark.parametrize("pretokenized", [True, False])
def test_every_lane_is_read_from_the_start_of_a_run(make_config, pretokenized):
    loader = ZephonLoader(make_config("concat", pretokenized=pretokenized, micro_batch_size=1))
    try:
        next(loader)  # one sequence: lane 0 only
        lanes = loader._run.in_process_lanes
        assert len(lanes) == NUM_LANES
        untouched = [l for l in lanes if l != 0]
        assert all(_queued_or_read(lanes[l]) for l in untouched), "a lane's first block was not queued at the start"
        assert all(lanes[l].source_streams()[0]._block is None for l in untouched), "read on the trainer's thread"
    finally:
        loader.close()


def test_reads_are_queued_in_the_order_of_next_use(make_config, monkeypatch):
    from loader.stages.lane import Lane

    started: list[int] = []
    monkeypatch.setattr(Lane, "start_reading", lambda self: started.append(self.lane_id))
    loader = ZephonLoader(make_config("concat", pretokenized=True, micro_batch_size=1))
    try:
        for _ in range(3):
            next(loader)
        state = loader.state_dict()  # the next index is 3: lane 3 is used first after a restore
        loader.load_state_dict(state)
        started.clear()
        next(loader)
    finally:
        loader.close()
    assert started == [(3 + k) % NUM_LANES for k in range(NUM_LANES)]


def test_a_restored_cursor_past_the_blocks_still_fails_on_the_read(make_config):
    loader = ZephonLoader(make_config("concat", pretokenized=True))
    try:
        state = loader.state_dict()
        lane = next(iter(state["lanes"]))
        source = next(iter(state["lanes"][lane]["sources"]))
        state["lanes"][lane]["sources"][source]["packer"]["stream"]["block"] = 10_000
        with pytest.raises(StateError, match=r"\.block"):
            loader.load_state_dict(state)
            for _ in range(NUM_LANES):
                next(loader)
    finally:
        loader.close()
