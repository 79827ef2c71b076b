"""``loader.metrics()``: every counter equals the count recomputed from the delivered batches."""

from __future__ import annotations

import logging
import time

import pytest

from loader.pipeline import ZephonLoader

PAD = "<pad>"  # a pad id no document holds: padding is exactly the pad ids of a batch


def _expected(batches, names, seq_len, pad_id):
    tokens = dict.fromkeys(names, 0)
    supervised = dict.fromkeys(names, 0)
    padding = 0
    for batch in batches:
        ids = batch["input_ids"].numpy()
        is_pad = ids == pad_id
        padding += int(is_pad.sum())
        if "token_source_ids" in batch:
            per_token = batch["token_source_ids"].numpy()
            for k, name in enumerate(names):
                tokens[name] += int((per_token == k).sum())
        else:
            for row, source in enumerate(batch["source_ids"].tolist()):
                tokens[names[source]] += int((~is_pad[row]).sum())
        if "loss_mask" in batch:
            targets = (batch["labels"].numpy() != -100) & (batch["loss_mask"].numpy() == 1)
            for row, source in enumerate(batch["source_ids"].tolist()):
                supervised[names[source]] += int(targets[row].sum())
    return tokens, supervised, padding


def _run(loader, steps):
    batches, waited, last = [], 0.0, []
    while loader.step < steps:
        started = time.perf_counter()
        batch = next(loader)
        waited += time.perf_counter() - started
        batches.append(batch)
        last = [b for b in batches if b["step"] == batch["step"]]
    return batches, waited, last


@pytest.mark.parametrize("packing,unit,workers", [
    ("best_fit", "sequence", 0), ("concat", "sequence", 0), ("concat", "token", 0), ("best_fit", "sequence", 2),
])
def test_counters_equal_the_batches(make_config, packing, unit, workers):
    config = make_config(packing, mix=True, mixing_unit=unit, pad_token=PAD, num_workers=workers)
    with ZephonLoader(config) as loader:
        loader.wait_for_workers(timeout_s=60)
        pad_id = loader.spec.pad_id
        batches, waited, last = _run(loader, 12)
        metrics = loader.metrics()
    names = loader.source_names
    tokens, _, padding = _expected(batches, names, config.seq_len, pad_id)
    total = metrics.total
    assert (metrics.step, total.steps, total.sequences) == (12, 12, 12 * config.global_batch_size)
    assert total.tokens == tokens and total.padding_tokens == padding
    assert total.padding_fraction == pytest.approx(padding / (total.sequences * config.seq_len))
    if packing == "best_fit":
        assert padding > 0
    last_tokens, _, last_padding = _expected(last, names, config.seq_len, pad_id)
    assert metrics.last_step.tokens == last_tokens and metrics.last_step.padding_tokens == last_padding
    assert metrics.last_step.steps == 1 and metrics.last_step.sequences == config.global_batch_size
    assert 0 < total.wait_s <= waited
    assert total.row_groups_read > 0 and total.bytes_read > 0  # workers report theirs with their messages
    assert set(metrics.dataset_rejected) == {"web", "code"}  # the manifests' reject counts, per source


def test_supervised_tokens_and_restore(make_config, masked_source, sources):
    config = make_config("best_fit", pad_token=PAD, datasets=[{"path": masked_source, "weight": 1},
                                                              {"path": sources.web, "weight": 1}])
    with ZephonLoader(config) as loader:
        batches, _, _ = _run(loader, 6)
        state = loader.state_dict()
        metrics = loader.metrics()
        tokens, supervised, _ = _expected(batches, loader.source_names, config.seq_len, loader.spec.pad_id)
        assert metrics.total.tokens == tokens
        assert metrics.total.supervised_tokens == supervised and supervised["chat"] > 0
        assert supervised["web"] == sum(  # a source without a mask supervises every label
            int((b["labels"][r] != -100).sum()) for b in batches for r, s in enumerate(b["source_ids"].tolist()) if s == 1)
        loader.load_state_dict(state)
        next(loader)
        after = loader.metrics()
        assert after.restores == 1 and after.restore_s > 0 and after.first_batch_after_restore_s > 0


def test_bytes_read_are_the_row_groups_read(make_config, monkeypatch):
    """In-process without read-ahead: bytes_read is the compressed size of the column chunks of
    every row group the lanes read, counted here by instrumenting Parquet's reader."""
    import pyarrow.parquet as pq

    read = {"groups": 0, "bytes": 0}
    original = pq.ParquetFile.read_row_group

    def counting(self, i, columns=None, **kwargs):
        group = self.metadata.row_group(i)
        read["groups"] += 1
        read["bytes"] += sum(group.column(c).total_compressed_size for c in range(group.num_columns)
                             if group.column(c).path_in_schema in (columns or ()))
        return original(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    with ZephonLoader(make_config("concat", read_ahead=False)) as loader:
        _run(loader, 20)
        metrics = loader.metrics()
    assert metrics.total.row_groups_read == read["groups"] > 0
    assert metrics.total.bytes_read == read["bytes"]


def test_periodic_log_line(make_config, caplog):
    with ZephonLoader(make_config("concat", metrics_log_every_steps=2)) as loader:
        with caplog.at_level(logging.INFO, logger="loader.metrics"):
            _run(loader, 4)
        flat = loader.metrics().flat()
    lines = [r.getMessage() for r in caplog.records if r.name == "loader.metrics"]
    assert len(lines) == 2 and lines[0].startswith("zephon step 2: last step") and "total tokens web=" in lines[1]
    assert flat["zephon/total/steps"] == 4.0 and "zephon/last_step/tokens/web" in flat
