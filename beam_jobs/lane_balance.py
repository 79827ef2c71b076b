"""Lanes balanced by document count (``zephon shard --lane-balance documents``).

By default a document's lane is ``H(seed, key) mod L``: a function of its key alone, so lane
sizes spread like a multinomial (10,000 documents on 64 lanes: 127 to 175 per lane), and a
finite epoch ends with fill rows where the short lanes ran out (``bench/finite_fill.py``). Balanced, the document of rank ``r`` in the order of ``(H,
key, text)`` over the whole dataset goes to lane ``r mod L``: lane sizes differ by at most
one. The rank is a function of the set of documents, never of input order,
bundling or runner. The price: a document's lane depends on every other document's key, so
adding documents moves others between lanes (a new dataset, as any re-shard is).

The rank is computed without a global sort: documents are grouped into 4,096 buckets by the
top 12 bits of ``H``; the buckets' sizes (one small side input) give each bucket's first rank,
and each bucket sorts its own documents. The in-lane order, files and row groups are those of
hash lanes (order key, file bucket of the order key), so nothing after this step changes.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Iterator

import apache_beam as beam
from apache_beam.pvalue import AsDict, AsSingleton

from beam_jobs.lane_count import AUTO_LANE_COUNTS, USUAL_WORLD_SIZE
from loader.order.hashing import file_bucket, order_key_of, stable_hash64

BUCKET_BITS = 12


def _bucketed(document: tuple, seed: int) -> tuple[int, tuple]:
    lane_hash = stable_hash64(seed, "lane", document[0])
    return lane_hash >> (64 - BUCKET_BITS), (lane_hash, document)


class _DealByRankFn(beam.DoFn):
    """``(bucket, [(H, document)])`` -> ``((lane, part), LaneRow)`` as ``AssignLaneFn`` yields them."""

    def __init__(self, seed: int):
        self.seed = seed
        self._starts: tuple = (None, None)  # (the sizes side input, first rank of every bucket)

    def _first_rank(self, bucket: int, sizes: dict) -> int:
        if self._starts[0] is not sizes:  # once per side input, not per bucket
            counts = [sizes.get(b, 0) for b in range(1 << BUCKET_BITS)]
            self._starts = (sizes, [0] + list(accumulate(counts)))
        return self._starts[1][bucket]

    def process(self, element: tuple, sizes: dict, files_per_lane: int, num_lanes: int) -> Iterator[tuple]:
        bucket, members = element
        # (H, key, text): a total order on distinct documents; equal ones are interchangeable
        ordered = sorted(members, key=lambda m: (m[0], m[1][0], m[1][1]))
        rank = self._first_rank(bucket, sizes)
        for offset, (_, document) in enumerate(ordered):
            key, text, _text_nbytes, kept_values, *encoded = document
            order_key = order_key_of(self.seed, key)
            part = file_bucket(order_key, files_per_lane)
            yield ((rank + offset) % num_lanes, part), (order_key.to_bytes(8, "big"), key, text, kept_values, *encoded)


class BalancedLanes(beam.PTransform):
    """Documents -> ``((lane, part), LaneRow)`` with lane sizes within one of each other."""

    def __init__(self, seed: int, num_lanes, files_per_lane, label=None):
        super().__init__(label)
        self.seed = seed
        self.num_lanes = num_lanes  # an int or a singleton side input (automatic lane count)
        self.files_per_lane = files_per_lane  # a PCollection of one int

    def expand(self, documents):
        bucketed = documents | "HashBucket" >> beam.Map(_bucketed, self.seed)
        sizes = bucketed | "BucketSizes" >> beam.combiners.Count.PerKey()
        return (
            bucketed
            | "GroupByBucket" >> beam.GroupByKey()
            | "DealByRank" >> beam.ParDo(_DealByRankFn(self.seed), AsDict(sizes), AsSingleton(self.files_per_lane),
                                         self.num_lanes)
        )


MIN_DOCUMENTS_PER_LANE = 8  # automatic balanced lane count: fewer lanes below this many per lane


def balanced_lane_count(documents: int) -> int:
    """The automatic lane count of balanced lanes: the largest of 64, 32, 16 that gives every
    lane ``MIN_DOCUMENTS_PER_LANE`` documents (lanes of one or two rows each end the epoch in
    lumps, so a small set ends with fewer fill rows on fewer lanes: docs/guides/finite-epochs.md),
    else 8, or for fewer than 8 documents the largest every lane fills; 0 without documents."""
    usual = USUAL_WORLD_SIZE  # never below it where there are documents for it: world sizes must divide L
    return next((count for count in AUTO_LANE_COUNTS if count > usual and count * MIN_DOCUMENTS_PER_LANE <= documents),
                next((count for count in AUTO_LANE_COUNTS if count <= min(documents, usual)), 0))
