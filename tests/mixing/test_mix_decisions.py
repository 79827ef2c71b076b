"""The pure mixing decisions of ``loader.order.mixing``: per-batch counts, assignment, schedules.

Everything here is a function of integers and fractions (no data, no I/O), so it runs over
10^4 steps and under Hypothesis in a few seconds. The loader-level counterparts (the same
guarantees measured on real micro-batches) are in ``test_mix_loader.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.order.hashing import stable_permutation
from loader.order.mixing import (
    MixingSchedule,
    MixturePhase,
    batch_assignment,
    batch_assignments,
    batch_source_counts,
    exact_weights,
)

AWKWARD = [(0.55, 0.3, 0.15), (1 / 3, 1 / 3, 1 / 3)]
BATCHES = [7, 10, 25, 28]  # none divisible by 3; 28 is the loader tests' B
MORE = [((0.5, 0.25, 0.125, 0.125), 10), ((0.013, 0.987), 7), ((1, 2, 3, 4, 5, 6, 7), 25), ((1, 1, 1), 1000)]
STEPS = 10_000

weight_lists = st.lists(
    st.one_of(st.integers(0, 20), st.floats(0, 1, allow_nan=False, allow_infinity=False)),
    min_size=1, max_size=6,
).filter(lambda ws: sum(ws) > 1e-3)


def _bounds(weights: tuple[Fraction, ...], batch: int) -> tuple[list[int], list[int]]:
    quotas = [w * batch for w in weights]
    return [math.floor(q) for q in quotas], [math.ceil(q) for q in quotas]


# -- exact weights -------------------------------------------------------------------------
def test_exact_weights_are_the_intended_fractions() -> None:
    assert exact_weights([0.55, 0.3, 0.15]) == (Fraction(11, 20), Fraction(3, 10), Fraction(3, 20))
    assert exact_weights([1, 1, 1]) == (Fraction(1, 3),) * 3
    assert exact_weights([1 / 3, 1 / 3, 1 / 3]) == (Fraction(1, 3),) * 3
    assert exact_weights([7, 0, 3]) == (Fraction(7, 10), Fraction(0), Fraction(3, 10))


def test_exact_weights_refuse_a_zero_sum() -> None:
    with pytest.raises(ValueError, match="positive sum"):
        exact_weights([0, 0])


@given(weight_lists)
def test_exact_weights_sum_to_one(weights) -> None:
    exact = exact_weights(weights)
    assert sum(exact) == 1 and all(w >= 0 for w in exact)


# -- per-batch counts over 10^4 steps --------------------------------------------------------
@pytest.mark.parametrize(
    "raw, batch", [(w, b) for w in AWKWARD for b in BATCHES] + MORE,
    ids=lambda v: "/".join(f"{w:.3g}" for w in v) if isinstance(v, tuple) else f"B{v}",
)
def test_counts_are_floor_or_ceil_every_step_and_converge(raw, batch) -> None:
    weights = exact_weights(raw)
    lo, hi = _bounds(weights, batch)
    counts = np.array([batch_source_counts(weights, batch, step) for step in range(STEPS)])
    assert (counts.sum(axis=1) == batch).all()
    assert (counts >= lo).all() and (counts <= hi).all()
    # Long run: the cumulative count of every prefix of steps stays within a few sequences of
    # N * w * B (the golden-ratio offsets are low-discrepancy: the error is O(log N), not
    # O(sqrt N)), so the average per batch converges to w * B at rate 1/N.
    expected = np.outer(np.arange(1, STEPS + 1), [float(w * batch) for w in weights])
    assert np.abs(np.cumsum(counts, axis=0) - expected).max() <= 4
    assert np.allclose(counts.mean(axis=0), [float(w * batch) for w in weights], atol=4 / STEPS)


_GOLDEN_64 = 0x9E3779B97F4A7C15
_TWO_64 = 1 << 64


def rational_counts(weights: tuple[Fraction, ...], batch_size: int, step: int) -> list[int]:
    """The definition in ``loader.order.mixing``'s docstring, in plain fractions (the reference)."""
    quotas = [w * batch_size for w in weights]
    counts = [math.floor(q) for q in quotas]
    remainder = batch_size - sum(counts)
    offset = Fraction(((step + 1) * _GOLDEN_64) % _TWO_64, _TWO_64)  # u_t
    lower = Fraction(0)
    for s, q in enumerate(quotas):
        upper = lower + (q - math.floor(q))
        # the points u_t + k, 0 <= k < R, that fall into [lower, upper)
        if any(lower <= offset + k < upper for k in range(remainder)):
            counts[s] += 1
        lower = upper
    return counts


