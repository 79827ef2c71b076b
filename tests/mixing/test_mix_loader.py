"""Mixing through the real loader: per-batch counts, source ids, attribution, CLI, config errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from loader.config import ConfigError
from loader.commands.fingerprints import collect_fingerprints, main as fingerprints_main
from loader.io.manifest import ManifestError
from loader.order.mixing import exact_weights
from loader.pipeline import ZephonLoader
from tests.mixing.conftest import GLOBAL_BATCH, LOADER_SEED, NUM_LANES, THIRDS, WEIGHTS
from tests.mixing.mix_helpers import count_bounds, lane_records, run_records, source_tokens_of_lane, stream_prefix

STEPS = 50


@pytest.mark.parametrize("weights", [WEIGHTS, THIRDS], ids=["0.55-0.3-0.15", "thirds"])
def test_every_batch_holds_floor_or_ceil_of_each_share(mix_config, weights) -> None:
    config = mix_config(weights)
    records = run_records(config, STEPS)
    loader = ZephonLoader(config)
    schedule = loader.spec.schedule
    counts = np.zeros((STEPS, 3), dtype=int)
    for index, record in records.items():
        # The source of every sequence is the pure decision for its global index ...
        assert record.source == schedule.source_of(index), f"global index {index}"
        counts[record.step, record.source] += 1
    # ... so every batch holds floor or ceil of w * B of each source ...
    for s, (lo, hi) in enumerate(count_bounds(weights, GLOBAL_BATCH)):
        assert counts[:, s].min() >= lo and counts[:, s].max() <= hi, (s, lo, hi, counts[:, s])
        assert lo < hi  # B = 28 leaves a remainder: both values occur
        assert set(counts[:, s]) <= {lo, hi}
    assert (counts.sum(axis=1) == GLOBAL_BATCH).all()
    # ... and the running total stays within a few sequences of N * w * B.
    exact = [float(w * GLOBAL_BATCH) for w in exact_weights(list(weights.values()))]
    expected = np.outer(np.arange(1, STEPS + 1), exact)
    assert np.abs(np.cumsum(counts, axis=0) - expected).max() <= 4


@pytest.mark.parametrize("unit", ["sequence", "token"])
def test_sequences_come_from_the_source_they_are_labelled_with(mix_config, mix_data, tokenizer, unit) -> None:
    """Per lane and source, the labelled tokens in order are exactly that source's lane stream.

    Sequence mixing: whole sequences of the source, in lane order. Token mixing: the tokens
    whose ``token_source_ids`` name the source. Either way nothing is lost, duplicated or
    attributed to the wrong source.
    """
    config = mix_config(mixing_unit=unit)
    records = run_records(config, 30)
    for lane in range(NUM_LANES):
        outputs = lane_records(records, lane, NUM_LANES)
        for s, name in enumerate(WEIGHTS):
            tokens, _ = source_tokens_of_lane(outputs, s)
            assert len(tokens) > 0, f"lane {lane} got nothing of {name}"
            expected = stream_prefix(mix_data.paths[name], tokenizer, lane, len(tokens), seed=LOADER_SEED)
            assert np.array_equal(tokens, expected), f"lane {lane} source {name}: tokens differ from its stream"


def test_token_mixing_labels_every_token(mix_config) -> None:
    records = run_records(mix_config(mixing_unit="token", micro_batch_size=14), 10, world_size=2)
    mixed = 0
    for record in records.values():
        assert (record.token_sources >= 0).all()  # repeat sources never run out: no padding
        mixed += len(set(record.token_sources.tolist())) > 1
    assert mixed > len(records) // 4  # documents of several sources share sequences


def test_fingerprints_cli_prints_counts_per_source(mix_config, tmp_path, capsys) -> None:
    config = mix_config()
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({
        "datasets": [{"path": d.path, "name": d.name, "weight": d.weight} for d in config.datasets],
        "seq_len": config.seq_len, "global_batch_size": config.global_batch_size,
        "micro_batch_size": config.micro_batch_size, "seed": config.seed, "tokenizer": config.tokenizer,
    }))
    assert fingerprints_main([str(path), "--world-size", "2", "--micro-batch", "7", "--steps", "3:9"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    bounds = count_bounds(WEIGHTS, GLOBAL_BATCH)
    for step, line in zip(range(3, 9), lines):
        match = re.fullmatch(r"(\d+) ([0-9a-f]{64}) web=(\d+) code=(\d+) math=(\d+)", line)
        assert match, line
        assert int(match.group(1)) == step
        counts = [int(match.group(k)) for k in (3, 4, 5)]
        assert sum(counts) == GLOBAL_BATCH
        assert all(lo <= c <= hi for c, (lo, hi) in zip(counts, bounds))
    reference, _ = collect_fingerprints(config, start_step=3, end_step=9)
    assert lines == [r.line() for r in reference]


# -- configuration errors ---------------------------------------------------------------------
def test_sources_with_different_lane_counts_are_refused(mix_config, mix_data) -> None:
    config = mix_config().replace(datasets=[
        {"path": mix_data.paths["web"], "name": "web"}, {"path": mix_data.odd_lanes_path, "name": "odd"},
    ])
    with pytest.raises(ManifestError, match=r"same lane count.*'web': 8.*'odd': 4.*re-shard"):
        ZephonLoader(config)


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"web": 1, "code": 1, "math": 1, "wiki": 1}, r"unknown \['wiki'\], missing \[\]"),
        ({"web": 1, "code": 1}, r"unknown \[\], missing \['math'\]"),
        ({"web": 1, "code": 1, "maths": 2}, r"unknown \['maths'\], missing \['math'\]"),
    ],
)
def test_schedule_must_name_every_source_exactly(mix_config, weights, message) -> None:
    config = mix_config(schedule=[{"step": 10, "weights": weights}])
    with pytest.raises(ManifestError, match=rf"schedule entry at step 10.*{message}"):
        ZephonLoader(config)


def test_schedule_steps_must_increase(mix_config) -> None:
    with pytest.raises(ConfigError, match=r"strictly increasing \(got 5 after 10\)"):
        mix_config(schedule=[{"step": 10, "weights": THIRDS}, {"step": 5, "weights": THIRDS}])


def test_schedule_weights_need_a_positive_sum(mix_config) -> None:
    with pytest.raises(ValueError, match="positive sum"):
        ZephonLoader(mix_config(schedule=[{"step": 4, "weights": {"web": 0, "code": 0, "math": 0}}]))
