"""When a source of the mix runs out: ``repeat`` (new epoch, new order), ``stop``, ``max_epochs``.

``math`` is the small source (64 documents, 5..12 per lane, at most ~800 tokens a lane):
weighted 0.4 here, it finishes an epoch of every lane within ~18 steps of B = 28.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.commands.fingerprints import collect_fingerprints
from tests.mixing.conftest import LOADER_SEED, NUM_LANES
from tests.mixing.mix_helpers import (
    lane_records,
    run_records,
    source_tokens_of_lane,
    split_documents,
    stream_prefix,
)
from tests.resume_harness import LoaderRun, check_resume, loader_runs

MATH = 2  # source id of "math"
WEIGHTS = {"web": 0.35, "code": 0.25, "math": 0.4}
WEB_AFTER_STOP = 0.35 / 0.6  # web : code renormalised once math has stopped
UNITS = ("sequence", "token")


def lane_documents(mix_data, lane: int) -> int:
    return sum(f.rows for f in mix_data.manifests["math"].lane_files(lane))


def math_documents(records, lane: int) -> list[tuple[int, ...]]:
    tokens, starts = source_tokens_of_lane(lane_records(records, lane, NUM_LANES), MATH)
    assert starts[0], "a lane stream starts at a document"
    return split_documents(tokens, starts)


@pytest.mark.parametrize("unit", UNITS)
def test_repeat_starts_the_next_epoch_in_a_new_order(mix_config, mix_data, unit) -> None:
    records = run_records(mix_config(WEIGHTS, mixing_unit=unit), 70)
    reordered = 0
    for lane in range(NUM_LANES):
        n = lane_documents(mix_data, lane)
        docs = math_documents(records, lane)
        assert len(docs) > 2 * n, f"lane {lane}: math did not reach its third epoch"
        epoch0, epoch1 = docs[:n], docs[n : 2 * n]
        assert sorted(epoch0) == sorted(epoch1), f"lane {lane}: epoch 1 is not the same documents"
        assert len(set(epoch0)) == n
        if n >= 4:
            assert epoch0 != epoch1, f"lane {lane}: epoch 1 replays epoch 0's order"
            reordered += 1
    assert reordered >= NUM_LANES // 2


@pytest.mark.parametrize("unit", UNITS)
def test_max_epochs_delivers_exactly_that_many_epochs(mix_config, mix_data, tokenizer, unit) -> None:
    config = mix_config(WEIGHTS, mixing_unit=unit, sources={"math": {"max_epochs": 2}})
    records = run_records(config, 70)
    for lane in range(NUM_LANES):
        n = lane_documents(mix_data, lane)
        docs = math_documents(records, lane)
        assert len(docs) == 2 * n, f"lane {lane}: {len(docs)} math documents, expected 2 epochs of {n}"
        assert sorted(docs[:n]) == sorted(docs[n:])
        tokens, _ = source_tokens_of_lane(lane_records(records, lane, NUM_LANES), MATH)
        expected = stream_prefix(mix_data.paths["math"], tokenizer, lane, 10**9, seed=LOADER_SEED, max_epochs=2)
        assert np.array_equal(tokens, expected)


@pytest.mark.parametrize("unit", UNITS)
def test_stop_drops_the_source_and_the_others_continue(mix_config, mix_data, tokenizer, unit) -> None:
    config = mix_config(WEIGHTS, mixing_unit=unit, sources={"math": {"exhaustion": "stop"}})
    steps = 70
    records = run_records(config, steps)
    last_math_step = 0
    for lane in range(NUM_LANES):
        outputs = lane_records(records, lane, NUM_LANES)
        tokens, _ = source_tokens_of_lane(outputs, MATH)
        # Exactly one epoch of the lane's math, in order, then nothing more of it.
        expected = stream_prefix(mix_data.paths["math"], tokenizer, lane, 10**9, seed=LOADER_SEED, max_epochs=1)
        assert np.array_equal(tokens, expected), f"lane {lane}"
        with_math = [r.step for r in outputs if r.source == MATH or (r.token_sources is not None and (r.token_sources == MATH).any())]
        last_math_step = max(last_math_step, max(with_math))
    assert last_math_step < steps - 20, "math should have stopped in every lane well before the end"
    # After math stopped everywhere, web : code follow 0.55 : 0.3 renormalised.
    late = [r for r in records.values() if r.step > last_math_step]
    if unit == "sequence":
        shares = np.bincount([r.source for r in late], minlength=3) / len(late)
        assert shares[MATH] == 0
        assert shares[0] == pytest.approx(WEB_AFTER_STOP, abs=0.06)  # a seeded draw per sequence
    else:
        tokens = np.concatenate([r.token_sources for r in late])
        shares = np.bincount(tokens, minlength=3) / len(tokens)
        assert shares[MATH] == 0
        # The deficit rule holds each lane within one document (<= 150 tokens) of 0.35 : 0.25.
        assert shares[0] == pytest.approx(WEB_AFTER_STOP, abs=0.02)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("unit", UNITS)
def test_stop_is_deterministic_across_world_sizes_and_resumes(mix_config, unit) -> None:
    config = mix_config(WEIGHTS, mixing_unit=unit, sources={"math": {"exhaustion": "stop"}})
    results, _ = collect_fingerprints(config.replace(micro_batch_size=28), end_step=40)
    expected = [r.line() for r in results]
    assert expected[25].endswith("math=0"), "math should have stopped by step 25"
    workers = 2 if unit == "token" else 0
    topologies = [
        dict(world_size=4, micro_batch_size=7),
        dict(world_size=2, micro_batch_size=14, num_workers=workers),
        dict(world_size=1, micro_batch_size=7),
        dict(world_size=2, micro_batch_size=1),
    ]
    # Cuts before, around and after the lanes' stops (which spread over steps ~8..18).
    check_resume(loader_runs(config, topologies), steps=30, cut_points=[9, 14, 21], expected=expected[:30])


@pytest.mark.parametrize("unit", UNITS)
def test_when_every_source_stops_the_stream_ends_at_the_same_step_for_every_world_size(mix_config, unit) -> None:
    config = mix_config(
        WEIGHTS, mixing_unit=unit, sources={name: {"exhaustion": "stop"} for name in ("web", "code", "math")},
    )
    runs = {}
    for world_size in (1, 2, 4):
        run = LoaderRun(config, world_size)
        try:
            runs[world_size] = run.run(1000)  # LoaderRun asserts that all ranks end at the same step
        finally:
            run.close()
    assert 0 < len(runs[1]) < 1000
    assert runs[2] == runs[1] and runs[4] == runs[1]