@settings(max_examples=300, deadline=None)
@given(weight_lists, st.integers(1, 300), st.integers(0, 10**12))
def test_counts_match_the_rational_definition(raw, batch, step) -> None:
    weights = exact_weights(raw)
    assert batch_source_counts(weights, batch, step) == rational_counts(weights, batch, step)


def test_divisible_batches_get_exact_counts() -> None:
    weights = exact_weights([0.55, 0.3, 0.15])
    for step in range(100):
        assert batch_source_counts(weights, 20, step) == [11, 6, 3]


@settings(max_examples=200, deadline=None)
@given(weight_lists, st.integers(1, 512), st.integers(0, 10**9))
def test_counts_property(raw, batch, step) -> None:
    weights = exact_weights(raw)
    lo, hi = _bounds(weights, batch)
    counts = batch_source_counts(weights, batch, step)
    assert sum(counts) == batch
    assert all(l <= c <= h for l, c, h in zip(lo, counts, hi))
    assert all(c == 0 for c, w in zip(counts, weights) if w == 0)


@settings(max_examples=100, deadline=None)
@given(weight_lists, st.integers(1, 256), st.integers(0, 10**9), st.integers(0, 2**32))
def test_assignment_is_a_permutation_of_the_counts(raw, batch, step, seed) -> None:
    weights = exact_weights(raw)
    assignment = batch_assignment(weights, batch, step, seed)
    assert assignment.shape == (batch,)
    assert np.bincount(assignment, minlength=len(weights)).tolist() == batch_source_counts(weights, batch, step)
    assert not assignment.flags.writeable  # cached: callers must not be able to corrupt it


@settings(max_examples=60, deadline=None)
@given(st.lists(weight_lists.filter(lambda w: len(w) == 3), min_size=1, max_size=8),
       st.integers(1, 200), st.integers(0, 10**9), st.integers(0, 2**32))
def test_assignments_are_the_counts_placed_by_the_stable_permutation(raw, batch, first, seed) -> None:
    """Each row: the counts' slots in source order, permuted by ``stable_permutation``."""
    weights = [exact_weights(w) for w in raw]
    block = batch_assignments(weights, batch, first, seed)
    assert block.shape == (len(weights), batch)
    for k, w in enumerate(weights):
        slots = np.repeat(np.arange(3), batch_source_counts(w, batch, first + k))
        expected = slots[stable_permutation(batch, seed, "mix", first + k)]
        assert np.array_equal(block[k], expected)
        assert np.array_equal(batch_assignment(w, batch, first + k, seed), expected)


def test_assignment_positions_depend_on_step_and_seed() -> None:
    weights = exact_weights([1, 1, 1])
    a = batch_assignment(weights, 28, 5, 7)
    assert not np.array_equal(a, batch_assignment(weights, 28, 6, 7))
    assert not np.array_equal(a, batch_assignment(weights, 28, 5, 8))


# -- schedules ------------------------------------------------------------------------------
def _schedule(phases: list[tuple[int, tuple]], batch: int, seed: int = 7) -> MixingSchedule:
    return MixingSchedule([MixturePhase(step, exact_weights(w)) for step, w in phases], batch, seed)


def test_schedule_needs_a_phase_at_step_zero() -> None:
    with pytest.raises(ValueError, match="step 0"):
        _schedule([(3, (1, 1))], 10)


