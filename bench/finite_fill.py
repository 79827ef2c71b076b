"""Fill rows of one finite epoch (``epoch_tail = "fill"``), simulated on lane sizes.

``python -m bench.finite_fill`` prints, for N documents on L lanes, the fill rows of one epoch
(rows of lanes already done, up to the step of the last real row) over all rows of the epoch,
with the lanes the job makes today (lane = ``H(seed, key) mod L``, the real hash over keys
``doc-0000000`` ...) and with lanes balanced by document count (documents dealt round-robin in
hash order: lane sizes differ by at most one). The stream math is the loader's: sequence ``i``
is lane ``i mod L``'s output ``i div L``; the epoch ends after the step holding the last real
row. Two row models: "rows = documents" (best fit, one conversation per row: SFT) and "concat"
(rows = ceil(lane tokens / seq_len), document lengths lognormal, mean ~230 tokens, seq_len 2048).
"""

from __future__ import annotations

import argparse

import numpy as np

from loader.order.hashing import stable_hash64

SEQ_LEN = 2048


def fill_fraction(rows_per_lane: np.ndarray, global_batch: int) -> float:
    """Fill rows / all rows of the epoch, for lanes of these output counts (each >= 1)."""
    num_lanes = len(rows_per_lane)
    last = int(np.max(np.arange(num_lanes) + (rows_per_lane - 1) * num_lanes))  # last real global index
    rows = (last // global_batch + 1) * global_batch
    return (rows - int(rows_per_lane.sum())) / rows


def lane_sizes(hashes: np.ndarray, num_lanes: int, balanced: bool) -> np.ndarray:
    """Lane of every document: the hash mod L, or its rank in hash order mod L (balanced)."""
    if balanced:
        lanes = np.empty(len(hashes), np.int64)
        lanes[np.argsort(hashes, kind="stable")] = np.arange(len(hashes)) % num_lanes
        return lanes
    return (hashes % np.uint64(num_lanes)).astype(np.int64)


def measure(documents: int, num_lanes: int, seed: int = 0) -> dict:
    hashes = np.array([stable_hash64(seed, "lane", f"doc-{k:07d}") for k in range(documents)], dtype=np.uint64)
    tokens = np.random.default_rng(seed).lognormal(5.0, 0.8, documents).astype(np.int64) + 1
    out = {}
    for balanced in (False, True):
        lanes = lane_sizes(hashes, num_lanes, balanced)
        docs = np.bincount(lanes, minlength=num_lanes)
        if (docs == 0).any():
            out[balanced] = None  # an empty lane: the job refuses this lane count (hash lanes)
            continue
        concat_rows = -(-np.bincount(lanes, weights=tokens, minlength=num_lanes).astype(np.int64) // SEQ_LEN)
        out[balanced] = (fill_fraction(docs, num_lanes), fill_fraction(np.maximum(concat_rows, 1), num_lanes),
                         int(docs.min()), int(docs.max()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[300, 10_000, 1_000_000])
    parser.add_argument("--lanes", type=int, nargs="+", default=[32, 64, 720])
    args = parser.parse_args()
    print("| documents | lanes (B = L) | docs/lane min..max (hash) | fill, rows = docs: hash -> balanced | "
          "fill, concat: hash -> balanced |")
    print("|---|---|---|---|---|")
    for documents in args.documents:
        for num_lanes in args.lanes:
            result = measure(documents, num_lanes)
            before, after = result[False], result[True]
            cells = [f"{documents:,}", str(num_lanes),
                     "empty lanes: refused" if before is None else f"{before[2]}..{before[3]}"]
            for k in (0, 1):
                first = "refused" if before is None else f"{before[k]:.1%}"
                second = "refused" if after is None else f"{after[k]:.1%}"
                cells.append(f"{first} -> {second}")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
