"""``ZephonLoader(pin_memory=True)``: micro-batches assembled in pinned memory, or a warned no-op.

Pinned memory needs an accelerator. Where there is one, the batch tensors are pinned; on a
CPU-only torch the option changes nothing but a warning. The assembly itself (the collator
writing straight into the allocations, which are handed out as they are) is checked with a
recording allocator in ordinary memory, so it runs on every machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from loader.config import ConfigError
from loader.pipeline import ZephonLoader
from loader.stages import pinned


def _batches(loader: ZephonLoader, count: int) -> list[dict]:
    try:
        return [next(loader) for _ in range(count)]
    finally:
        loader.close()


def _assert_same(got: list[dict], expected: list[dict]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.keys() == e.keys()
        for name, value in e.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(g[name], value), name
            else:
                assert g[name] == value, name


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_pin_memory_pins_where_it_can_and_warns_where_it_cannot(make_config, caplog, packing):
    config = make_config(packing)
    expected = _batches(ZephonLoader(config), 6)
    with caplog.at_level(logging.WARNING, logger="loader.stages.pinned"):
        got = _batches(ZephonLoader(config, pin_memory=True), 6)
    _assert_same(got, expected)
    tensors = [v for b in got for v in b.values() if isinstance(v, torch.Tensor)]
    if pinned.pinning_available():
        assert all(t.is_pinned() for t in tensors)
    else:
        assert not any(t.is_pinned() for t in tensors)
        assert "no accelerator is available" in caplog.text, "pin_memory=True without an accelerator must say so"


def test_pin_memory_with_numpy_output_is_refused(make_config):
    with pytest.raises(ConfigError, match="pin_memory=True, output='numpy'"):
        ZephonLoader(make_config("concat"), output="numpy", pin_memory=True)


@pytest.mark.parametrize("packing,workers", [("concat", 0), ("best_fit", 0), ("concat", 2)])
def test_pinned_assembly_writes_each_field_once_and_hands_out_the_allocations(make_config, monkeypatch,
                                                                             packing, workers):
    """With pinning forced on, every tensor of a batch is one of the allocator's tensors (no
    ``from_numpy`` wrapper of their memory), allocated once per field: the large arrays are
    written in place by the collator, not built elsewhere and copied."""
    allocations: list[torch.Tensor] = []

    def allocate(shape, dtype):
        tensor = torch.empty(shape, dtype=dtype)
        allocations.append(tensor)
        return tensor

    real_init = pinned.PinnedBuffers.__init__
    monkeypatch.setattr(pinned.PinnedBuffers, "__init__", lambda self, allocate_=None: real_init(self, allocate))
    monkeypatch.setattr("loader.pipeline.pinning_available", lambda: True)
    written_in_place = {"input_ids", "labels", "position_ids"}
    config = make_config(packing, num_workers=workers)
    expected = _batches(ZephonLoader(config), 6)
    loader = ZephonLoader(config, pin_memory=True)
    try:
        got = []
        for _ in range(6):
            before = len(allocations)
            batch = next(loader)
            made = allocations[before:]
            tensors = {name: v for name, v in batch.items() if isinstance(v, torch.Tensor)}
            assert len(made) == len(tensors), f"{len(made)} allocations for {len(tensors)} tensors"
            for name, tensor in tensors.items():
                assert any(tensor is m for m in made), f"{name} is not an allocation of the pinned allocator"
            assert written_in_place <= set(tensors), sorted(tensors)
            got.append(batch)
    finally:
        loader.close()
    _assert_same(got, expected)
    # written in place: the three large arrays were allocated before any copied-in field
    last = {name: v for name, v in got[-1].items() if isinstance(v, torch.Tensor)}
    order = [next(name for name, v in last.items() if v is m) for m in allocations[-len(last):]]
    assert set(order[:3]) == written_in_place, order
