"""Shared fixtures of the trainer-integration tests."""

from __future__ import annotations

import json
from pathlib import Path

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


def write_loader_config(root: Path, **config) -> str:
    """A small pre-tokenized dataset (160 texts, 8 lanes, the shipped tokenizer) under ``root/data``
    and ``root/loader.json`` reading it with ``config`` (seq_len, batch sizes, seed, ...); its path."""
    from tokenizers import Tokenizer

    from loader.samples import default_tokenizer_path
    from tests.dataset_factory import synthetic_texts, write_dataset

    write_dataset(str(root / "data"), synthetic_texts(160, seed=7, max_words=40), num_lanes=8, seed=3,
                  tokenizer=Tokenizer.from_file(default_tokenizer_path()), files_per_lane=2, row_group_rows=4)
    path = root / "loader.json"
    path.write_text(json.dumps(dict(datasets=[{"path": str(root / "data")}], tokenizer=default_tokenizer_path(),
                                    **config)))
    return str(path)
