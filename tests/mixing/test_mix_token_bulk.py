"""Token-unit mixing in bulk (``MixedTokenStream.take_rows``) equals the per-document path.

The concat packer cuts rows in bulk where it can; for token-unit mixing that means deciding
many documents' sources at once (a merge for two sources, a loop on integers for three or
more). Here the same lanes run twice, once with bulk cutting switched off, and every
output row, its token sources and the lane state after it must be identical: two and three
sources, pre-tokenized and text, a schedule change (a bulk never crosses a window) and a
small source that stops.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.pipeline import ZephonLoader
from loader.stages.producer import build_lanes
from loader.checkpoint.state import to_jsonable
from tests.mixing.conftest import GLOBAL_BATCH, NUM_LANES

CHANGE = 12
OUTPUTS_PER_LANE = 60

CASES = {
    "three-sources": dict(weights={"web": 0.55, "code": 0.3, "math": 0.15}),
    "two-sources": dict(weights={"web": 0.7, "code": 0.3}),
    "schedule": dict(weights={"web": 0.5, "code": 0.5},
                     schedule=[{"step": CHANGE, "weights": {"web": 0.2, "code": 0.8}}]),
    "math-stops": dict(weights={"web": 0.4, "code": 0.2, "math": 0.4}, sources={"math": {"exhaustion": "stop"}}),
}


def run_lane(config, lane_id: int, bulk: bool) -> list[tuple]:
    loader = ZephonLoader(config)
    lane = build_lanes(loader.spec, [lane_id], {})[lane_id]
    lane.packers[0]._bulk = bulk
    out = []
    for k in range(OUTPUTS_PER_LANE):
        source, sequence = lane.next_sequence(lane_id + k * NUM_LANES)
        out.append((source, sequence.input_ids.tolist(), sequence.labels.tolist(),
                    sequence.token_sources.tolist(), sequence.segment_starts.tolist(),
                    to_jsonable(lane.get_state())))
    lane.close()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_bulk_rows_equal_the_per_document_path(mix_config, case) -> None:
    overrides = dict(CASES[case])
    config = mix_config(mixing_unit="token", packing="concat", **overrides)
    for lane_id in (0, 3):
        bulk, per_document = run_lane(config, lane_id, True), run_lane(config, lane_id, False)
        for k, (a, b) in enumerate(zip(bulk, per_document)):
            assert a == b, f"{case}: lane {lane_id}, output {k} differs"
    assert OUTPUTS_PER_LANE * NUM_LANES > CHANGE * GLOBAL_BATCH  # the schedule case crosses its change


def test_bulk_really_cuts_several_rows(mix_config) -> None:
    """Guard against the bulk path silently never running (the test above would pass)."""
    config = mix_config(weights={"web": 0.7, "code": 0.3}, mixing_unit="token", packing="concat")
    loader = ZephonLoader(config)
    lane = build_lanes(loader.spec, [0], {})[0]
    stream = lane.mixed_stream
    cut = []
    take_rows = stream.take_rows
    stream.take_rows = lambda *a, **k: (lambda chunk: cut.append(chunk) or chunk)(take_rows(*a, **k))
    for k in range(OUTPUTS_PER_LANE):
        lane.next_sequence(k * NUM_LANES)
    rows = [len(c.tokens) // config.seq_len for c in cut if c is not None]
    # Small row groups here (a few documents per block) leave many rows to the per-document path.
    assert sum(rows) >= OUTPUTS_PER_LANE // 3 and max(rows) > 1, rows
    assert np.all([set(np.unique(c.token_sources)) <= {0, 1} for c in cut if c is not None])
    lane.close()
