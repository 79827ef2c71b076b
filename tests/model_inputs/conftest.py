"""Shared fixtures of the model-input tests; the image test helpers of tests/vision on the path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

VISION_TESTS = str(Path(__file__).parents[1] / "vision")
if VISION_TESTS not in sys.path:  # image_loader_data and its siblings import each other by bare name
    sys.path.insert(0, VISION_TESTS)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread: a tiny model's ops are many times slower with 2 threads on a busy 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
