"""Micro-batches handed out as views of the workers' slots (loader.workers.held): a held batch
keeps its values whatever the trainer fetches after it (a worker never overwrites a slot the
trainer can still read), the bound on held views turns further batches into copies, a restore
keeps the slots still held, and close() leaves no worker, mapping or segment behind once the
last held batch is freed."""

from __future__ import annotations

import dataclasses
import gc
import os

import numpy as np
import pytest

from loader.pipeline import ZephonLoader
from loader.workers.held import HELD_BATCHES
from loader.workers.pool import slots_per_worker
from loader.workers.shm import PREFIX
from tests.loader.settings import pids_alive
from tests.loader.workers.test_worker_batches import assert_same, batches

MANY = 200  # micro-batches fetched after the held ones: every slot of both workers reused many times


def _loader(make_config, output: str = "numpy", **overrides) -> ZephonLoader:
    """A loader whose workers always collate (never ship rows for the trainer to collate)."""
    loader = ZephonLoader(make_config("concat", pretokenized=True, num_workers=2, **overrides), output=output)
    loader._batch_plan = dataclasses.replace(loader._batch_plan, rows="never")
    loader.wait_for_workers(timeout_s=60)
    return loader


def _frozen(batch: dict) -> dict:
    return {k: np.array(v, copy=True) if hasattr(v, "shape") else v for k, v in batch.items()}


def _segment_maps() -> list[str]:
    """This process's mappings of its own workers' segments (by name: a path elsewhere, such as a
    venv under /tmp/zephon-ci-..., may hold the prefix too)."""
    own = f"/dev/shm/{PREFIX}{os.getpid()}-"
    with open("/proc/self/maps") as fh:
        return [line for line in fh if own in line]


def _is_view(batch: dict) -> bool:
    """Whether the batch's input ids lie in a worker's shared-memory segment (not a copy)."""
    array = batch["input_ids"]
    address = array.data_ptr() if hasattr(array, "data_ptr") else array.ctypes.data
    ranges = [[int(x, 16) for x in line.split()[0].split("-")] for line in _segment_maps()]
    return any(start <= address < end for start, end in ranges)


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_held_batches_keep_their_values(make_config, output):
    loader = _loader(make_config, output)
    try:
        held = [next(loader) for _ in range(HELD_BATCHES + 2)]
        assert loader._run.batch_plan is not None and loader._run.lead is None
        expected = [_frozen(b) for b in held]
        assert [_is_view(b) for b in held] == [True] * HELD_BATCHES + [False, False]  # the bound: then copies
        assert len(loader._pool.held) == HELD_BATCHES
        for _ in range(MANY):
            next(loader)  # each dropped at once: views again, their slots reused
        for got, want in zip(held, expected):
            assert_same([_frozen(got)], [want])
        tail = held.pop(0)
        del tail
        gc.collect()
        assert len(loader._pool.held) == HELD_BATCHES - 1 and _is_view(next(loader))  # one view free again
    finally:
        loader.close()


def test_batches_dropped_at_once_are_all_views_and_match_in_process(make_config):
    config = make_config("concat", pretokenized=True)
    reference, _, _, _ = batches(config, 3 * MANY // 2)
    loader = _loader(make_config)
    got = []
    try:
        for _ in range(len(reference)):
            batch = next(loader)
            assert _is_view(batch)
            got.append(_frozen(batch))
            del batch
        assert len(loader._pool.held) <= 1  # the slots go back as the batches are freed
    finally:
        loader.close()
    assert_same(reference, got)


def test_a_restore_keeps_the_slots_of_held_batches(make_config):
    """A new run's start reclaims a worker's slots, but not those the trainer still reads."""
    loader = _loader(make_config)
    try:
        state = loader.state_dict()
        held = [next(loader) for _ in range(HELD_BATCHES)]
        expected = [_frozen(b) for b in held]
        for _ in range(3):
            loader.load_state_dict(state)
            again = [_frozen(next(loader)) for _ in range(MANY // 2)]
            assert_same(again[:HELD_BATCHES], expected)
        for got, want in zip(held, expected):
            assert_same([_frozen(got)], [want])
        del held, got
        gc.collect()
        assert len(loader._pool.held) == 0
        loader.load_state_dict(state)
        assert_same([_frozen(next(loader)) for _ in range(HELD_BATCHES)], expected)  # the kept slots came back
    finally:
        loader.close()


def test_close_with_held_batches_frees_workers_and_memory(make_config):
    loader = _loader(make_config)
    held = [next(loader) for _ in range(HELD_BATCHES)]
    expected = [_frozen(b) for b in held]
    pids = [p.pid for p in loader._pool.processes]
    loader.close()
    assert pids_alive(pids) == []
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"zephon-{os.getpid()}-")]
    for got, want in zip(held, expected):  # still readable: the mapping lives as long as its views
        assert_same([_frozen(got)], [want])
    assert _segment_maps()
    del held, got
    gc.collect()
    assert _segment_maps() == []  # the last view gone, the segments are unmapped


def test_slots_per_worker_leave_room_for_the_held_batches():
    assert slots_per_worker(4, 8, 32, batches=True) == slots_per_worker(4, 8, 32) + HELD_BATCHES
