"""The PyTorch adapter: a torch DataLoader around ZephonIterableDataset passes batches through unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from loader.config import ConfigError
from loader.pipeline import ZephonLoader
from loader.integrations.torch_data import ZephonIterableDataset


def test_dataloader_with_batch_size_none_yields_the_loaders_batches(make_config):
    config = make_config("best_fit")
    with ZephonLoader(config, rank=1, world_size=2) as direct:
        expected = [next(direct) for _ in range(6)]
    loader = ZephonLoader(config, rank=1, world_size=2)
    dataset = ZephonIterableDataset(loader)
    try:
        got = []
        for batch in DataLoader(dataset, batch_size=None, num_workers=0):
            got.append(batch)
            if len(got) == 4:
                break
        state = json.loads(json.dumps(dataset.state_dict()))
    finally:
        loader.close()
    resumed = ZephonLoader(config, rank=1, world_size=2)
    dataset = ZephonIterableDataset(resumed)
    try:
        dataset.load_state_dict(state)
        for batch in DataLoader(dataset, batch_size=None, num_workers=0):
            got.append(batch)
            if len(got) == 6:
                break
    finally:
        resumed.close()
    for a, b in zip(expected, got):
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "global_indices"):
            assert torch.equal(a[key], b[key]), key
        assert (a["step"], a["micro_step"]) == (b["step"], b["micro_step"])


def test_dataloader_workers_are_refused(make_config):
    with ZephonLoader(make_config()) as loader:
        with pytest.raises(ConfigError, match="num_workers=0"):
            next(iter(DataLoader(ZephonIterableDataset(loader), batch_size=None, num_workers=1)))
