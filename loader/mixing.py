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

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Sequence

import numpy as np

from loader.hashing import stable_hash64, stable_permutation

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
    """How many sequences of global batch ``step`` each source gets (floor or ceil of w*B)."""
    quotas = [w * batch_size for w in weights]
    counts = [int(q) for q in quotas]  # floor: quotas are >= 0
    remainder = batch_size - sum(counts)
    if remainder == 0:
        return counts
    offset = Fraction(((step + 1) * _GOLDEN_64) % _TWO_64, _TWO_64)
    lower = Fraction(0)
    for s, q in enumerate(quotas):
        frac = q - int(q)
        upper = lower + frac
        # A point u + k lies in [lower, upper) for some integer k >= 0.
        k = -((offset - upper) // 1) - 1  # largest k with offset + k < upper
        if frac > 0 and k >= 0 and offset + k >= lower and k < remainder:
            counts[s] += 1
        lower = upper
    return counts


@lru_cache(maxsize=64)
def batch_assignment(weights: tuple[Fraction, ...], batch_size: int, step: int, seed: int) -> np.ndarray:
    """Source id for every position of global batch ``step`` (int8 array of length B)."""
    counts = batch_source_counts(weights, batch_size, step)
    slots = np.repeat(np.arange(len(weights), dtype=np.int8), counts)
    order = stable_permutation(batch_size, seed, "mix", step)
    assignment = slots[order]
    assignment.setflags(write=False)
    return assignment


class MixingSchedule:
    """Phases of a mixture; answers ``source_of(global_index)``. Pure and picklable.

    ``source_of`` keeps the assignment of the last step it was asked about (callers walk the
    indices step by step), so a lookup is a list index rather than a cache lookup keyed by
    fractions.
    """

    def __init__(self, phases: Sequence[MixturePhase], global_batch_size: int, seed: int) -> None:
        if not phases or phases[0].start_step != 0:
            raise ValueError("a mixing schedule needs a phase starting at step 0")
        self.phases = tuple(phases)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_sources = len(phases[0].weights)
        self._step = -1  # the step whose assignment is in self._assignment
        self._assignment: list[int] = []

    def phase_at(self, step: int) -> MixturePhase:
        current = self.phases[0]
        for phase in self.phases:
            if phase.start_step <= step:
                current = phase
            else:
                break
        return current

    def weights_at(self, step: int) -> tuple[Fraction, ...]:
        return self.phase_at(step).weights

    def source_of(self, global_index: int) -> int:
        if self.num_sources == 1:
            return 0
        step, position = divmod(global_index, self.global_batch_size)
        if step != self._step:
            weights = self.weights_at(step)
            self._assignment = batch_assignment(weights, self.global_batch_size, step, self.seed).tolist()
            self._step = step
        return self._assignment[position]

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
