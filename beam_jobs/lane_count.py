"""The lane count of a job run without ``--num-lanes``: the largest that fills every lane.

Every lane must hold a document (the loader serves global sequence ``i`` from lane ``i mod
L``), and the usual data-parallel world sizes 1, 2, 4 and 8 must divide ``L``. So the job
tries ``L`` = 64, 32, 16, 8 (then 4, 2, 1 for a handful of documents) and takes the first
whose every lane receives a document. One pass over the keys decides it: a document's lane
under a divisor ``d`` of 64 is ``H mod d = (H mod 64) mod d``, so the set of lanes filled at
64 (a 64-bit mask, OR-combined) answers every candidate. A dataset whose 64 lanes all fill
gets 64, the default before this choice existed: its lane files are those it always had.

``--num-lanes N`` fixes ``L`` (the job then shards exactly as before).
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from typing import Iterable

import apache_beam as beam

from loader.order.hashing import lane_of_key

AUTO_LANE_COUNTS = (64, 32, 16, 8, 4, 2, 1)  # each divides the first, so one mask answers all
USUAL_WORLD_SIZE = 8  # the largest world size every automatic count from 8 up serves


def lane_mask(seed: int, key: str) -> int:
    """The bit of the document's lane among ``AUTO_LANE_COUNTS[0]`` lanes."""
    return 1 << lane_of_key(seed, key, AUTO_LANE_COUNTS[0])


def choose_lane_count(mask: int) -> int:
    """The largest automatic lane count whose every lane holds a document of ``mask``
    (the lanes filled at 64), or 0 when there is no document at all."""
    filled = [lane for lane in range(AUTO_LANE_COUNTS[0]) if mask >> lane & 1]
    for count in AUTO_LANE_COUNTS:
        if len({lane % count for lane in filled}) == count:
            return count
    return 0


def _or_all(masks: Iterable[int]) -> int:
    """Bitwise OR (associative and commutative: a CombineGlobally function)."""
    return reduce(or_, masks, 0)


class ChooseLaneCount(beam.PTransform):
    """Documents ``(key, ...)`` -> one int: :func:`choose_lane_count` of their keys (0: none)."""

    def __init__(self, seed: int, label=None):
        super().__init__(label)
        self.seed = seed

    def expand(self, documents):
        return (
            documents
            | "LaneMask" >> beam.Map(lambda document, seed: lane_mask(seed, document[0]), self.seed)
            | "FilledLanes" >> beam.CombineGlobally(_or_all)
            | "LargestFilledCount" >> beam.Map(choose_lane_count)
        )


def lane_count_note(chosen: int) -> str:
    """What the job's summary says of an automatic lane count."""
    note = (f"lane count {chosen} chosen automatically: the largest of "
            f"{', '.join(map(str, AUTO_LANE_COUNTS[:4]))} whose every lane received a document")
    if chosen < USUAL_WORLD_SIZE:
        note += (f" (fewer than {USUAL_WORLD_SIZE} lanes: too few documents for more; world sizes must divide "
                 f"{chosen})")
    return note + "; pass --num-lanes N to fix it"
