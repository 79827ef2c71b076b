"""Bulk paths of issue 35: micro-batches as rows of the concat fills in-process, and built whole
by the workers. Both must deliver exactly the micro-batches (keys, dtypes, values) and the
states of the per-item path, which the rest of the suite pins."""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pytest

from loader.pipeline import ZephonLoader
from loader.workers.batches import ROWS_POLICIES, ShippedBatch, batch_plan
from tests.loader.settings import MICRO_BATCH, NUM_LANES


STEPS = 12  # micro-batches per run: GLOBAL_BATCH // MICRO_BATCH = 8 per step, epochs end every ~10 steps


def batches(config, micro_batches: int, *, wait: bool = True, pace_s: float = 0.0, bulk: bool = True,
            restore=None, save_at=(), rows: str = "loader_bound"):
    """The run's micro-batches (NumPy), its states at ``save_at`` and whether it used the bulk
    paths; ``rows``: when the workers ship bulk rows for the trainer to collate (BatchPlan.rows)."""
    loader = ZephonLoader(config, output="numpy")
    if loader._batch_plan is not None:
        loader._batch_plan = dataclasses.replace(loader._batch_plan, rows=rows)
    if restore is not None:
        loader.load_state_dict(restore)
    if wait and config.num_workers:
        loader.wait_for_workers(timeout_s=60)
    out, states, used = [], {}, {"rows": 0, "ready": 0}
    try:
        for k in range(micro_batches):
            if not bulk and loader._run is not None:
                loader._run.bulk_rows = False
            out.append(next(loader))
            if loader._run.bulk_rows:
                used["rows"] += 1
            if loader._run.batch_plan is not None and loader._run.lead is None:
                used["ready"] += 1
            if k in save_at:
                states[k] = loader.state_dict()
            if pace_s:
                time.sleep(pace_s)
        metrics = loader.metrics().total
    finally:
        loader.close()
    return out, states, used, metrics


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert list(x) == list(y), f"micro-batch {k}: keys {list(x)} != {list(y)}"
        for key in x:
            if isinstance(x[key], np.ndarray):
                assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), f"micro-batch {k}: {key}"
            else:
                assert type(x[key]) is type(y[key]) and x[key] == y[key], f"micro-batch {k}: {key}"


@pytest.mark.parametrize("fields", [None, ("input_ids",), ("input_ids", "labels", "cu_seqlens")])
def test_in_process_bulk_rows_match_the_item_path(make_config, fields):
    config = make_config("concat", pretokenized=True, **({"batch_fields": fields} if fields else {}))
    bulk, bulk_states, used, bulk_metrics = batches(config, 8 * STEPS, save_at=(7, 50))
    items, item_states, _, item_metrics = batches(config, 8 * STEPS, bulk=False, save_at=(7, 50))
    assert used["rows"] == 8 * STEPS  # the run was eligible throughout (its rows: whenever a fill has them)
    assert_same(bulk, items)
    assert bulk_states == item_states
    assert bulk_metrics.tokens == item_metrics.tokens and bulk_metrics.sequences == item_metrics.sequences


@pytest.mark.parametrize("rows", ROWS_POLICIES)
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_worker_micro_batches_match_in_process_and_resume(make_config, packing, rows, monkeypatch):
    config = make_config(packing, pretokenized=True)
    reference, states, _, ref_metrics = batches(config, 8 * STEPS, save_at=(5, 40))
    workers = config.replace(num_workers=2)
    collated, collate = [], ShippedBatch.collated
    monkeypatch.setattr(ShippedBatch, "collated", lambda self, c: collated.append(1) or collate(self, c))
    got, worker_states, used, metrics = batches(workers, 8 * STEPS, save_at=(5, 40), rows=rows)
    assert used["ready"] == 8 * STEPS  # every micro-batch came whole from a worker
    if rows != "loader_bound":  # shipped as rows or items for the trainer to collate: always, or never
        assert len(collated) == (8 * STEPS if rows == "always" else 0)
    assert_same(reference, got)
    assert worker_states == states
    assert metrics.tokens == ref_metrics.tokens and metrics.padding_tokens == ref_metrics.padding_tokens
    resumed, _, _, _ = batches(workers, 8 * STEPS - 41, restore=states[40], rows=rows)
    assert_same(reference[41:], resumed)


@pytest.mark.parametrize("fields", [("input_ids",), ("input_ids", "labels", "cu_seqlens")])
def test_shipped_rows_collated_by_the_trainer_for_other_fields(make_config, fields, monkeypatch):
    config = make_config("concat", pretokenized=True, batch_fields=fields)
    reference, _, _, _ = batches(config, 5 * 8)
    collated, collate = [], ShippedBatch.collated
    monkeypatch.setattr(ShippedBatch, "collated", lambda self, c: collated.append(1) or collate(self, c))
    got, _, used, _ = batches(config.replace(num_workers=2), 5 * 8, rows="always")
    assert used["ready"] == 5 * 8 and len(collated) > 5 * 4  # most came as rows (a block's last rows do not)
    assert_same(reference, got)


