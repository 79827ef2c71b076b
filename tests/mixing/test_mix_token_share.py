"""Token-unit mixing on real lanes: every source's token share over its window.

The window is one lane over one schedule phase. Inside it, at every document boundary of
the documents the lane's mixer draws (the packer's input, in draw order), with ``T`` the
window's tokens so far and ``t_s`` those of source ``s``:

    t_s - w_s * T <= d_max                    (no source ever runs ahead by more than a document)
    w_s * T - t_s <= (n - 1) * d_max          (n sources; for n = 2 this is one document)

``d_max`` is the lane's longest document in tokens (EOS included). On this data the
three-source mix stays within one document both ways; the test asserts that too.

Concat packing delivers the draw order unchanged, so the window is checked on what the
trainer receives (``token_source_ids`` and labels of the delivered sequences). Best-fit
reorders documents inside its open bins, so there the draw order is recorded at the mixer.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from loader.order.mixing import exact_weights
from loader.stages.packing import IGNORE_INDEX
from loader.pipeline import ZephonLoader
from loader.stages.producer import build_lanes
from tests.loader.settings import make_stream
from tests.mixing.conftest import GLOBAL_BATCH, LOADER_SEED, NUM_LANES, THIRDS, WEIGHTS
from tests.mixing.mix_helpers import lane_records, run_records

CHANGE = 48  # schedule change step
STEPS = 96


def longest_document(mix_data, tokenizer, lane: int) -> int:
    longest = 0
    for path in mix_data.paths.values():
        stream = make_stream(path, tokenizer, lane, seed=LOADER_SEED, max_epochs=1)
        while (chunk := stream.take(10**9, within_document=True)) is not None:
            longest = max(longest, len(chunk.tokens))  # a block never splits a document
    return longest


def window_deviations(sources: np.ndarray, starts: np.ndarray, weights) -> np.ndarray:
    """``t_s - w_s * T`` (rows: boundaries, columns: sources) at every document start of a window."""
    boundaries = np.flatnonzero(starts)
    boundaries = boundaries[boundaries > 0]
    n = len(weights)
    cumulative = np.zeros((len(sources) + 1, n), dtype=np.int64)
    cumulative[1:] = np.cumsum(np.eye(n, dtype=np.int64)[sources], axis=0)
    at = cumulative[boundaries]
    totals = at.sum(axis=1, keepdims=True)
    return at - totals * np.array([float(w) for w in weights])


def check_window(sources, starts, weights, d_max: int, where: str) -> float:
    deviation = window_deviations(np.asarray(sources), np.asarray(starts), weights)
    assert len(deviation) > 40, f"{where}: too few documents to say anything"
    n = len(weights)
    assert deviation.max() <= d_max, f"{where}: a source ran ahead by {deviation.max():.1f} > {d_max}"
    assert -deviation.min() <= (n - 1) * d_max, f"{where}: a source fell behind by {-deviation.min():.1f}"
    assert np.abs(deviation).max() <= d_max, f"{where}: {np.abs(deviation).max():.1f} > one document ({d_max})"
    return float(np.abs(deviation).max() / d_max)


def phases(config) -> list[tuple[int, int, tuple[Fraction, ...]]]:
    return [(0, CHANGE, exact_weights(list(WEIGHTS.values()))), (CHANGE, STEPS, exact_weights([1, 1, 1]))]


@pytest.fixture(scope="module")
def d_max_by_lane(mix_data, tokenizer) -> dict[int, int]:
    return {lane: longest_document(mix_data, tokenizer, lane) for lane in range(NUM_LANES)}


def test_token_shares_in_delivered_concat_sequences(mix_config, d_max_by_lane) -> None:
    config = mix_config(mixing_unit="token", schedule=[{"step": CHANGE, "weights": THIRDS}])
    records = run_records(config, STEPS)
    for lane in range(NUM_LANES):
        outputs = lane_records(records, lane, NUM_LANES)
        for first, end, weights in phases(config):
            window = [r for r in outputs if first <= r.step < end]
            sources = np.concatenate([r.token_sources for r in window])
            starts = np.concatenate([r.labels == IGNORE_INDEX for r in window])
            assert (sources >= 0).all()
            check_window(sources, starts, weights, d_max_by_lane[lane], f"lane {lane}, steps {first}..{end - 1}")


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_token_shares_in_the_mixer_draw_order(mix_config, d_max_by_lane, packing) -> None:
    config = mix_config(mixing_unit="token", packing=packing, schedule=[{"step": CHANGE, "weights": THIRDS}])
    loader = ZephonLoader(config)
    lanes = build_lanes(loader.spec, list(range(NUM_LANES)), {})
    for lane_id, lane in lanes.items():
        drawn: list[tuple[int, np.ndarray, np.ndarray]] = []  # (step, sources, document starts)
        step = [0]
        def recording(take, _drawn=drawn, _step=step):
            """Record what ``take`` (per sequence) or ``take_rows`` (bulk, one phase) draws."""
            def wrapper(*args, **kwargs):
                chunk = take(*args, **kwargs)
                if chunk is not None:
                    starts = np.zeros(len(chunk.tokens), dtype=bool)
                    starts[chunk.doc_starts] = True
                    _drawn.append((_step[0], chunk.token_sources, starts))
                return chunk
            return wrapper

        lane.mixed_stream.take = recording(lane.mixed_stream.take)
        lane.mixed_stream.take_rows = recording(lane.mixed_stream.take_rows)
        for k in range(STEPS * GLOBAL_BATCH // NUM_LANES):
            index = lane_id + k * NUM_LANES
            step[0] = index // GLOBAL_BATCH
            lane.next_sequence(index)
        for first, end, weights in phases(config):
            window = [(s, st) for t, s, st in drawn if first <= t < end]
            check_window(
                np.concatenate([s for s, _ in window]), np.concatenate([st for _, st in window]),
                weights, d_max_by_lane[lane_id], f"{packing} lane {lane_id}, steps {first}..{end - 1}",
            )
