"""The epoch permutations are part of the dataset format: pinned values, and the small-n
pure-Python path agrees with the vectorised one everywhere."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from loader.order import hashing
from loader.order.hashing import stable_permutation, stable_permutations


def test_permutations_keep_their_pinned_values() -> None:
    # Values of the first release: a change here reorders every dataset's later epochs.
    assert stable_permutation(5, 0, "files", "web", 3, 1).tolist() == [4, 1, 3, 0, 2]
    assert stable_permutation(16, 7, "row_groups", "caps", 0, 2, 1).tolist() == [
        1, 11, 7, 12, 13, 5, 3, 0, 15, 6, 14, 4, 9, 8, 10, 2]
    assert stable_permutation(40, 1, "rows", "web", 2, 1, 0, 3)[:10].tolist() == [37, 39, 31, 19, 1, 24, 29, 25, 35, 15]


def test_large_permutations_keep_their_pinned_values() -> None:
    # Pinned with the stable argsort the vectorised path used first: any sort must give the
    # same order (the keys are distinct), for a row group's rows and a block of mixing steps.
    rows = stable_permutation(4096, 3, "rows", "web", 5, 2, 0, 7)
    assert rows[:8].tolist() == [2469, 3994, 3111, 2525, 3081, 3771, 3279, 485]
    assert hashlib.sha256(rows.tobytes()).hexdigest()[:16] == "70a44abedbaba33b"
    steps = stable_permutations(512, [(0, "mix", t) for t in range(64)])
    assert steps[5, :8].tolist() == [401, 323, 503, 303, 19, 189, 7, 409]
    assert hashlib.sha256(steps.tobytes()).hexdigest()[:16] == "9ca1b28071430ad9"


@pytest.mark.parametrize("parts", [(0, "files", "web", 3, 1), (12345, "row_groups", "caps", 15, 9, 2), (1, "rows")])
def test_small_permutations_equal_the_vectorised_path(parts) -> None:
    assert hashing._SMALL_PERMUTATION >= 2  # else this test would compare the vectorised path with itself
    for n in range(0, hashing._SMALL_PERMUTATION + 3):
        small = stable_permutation(n, *parts)
        vectorised = stable_permutations(n, [parts])[0]
        assert small.dtype == vectorised.dtype == np.int64
        assert small.tolist() == vectorised.tolist(), n
        assert sorted(small.tolist()) == list(range(n))


def test_negative_sizes_are_refused_on_both_paths() -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        stable_permutation(-1, 0, "files")
    with pytest.raises(ValueError, match="n must be >= 0"):
        stable_permutations(-1, [(0, "files")])