def test_hand_over_from_the_warm_start_to_whole_batches(make_config):
    """No wait for the workers: the trainer's lanes lead until the workers' batches catch up."""
    config = make_config("concat", pretokenized=True)
    loader = ZephonLoader(config.replace(num_workers=2), output="numpy")
    got, deadline = [], time.monotonic() + 60
    try:
        while True:
            got.append(next(loader))
            run = loader._run
            if run.batch_plan is not None and run.lead is None:
                break
            assert time.monotonic() < deadline, "the workers never took over"
            time.sleep(0.01)  # a trainer with other work: the workers catch up
        led = len(got)
        got += [next(loader) for _ in range(16)]
        assert loader._run.pool is not None and loader._run.lead is None
    finally:
        loader.close()
    reference, _, _, _ = batches(config, len(got))
    assert_same(reference, got)
    assert led >= 1


def test_text_sources_through_worker_batches(make_config):
    config = make_config("concat")
    reference, _, _, _ = batches(config, 3 * 8)
    got, _, used, _ = batches(config.replace(num_workers=2), 3 * 8)
    assert used["ready"] == 3 * 8
    assert_same(reference, got)


def test_batch_plan_groups():
    plan = batch_plan(rank=0, world_size=1, num_lanes=NUM_LANES, micro_batch_size=MICRO_BATCH, num_workers=2,
                      collator={})
    assert plan.groups == NUM_LANES // MICRO_BATCH
    owned = [plan.lanes_of(k) for k in range(2)]
    assert sorted(owned[0] + owned[1]) == list(range(NUM_LANES))  # a partition of the rank's lanes
    for m in range(2 * plan.groups):  # each micro-batch's lanes belong to the worker that builds it
        lanes = {(m * MICRO_BATCH + p) % NUM_LANES for p in range(MICRO_BATCH)}
        assert lanes <= set(owned[plan.worker_of(m)])
    # Two ranks of 16 lanes: positions p of rank 1 fall on lanes 1, 3, ..., 15 (period 8).
    plan = batch_plan(rank=1, world_size=2, num_lanes=16, micro_batch_size=4, num_workers=2, collator={})
    assert plan.groups == 2 and sorted(plan.lanes_of(0) + plan.lanes_of(1)) == list(range(1, 16, 2))
    # A micro-batch that does not divide the lane period, or fewer groups than workers: item messages.
    assert batch_plan(rank=0, world_size=1, num_lanes=8, micro_batch_size=3, num_workers=2, collator={}) is None
    assert batch_plan(rank=0, world_size=1, num_lanes=8, micro_batch_size=8, num_workers=2, collator={}) is None


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory) -> str:
    """Conversations sharded offline (tokenized, loss masks): tests/chat's job on its records."""
    from beam_jobs import shard
    from tests.chat.chat_factory import make_records
    from tests.chat.test_chat_shard import MAX_TOKENS, _job_args, _write_jsonl

    base = tmp_path_factory.mktemp("worker_batches_chat")
    _write_jsonl(base / "chat.jsonl", make_records(17, 120))
    shard.run(_job_args([str(base / "chat.jsonl")], base / "out", "--chat-max-tokens", str(MAX_TOKENS),
                        "--chat-overflow", "truncate"))
    return str(base / "out")


@pytest.mark.parametrize("rows", ["always", "never"])
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_chat_through_worker_batches(chat_dataset, packing, rows):
    """Loss masks and padded best-fit rows (padding per row) travel in the worker's batches too,
    collated there or (best fit: as items) by the trainer."""
    from tests.chat.test_chat_shard import _config

    config = _config([{"path": chat_dataset, "name": "chat"}], packing)
    reference, states, _, ref_metrics = batches(config, 24, save_at=(9,))
    got, worker_states, used, metrics = batches(config.replace(num_workers=2), 24, save_at=(9,), rows=rows)
    assert used["ready"] == 24
    assert "loss_mask" in got[0]
    assert_same(reference, got)
    assert worker_states == states
    assert metrics.tokens == ref_metrics.tokens and metrics.padding_tokens == ref_metrics.padding_tokens


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_filled_tails_keep_item_messages_and_the_stream(make_config, packing):
    """Finite data with filled tails looks a step ahead: item messages, the same stream to its end."""
    path = make_config(packing, pretokenized=True).datasets[0].path
    config = make_config(packing, pretokenized=True, datasets=[{"path": path, "max_epochs": 1}], epoch_tail="fill")

    def to_the_end(config) -> tuple[list, bool]:
        loader = ZephonLoader(config, output="numpy")
        try:
            if config.num_workers:
                loader.wait_for_workers(timeout_s=60)
            out = list(itertools.islice(loader, 50 * STEPS))
            return out, loader._batch_plan is not None
        finally:
            loader.close()

    reference, _ = to_the_end(config)
    got, planned = to_the_end(config.replace(num_workers=2))
    assert not planned and 0 < len(reference) < 50 * STEPS  # the data ended
    assert_same(reference, got)
