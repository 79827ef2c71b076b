"""Epoch layout: the order in which an epoch replays a lane's row groups and rows.

Epoch 0 replays the blocks (row groups) and rows in the order the Beam job wrote them
(order-key order). Epoch ``e > 0`` replays a permutation seeded by ``(seed, source, lane, e)``:
the file order, the row-group order inside each file and the row order inside each row group
are shuffled, so memory stays bounded by one row group. Pure functions of integers: the
stream that reads the files (:mod:`loader.io.lane_reader`) asks them for its order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from loader.order.hashing import stable_permutation


def epoch_blocks(seed: int, source_name: str, lane_id: int, epoch: int,
                 row_groups_per_file: Sequence[int]) -> list[tuple[int, int]]:
    """``(file_ordinal, row_group)`` pairs in the order epoch ``epoch`` replays them.

    ``row_groups_per_file``: the row-group count of each of the lane's files, in manifest order.
    """
    files = range(len(row_groups_per_file))
    if epoch > 0:
        files = stable_permutation(len(row_groups_per_file), seed, "files", source_name, lane_id, epoch)
    blocks: list[tuple[int, int]] = []
    for file_ordinal in files:
        file_ordinal = int(file_ordinal)
        count = row_groups_per_file[file_ordinal]
        groups = range(count)
        if epoch > 0:
            groups = stable_permutation(count, seed, "row_groups", source_name, lane_id, epoch, file_ordinal)
        blocks.extend((file_ordinal, int(g)) for g in groups)
    return blocks


def row_order(seed: int, source_name: str, lane_id: int, epoch: int, file_ordinal: int, row_group: int,
              rows: int) -> np.ndarray:
    """The order (int64 row indices) in which epoch ``epoch`` > 0 replays a row group's rows."""
    return stable_permutation(rows, seed, "rows", source_name, lane_id, epoch, file_ordinal, row_group)
