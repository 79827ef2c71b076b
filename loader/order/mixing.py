"""Mixing decisions: which source the sequence at a global index comes from.

A pure function of (global index, schedule, global batch size, seed), so every process
computes the same answer for any index without talking to the others.

Per global batch ``t`` with weights ``w`` (exact fractions), source ``s`` gets
``floor(w_s * B)`` slots plus one more for ``R = B - sum(floor(w_s * B))`` of the sources.
Which sources get the extra slot is systematic sampling over their fractional parts
``f_s``: lay the ``f_s`` end to end on ``[0, R)``, pick the points ``u_t + k`` (``k < R``)
with ``u_t`` a low-discrepancy offset (golden-ratio sequence in exact integer arithmetic);
a source whose interval holds a point gets ``+1``. So every batch holds ``floor`` or
``ceil`` of ``w_s * B`` sequences of source ``s`` and, over many batches, exactly ``w_s``
on average. The slots are then placed at batch positions by a seeded permutation.

A schedule is a list of phases ``(start_step, weights)``; a phase applies to whole global
batches from its start step on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from loader.order.hashing import stable_hash64, stable_permutations

_GOLDEN_64 = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd
_TWO_64 = 1 << 64


def exact_weights(weights: Sequence[float]) -> tuple[Fraction, ...]:
    """Normalise weights to exact fractions (0.55/0.3/0.15 -> 11/20, 3/10, 3/20; 1,1,1 -> thirds)."""
    fractions = [Fraction(w).limit_denominator(1_000_000) for w in weights]
    total = sum(fractions)
    if total <= 0:
        raise ValueError(f"mixture weights must have a positive sum (got {list(weights)})")
    return tuple(f / total for f in fractions)


@dataclass(frozen=True)
class MixturePhase:
    start_step: int
    weights: tuple[Fraction, ...]

    def to_dict(self, names: Sequence[str]) -> dict:
        return {"step": self.start_step, "weights": {n: str(w) for n, w in zip(names, self.weights)}}

    @classmethod
    def from_dict(cls, data: dict, names: Sequence[str]) -> "MixturePhase":
        missing = [n for n in names if n not in data["weights"]]
        if missing:
            raise ValueError(f"schedule entry at step {data['step']} has no weight for source(s) {missing}")
        return cls(int(data["step"]), tuple(Fraction(data["weights"][n]) for n in names))


def batch_source_counts(weights: tuple[Fraction, ...], batch_size: int, step: int) -> list[int]:
    """How many sequences of global batch ``step`` each source gets (floor or ceil of w*B).

    Exact integer arithmetic: with ``w_s = n_s / d`` every quantity is counted in units of
    ``1 / (d * 2^64)``, which gives the same answer as the rational definition in the module
    docstring (tests/mixing/test_mix_decisions.py checks them against each other).
    """
    return _counts_of_plan(_count_plan(weights, batch_size), batch_size, step)


def _count_plan(weights: tuple[Fraction, ...], batch_size: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """What the counts of a phase's steps share: the common denominator ``d``, the floors of
    ``w_s * B`` and their fractional parts in units of ``1 / (d * 2^64)``."""
    denominator = math.lcm(*(w.denominator for w in weights))
    quotas = [w.numerator * (denominator // w.denominator) * batch_size for w in weights]  # w_s*B*d
    floors = tuple(q // denominator for q in quotas)  # quotas are >= 0
    return denominator, floors, tuple((q % denominator) << 64 for q in quotas)


def _counts_of_plan(plan: tuple[int, tuple[int, ...], tuple[int, ...]], batch_size: int, step: int) -> list[int]:
    denominator, floors, fractions = plan
    counts = list(floors)
    remainder = batch_size - sum(counts)
    if remainder == 0:
        return counts
    unit = denominator << 64  # 1 in the scaled units
    offset = (((step + 1) * _GOLDEN_64) % _TWO_64) * denominator  # u_t
    lower = 0
    for s, frac in enumerate(fractions):
        upper = lower + frac
        # A point u + k lies in [lower, upper) for some integer k >= 0.
        k = -((offset - upper) // unit) - 1  # largest k with u + k < upper
        if frac > 0 and 0 <= k < remainder and offset + k * unit >= lower:
            counts[s] += 1
        lower = upper
    return counts


def batch_assignments(weights: Sequence[tuple[Fraction, ...]], batch_size: int, first_step: int, seed: int) -> np.ndarray:
    """Source id for every position of the global batches ``first_step, first_step + 1, ...``.

    Row ``k`` (int8, length B) holds ``batch_source_counts(weights[k], B, first_step + k)``
    slots of each source, in source order, permuted by ``stable_permutation(B, seed, "mix",
    step)``. The permutations of all rows are computed at once
    (``stable_permutations``), so a block of steps costs little more than one.
    """
    steps = range(first_step, first_step + len(weights))
    # One plan per phase: a block's steps share their phase's weights object (keyed by
    # identity, which is cheap; hashing a tuple of Fractions is not).
    plans: dict[int, tuple] = {}
    for w in weights:
        if id(w) not in plans:
            plans[id(w)] = _count_plan(w, batch_size)
    counts = np.array([_counts_of_plan(plans[id(w)], batch_size, t) for w, t in zip(weights, steps)])
    # Slots in source order (source s repeated counts[s] times), all rows in one call: each
    # row's counts sum to batch_size.
    num_sources = counts.shape[1]
    slots = np.repeat(np.tile(np.arange(num_sources, dtype=np.int8), len(counts)), counts.reshape(-1))
    slots = slots.reshape(len(counts), batch_size)
    order = stable_permutations(batch_size, [(seed, "mix", t) for t in steps])
    return np.take_along_axis(slots, order, axis=1)


@lru_cache(maxsize=64)
def batch_assignment(weights: tuple[Fraction, ...], batch_size: int, step: int, seed: int) -> np.ndarray:
    """Source id for every position of global batch ``step`` (read-only int8 array of length B)."""
    assignment = batch_assignments([weights], batch_size, step, seed)[0]
    assignment.setflags(write=False)
    return assignment


class MixingSchedule:
    """Phases of a mixture; answers ``source_of(global_index)``. Pure and picklable.

    ``source_of`` computes the assignments of a block of steps at a time (up to 64 steps,
    ``BLOCK_POSITIONS`` batch positions) and keeps them (callers walk the indices step by
    step), so most lookups are a list index.
    """

    BLOCK_POSITIONS = 16384

    def __init__(self, phases: Sequence[MixturePhase], global_batch_size: int, seed: int) -> None:
        if not phases or phases[0].start_step != 0:
            raise ValueError("a mixing schedule needs a phase starting at step 0")
        self.phases = tuple(phases)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_sources = len(phases[0].weights)
        # The decided block: _block[i] is the source of global index _block_start + i (whole steps).
        self._block_start = self._block_size = 0
        self._block: list[int] = []

    def phase_at(self, step: int) -> MixturePhase:
        current = self.phases[0]
        for phase in self.phases:
            if phase.start_step <= step:
                current = phase
            else:
                break
        return current

    def phase_end(self, step: int) -> Optional[int]:
        """The first step of the phase after ``step``'s, or None if ``step`` is in the last."""
        for phase in self.phases:
            if phase.start_step > step:
                return phase.start_step
        return None

    def peak_shares(self) -> list[Fraction]:
        """Each source's largest share of the output over the phases (weight / phase total)."""
        shares = [Fraction(0)] * self.num_sources
        for phase in self.phases:
            total = sum(phase.weights)
            if total > 0:
                shares = [max(share, w / total) for share, w in zip(shares, phase.weights)]
        return shares

    def weights_at(self, step: int) -> tuple[Fraction, ...]:
        return self.phase_at(step).weights

    def source_of(self, global_index: int) -> int:
        if self.num_sources == 1:
            return 0
        # Called once per sequence: a flat list indexed by the offset into the decided block.
        offset = global_index - self._block_start
        if not 0 <= offset < self._block_size:
            step = global_index // self.global_batch_size
            steps = range(step, step + max(1, min(64, self.BLOCK_POSITIONS // self.global_batch_size)))
            weights = [self.weights_at(t) for t in steps]
            self._block = batch_assignments(weights, self.global_batch_size, step, self.seed).reshape(-1).tolist()
            self._block_start, self._block_size = step * self.global_batch_size, len(self._block)
            offset = global_index - self._block_start
        return self._block[offset]

    def fallback_source(self, global_index: int, alive: Sequence[bool], step: int) -> int:
        """When the decided source has stopped in this lane: a renormalised draw among the rest."""
        weights = self.weights_at(step)
        candidates = [(s, w) for s, (w, ok) in enumerate(zip(weights, alive)) if ok and w > 0]
        if not candidates:
            candidates = [(s, Fraction(1)) for s, ok in enumerate(alive) if ok]
        if not candidates:
            return -1
        total = sum(w for _, w in candidates)
        point = Fraction(stable_hash64(self.seed, "fallback", global_index), _TWO_64) * total
        for s, w in candidates:
            if point < w:
                return s
            point -= w
        return candidates[-1][0]
