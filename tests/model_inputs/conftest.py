"""Shared fixtures of the trainer-integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread (as in the launched ranks): a tiny model's ops are many times slower
    with 2 threads on a busy 2-core machine. Use with ``pytest.mark.usefixtures``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
