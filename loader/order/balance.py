"""Compute-balanced global batches: which rank and micro-batch each sequence of a step goes to.

``balance = "attention"``: the ``B`` sequences of global step ``t`` are the same set as
without it (so the global batch and its fingerprint are unchanged); only *who trains on
which* changes. Without balance, rank ``r`` of ``W`` gets the batch positions ``p = r mod W``
(:mod:`loader.order.ordering`). With it, :func:`balanced_assignment` spreads them by the cost
of each row under :class:`CostModel`, a pure function of the step's costs and ``W`` (and the
micro-batch size): every rank computes the same assignment from the same costs.

Cost model (integers, so every rank computes exactly the same): a row of attention segments
(documents or document pieces, the ``cu_seqlens`` a varlen kernel sees; padding excluded) of
lengths ``d_1 .. d_k``, ``n = sum d_i`` tokens, holding images the vision encoder sees as
``P_1 .. P_m`` patches, costs::

    sum d_i^2  +  linear * n  +  sum_j (P_j^2 + linear * P_j)

Causal attention's work grows with ``d^2`` per segment, the projections' and MLP's with
``n``; ``linear`` weighs the second against the first in units of one attention pair (a
layer of hidden size ``h`` does ~``4 h d^2`` attention and ~``24 h^2 n`` matmul FLOPs: with
causal masking ``linear ~ 12 h``). The default, ``linear = seq_len``, prices a full row of
one document as half attention, half linear: the long-context regime balancing is for. Each
image adds its vision encoder's work: full attention over its patches plus their linear term.
An image's patches are its grid's ``t * h * w`` (``image_grid_thw``: what the encoder takes
in), so the price follows the policy: Qwen2-VL's dynamic policy merges 2 x 2 patches into one
visual token (4 patches a token), a fixed policy feeds one patch per visual token. Where only
the placeholder runs are known (no resolved images), ``vision_merge`` gives the patches of a
visual token (``vision_merge^2``).

Assignment (LPT, "longest processing time first", with capacities)::

    positions sorted by (-cost, position)
    cut into M groups of W x mb (M micro-steps of mb sequences per rank)
    group by group, each sequence goes to the rank with the least cost so far among
    those with room left in this micro-step (ties: the lower rank)

so every micro-step holds sequences of similar cost on every rank (FSDP-style collectives
per micro-step wait for the slowest), and the running totals even out the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Per-row cost (see the module docstring); integers."""

    linear: int
    vision_merge: int = 2

    @classmethod
    def for_seq_len(cls, seq_len: int) -> "CostModel":
        return cls(linear=seq_len)

    def segment_cost(self, lengths: Sequence[int], visual_tokens: Sequence[int] = (),
                     patches: Sequence[int] = ()) -> int:
        """The cost of a row with attention segments of ``lengths`` and images of ``patches``
        encoder patches each (or of ``visual_tokens`` placeholder tokens, ``vision_merge^2``
        patches a token)."""
        cost = sum(int(d) * int(d) for d in lengths) + self.linear * sum(int(d) for d in lengths)
        patches_per_token = self.vision_merge * self.vision_merge
        for p in list(patches) + [patches_per_token * int(v) for v in visual_tokens]:
            cost += int(p) * int(p) + self.linear * int(p)
        return cost

    def row_cost(self, segment_starts: np.ndarray, seq_len: int, padding: int,
                 image_refs: Optional[np.ndarray] = None, image_grids: Optional[np.ndarray] = None) -> int:
        """The cost of a packed row: segments from its ``segment_starts`` (the padding tail, the
        last ``padding`` tokens, left out), images from their ``image_grids`` (``[n, 3]``: the
        resolved images' ``(t, h, w)``), else from the ``image_ref`` feature (runs of one ref)."""
        bounds = np.append(np.asarray(segment_starts, dtype=np.int64), seq_len)
        lengths = np.diff(bounds)
        if padding:
            lengths = lengths[bounds[:-1] < seq_len - padding]
        lengths = lengths[lengths > 0]
        if image_grids is not None:
            grids = np.asarray(image_grids, dtype=np.int64).reshape(-1, 3)
            return self.segment_cost(lengths.tolist(), patches=grids.prod(axis=1).tolist())
        visual: Sequence[int] = ()
        if image_refs is not None:
            on = image_refs[image_refs >= 0]
            if len(on):
                visual = np.unique(on, return_counts=True)[1].tolist()
        return self.segment_cost(lengths.tolist(), visual)


def default_assignment(global_batch_size: int, world_size: int, micro_batch_size: int) -> list[list[list[int]]]:
    """``[rank][micro_step]`` -> batch positions without balance: rank ``r`` gets ``r, r + W, ...``."""
    per_rank = global_batch_size // world_size
    return [[[r + (m * micro_batch_size + k) * world_size for k in range(micro_batch_size)]
             for m in range(per_rank // micro_batch_size)] for r in range(world_size)]


def balanced_assignment(costs: Sequence[int], world_size: int, micro_batch_size: int) -> list[list[list[int]]]:
    """``[rank][micro_step]`` -> batch positions (increasing), a partition of ``range(len(costs))``
    with ``micro_batch_size`` positions per rank and micro-step (see the module docstring)."""
    B = len(costs)
    if world_size < 1 or micro_batch_size < 1 or B % (world_size * micro_batch_size):
        raise ValueError(f"a global batch of {B} does not split into {world_size} ranks x micro-batches of "
                         f"{micro_batch_size}")
    group = world_size * micro_batch_size
    order = sorted(range(B), key=lambda p: (-costs[p], p))
    totals = [0] * world_size
    assignment: list[list[list[int]]] = [[] for _ in range(world_size)]
    for first in range(0, B, group):
        room = [micro_batch_size] * world_size
        micro = [[] for _ in range(world_size)]
        for position in order[first:first + group]:
            rank = min((r for r in range(world_size) if room[r]), key=lambda r: (totals[r], r))
            micro[rank].append(position)
            room[rank] -= 1
            totals[rank] += costs[position]
        for rank in range(world_size):
            assignment[rank].append(sorted(micro[rank]))
    return assignment


def rank_costs(costs: Sequence[int], assignment: list[list[list[int]]]) -> list[int]:
    """The cost of each rank's share of a step under ``assignment``."""
    return [sum(costs[p] for micro in rank for p in micro) for rank in assignment]


def imbalance(costs: Sequence[int], assignment: list[list[list[int]]]) -> float:
    """``max / mean`` of the ranks' costs (1.0: perfectly even; the slowest rank sets the step time)."""
    per_rank = rank_costs(costs, assignment)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