def test_phase_at_and_source_of_follow_the_phases() -> None:
    schedule = _schedule([(0, (0.55, 0.3, 0.15)), (10, (1, 1, 1)), (25, (0, 1, 0))], batch=28)
    assert [schedule.phase_at(t).start_step for t in (0, 9, 10, 24, 25, 10**6)] == [0, 0, 10, 10, 25, 25]
    for step in range(40):
        row = [schedule.source_of(step * 28 + k) for k in range(28)]
        weights = schedule.weights_at(step)
        assert np.bincount(row, minlength=3).tolist() == batch_source_counts(weights, 28, step)
    assert {schedule.source_of(i) for i in range(25 * 28, 40 * 28)} == {1}


phase_lists = st.lists(st.tuples(st.integers(1, 60), weight_lists.filter(lambda w: len(w) == 3)), max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    st.tuples(st.floats(0.01, 1), st.floats(0.01, 1), st.floats(0.01, 1)),
    phase_lists, phase_lists, st.integers(1, 40), st.integers(1, 64),
)
def test_prefix_stability(first, phases_a, phases_b, cut, batch) -> None:
    """Phases starting at or after step ``cut`` never change a decision before ``cut``."""
    early = sorted({s: w for s, w in phases_a if s < cut}.items())
    late_a = sorted({s: w for s, w in phases_a if s >= cut}.items())
    late_b = sorted({s: w for s, w in phases_b if s >= cut}.items())
    a = _schedule([(0, first), *early, *late_a], batch)
    b = _schedule([(0, first), *early, *late_b], batch)
    before = range(cut * batch)
    assert [a.source_of(i) for i in before] == [b.source_of(i) for i in before]
    # ... and from ``cut`` on each follows its own phase's weights.
    for schedule in (a, b):
        row = [schedule.source_of(cut * batch + k) for k in range(batch)]
        expected = batch_source_counts(schedule.weights_at(cut), batch, cut)
        assert np.bincount(row, minlength=3).tolist() == expected


def test_a_later_phase_with_new_weights_changes_only_the_steps_after_it() -> None:
    base = _schedule([(0, (0.55, 0.3, 0.15))], batch=28)
    changed = _schedule([(0, (0.55, 0.3, 0.15)), (10, (1, 1, 1))], batch=28)
    assert [base.source_of(i) for i in range(280)] == [changed.source_of(i) for i in range(280)]
    assert [base.source_of(i) for i in range(280, 560)] != [changed.source_of(i) for i in range(280, 560)]


# -- fallback when the decided source has stopped --------------------------------------------
@settings(max_examples=100, deadline=None)
@given(weight_lists, st.lists(st.booleans(), min_size=6, max_size=6), st.integers(0, 10**9))
def test_fallback_picks_a_live_source(raw, alive_mask, index) -> None:
    schedule = MixingSchedule([MixturePhase(0, exact_weights(raw))], 16, 3)
    alive = alive_mask[: len(raw)]
    chosen = schedule.fallback_source(index, alive, index // 16)
    if not any(alive):
        assert chosen == -1
        return
    assert alive[chosen]
    weights = schedule.weights_at(0)
    if any(w > 0 and ok for w, ok in zip(weights, alive)):
        assert weights[chosen] > 0  # a live source with weight wins over a live one without
    assert chosen == schedule.fallback_source(index, alive, index // 16)  # pure


def test_fallback_is_renormalised_by_weight() -> None:
    schedule = _schedule([(0, (0.55, 0.3, 0.15))], batch=28)
    picks = np.bincount([schedule.fallback_source(i, [True, True, False], 0) for i in range(20_000)], minlength=3)
    assert picks[2] == 0
    # 0.55 : 0.3 renormalised is 0.647 : 0.353; a hash draw, so a statistical tolerance.
    assert picks[0] / picks.sum() == pytest.approx(0.55 / 0.85, abs=0.015)
