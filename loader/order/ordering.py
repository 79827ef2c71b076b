"""Global order and ownership: pure functions of integers, no I/O, no state.

::

    global index i:   0   1   2   3   4   5   6   7   8   9  ...      (L = 4 lanes, B = 6)
    lane i mod L:     0   1   2   3   0   1   2   3   0   1
    lane output i//L: 0   0   0   0   1   1   1   1   2   2
    global batch t:   [---------- t=0 --------][--------- t=1 ...
    rank (W = 2):     r0  r1  r0  r1  r0  r1  r0  r1  r0  r1      rank r owns lanes l = r (mod W)

Sequence ``i`` is the ``i // L``-th output of lane ``i % L``. Global batch ``t`` is the
indices ``[t*B, (t+1)*B)``. With ``W`` ranks (``W | L`` and ``W | B``) rank ``r`` owns the
lanes ``l = r (mod W)`` and therefore receives exactly the indices ``i = r (mod W)``: its
``k``-th sequence overall is ``i = r + k*W`` and it gets ``B // W`` of them per step.
Inside a rank, worker ``w`` of ``K`` owns the rank's lanes ``rank_lanes[w::K]``.

Nothing here depends on what the data is; the loader asks these functions *which* lane
and *which* output, and the lanes answer *what*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loader.errors import TopologyError


@dataclass(frozen=True)
class Topology:
    """One rank's view of the data-parallel layout, validated on construction."""

    num_lanes: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        validate_topology(
            num_lanes=self.num_lanes,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=self.world_size,
            rank=self.rank,
        )

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def micro_steps_per_step(self) -> int:
        return self.per_rank_batch // self.micro_batch_size

    def rank_lanes(self) -> list[int]:
        return lanes_of_rank(self.rank, self.world_size, self.num_lanes)


def validate_topology(
    *, num_lanes: int, global_batch_size: int, micro_batch_size: int, world_size: int, rank: int
) -> None:
    """Raise :class:`TopologyError` naming the offending value and the fix."""
    for name, value in (
        ("num_lanes", num_lanes),
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise TopologyError(f"{name} must be a positive integer (got {name}={value!r})")
    if not 0 <= rank < world_size:
        raise TopologyError(f"rank must be in [0, world_size) (got rank={rank}, world_size={world_size})")
    if num_lanes % world_size:
        raise TopologyError(
            f"world_size={world_size} does not divide the dataset's lane count L={num_lanes}. "
            f"Use a world size that divides {num_lanes} (divisors: {_divisors(num_lanes)}), "
            "or re-shard the dataset with a --num-lanes that your world sizes divide "
            "(e.g. 720 serves 1..6, 8, 9, 10, 12, 15, 16, ...)."
        )
    if global_batch_size % world_size:
        raise TopologyError(
            f"world_size={world_size} does not divide global_batch_size={global_batch_size}: "
            "every rank must receive the same number of sequences per step."
        )
    per_rank = global_batch_size // world_size
    if per_rank % micro_batch_size:
        raise TopologyError(
            f"micro_batch_size={micro_batch_size} does not divide the per-rank batch "
            f"global_batch_size/world_size = {global_batch_size}/{world_size} = {per_rank}; "
            f"valid micro-batch sizes here: {_divisors(per_rank)}."
        )


# Trial divisions at most when listing divisors in a message: the message of a huge batch
# size is built in milliseconds (listing all divisors of 10**12 one by one took minutes).
_DIVISOR_SEARCH = 10**5
_DIVISORS_SHOWN = 32


def _divisors(n: int) -> str:
    """``n``'s divisors for a message: all of them when few, else the smallest and largest few.

    Pairs ``(d, n // d)`` with ``d <= sqrt(n)`` and ``d <= _DIVISOR_SEARCH``, so the cost is
    bounded whatever ``n`` is; divisors between the two halves that the search did not
    reach are shown as ``...``.
    """
    root = math.isqrt(n)
    small = [d for d in range(1, min(root, _DIVISOR_SEARCH) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if n // d != d]
    complete = root <= _DIVISOR_SEARCH
    found = small + large
    if complete and len(found) <= _DIVISORS_SHOWN:
        return str(found)
    half = _DIVISORS_SHOWN // 2
    head, tail = (small[:half], large[-half:]) if len(found) > _DIVISORS_SHOWN else (small, large)
    return "[" + ", ".join(map(str, head)) + ", ..., " + ", ".join(map(str, tail)) + "]"


def lane_of_index(global_index: int, num_lanes: int) -> int:
    return global_index % num_lanes


def lane_output_of_index(global_index: int, num_lanes: int) -> int:
    """Which output of its lane the sequence at ``global_index`` is (0-based)."""
    return global_index // num_lanes


def global_index_of(lane_id: int, lane_output: int, num_lanes: int) -> int:
    return lane_output * num_lanes + lane_id


def lane_outputs_before(global_index: int, lane_id: int, num_lanes: int) -> int:
    """How many outputs lane ``lane_id`` has produced once indices ``[0, global_index)`` are done."""
    if global_index <= lane_id:
        return 0
    return (global_index - lane_id + num_lanes - 1) // num_lanes


def lanes_of_rank(rank: int, world_size: int, num_lanes: int) -> list[int]:
    return list(range(rank, num_lanes, world_size))


def lanes_of_worker(rank_lanes: list[int], worker_id: int, num_workers: int) -> list[int]:
    """Worker ``w`` of ``K`` owns ``rank_lanes[w::K]`` (K = 0 means the main process owns all)."""
    if num_workers <= 0:
        return list(rank_lanes)
    return list(rank_lanes[worker_id::num_workers])


def rank_period(num_lanes: int, world_size: int) -> int:
    """Positions after which a rank's lanes repeat: its positions ``p`` and ``p + P`` fall on the
    same lane (``(r + p * W) % L``), any ``P`` consecutive positions on ``P`` distinct lanes."""
    return num_lanes // math.gcd(world_size, num_lanes)


def rank_global_index(rank: int, world_size: int, rank_position: int) -> int:
    """The global index of the rank's ``rank_position``-th sequence (0-based, since step 0)."""
    return rank + rank_position * world_size


def step_of_index(global_index: int, global_batch_size: int) -> int:
    return global_index // global_batch_size
