"""``balance = "attention"``: the same global batches, spread over ranks by cost.

The pure assignment by Hypothesis properties; the loader by real fingerprints of simulated
ranks (W 1/2/4, a resume from W=2 to W=4) and a real 2- and 4-process gloo run compared rank
by rank with the simulated ranks; the balance itself on a long-tailed corpus.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from loader.commands.diff import config_differences
from loader.commands.fingerprints import collect_fingerprints, command as fingerprints_command, sequence_bytes
from loader.config import ConfigError, LoaderConfig
from loader.order.balance import CostModel, balanced_assignment, default_assignment
from loader.pipeline import ZephonLoader
from tests.dataset_factory import write_dataset
from tests.rank_launcher import launch_ranks
from tests.resume_harness import check_resume, loader_runs

SEQ_LEN = 256
BATCH = 64
MICRO = 4


# -- the pure assignment -----------------------------------------------------------------------
@st.composite
def batches(draw):
    world_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    micro = draw(st.integers(min_value=1, max_value=4))
    steps = draw(st.integers(min_value=1, max_value=4))
    size = world_size * micro * steps
    costs = draw(st.lists(st.integers(min_value=0, max_value=10**9), min_size=size, max_size=size))
    return costs, world_size, micro


@settings(max_examples=300, deadline=None)
@given(batches())
def test_assignment_is_a_permutation_of_the_batch_with_every_micro_batch_full(case):
    costs, world_size, micro = case
    assignment = balanced_assignment(costs, world_size, micro)
    assert len(assignment) == world_size
    flat = [p for rank in assignment for batch in rank for p in batch]
    assert sorted(flat) == list(range(len(costs)))  # the same set: nothing lost or repeated
    assert all(len(batch) == micro for rank in assignment for batch in rank)
    assert all(batch == sorted(batch) for rank in assignment for batch in rank)
    assert balanced_assignment(list(costs), world_size, micro) == assignment  # deterministic


@settings(max_examples=300, deadline=None)
@given(batches())
def test_balanced_is_never_worse_than_the_largest_item_allows(case):
    """LPT bound: the slowest rank exceeds the mean by at most the largest single cost."""
    costs, world_size, micro = case
    per_rank = [sum(costs[p] for b in rank for p in b) for rank in balanced_assignment(costs, world_size, micro)]
    assert max(per_rank) <= sum(costs) / world_size + max(costs)


def test_default_assignment_is_the_rank_mod_w_layout():
    assert default_assignment(8, 2, 2) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


def test_cost_model_prices_attention_segments_and_images():
    model = CostModel(linear=10)
    assert model.segment_cost([3, 4]) == 9 + 16 + 10 * 7
    # a row of 16 tokens: segments [0, 5) [5, 12), padding [12, 16) left out
    assert model.row_cost(np.array([0, 5, 12]), 16, 4) == 25 + 49 + 10 * 12
    refs = np.array([-1, 7, 7, -1, 9, 9, 9, -1])  # two images: 2 and 3 visual tokens, 4 patches each
    assert model.row_cost(np.array([0]), 8, 0, refs) == 64 + 80 + (8 * 8 + 80) + (12 * 12 + 120)


def test_balance_choices_are_named():
    with pytest.raises(ConfigError, match="balance"):
        LoaderConfig(datasets=[{"path": "."}], seq_len=8, global_batch_size=2, micro_batch_size=1, seed=0,
                     tokenizer=".", balance="tokens")


# -- a long-tailed corpus ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_tailed(tmp_path_factory, tokenizer, tokenizer_path):
    """Lognormal document lengths up to seq_len, pre-tokenized, 8 lanes."""
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "data", "model", "token", "lane", "zephon", "batch"]
    lengths = np.minimum(rng.lognormal(3.6, 1.0, size=1500).astype(int) + 1, SEQ_LEN - 2)
    texts = [" ".join(words[k] for k in rng.integers(0, len(words), n)) for n in lengths]
    path = tmp_path_factory.mktemp("long_tailed") / "data"
    write_dataset(str(path), texts, num_lanes=8, seed=1, tokenizer=tokenizer, row_group_rows=64)

    def make(**overrides) -> LoaderConfig:
        fields = dict(datasets=[{"path": str(path)}], seq_len=SEQ_LEN, global_batch_size=BATCH,
                      micro_batch_size=MICRO, seed=3, tokenizer=tokenizer_path, packing="best_fit",
                      batch_fields=("input_ids", "labels", "position_ids"))
        fields.update(overrides)
        return LoaderConfig(**fields)

    return make


def _lines(config, world_size, steps):
    results, _ = collect_fingerprints(config, world_size=world_size, end_step=steps)
    return [r.line() for r in results]


@pytest.mark.slow
def test_long_tailed_w4_is_balanced_within_5_percent(long_tailed):
    loader = ZephonLoader(long_tailed(balance="attention"), rank=0, world_size=4)  # its balancer sees all ranks
    try:
        for _ in range(100 * loader.topology.micro_steps_per_step):
            next(loader)
        stats = loader.metrics().balance
    finally:
        loader.close()
    assert stats["steps"] == 100
    print(f"W=4, 100 steps: mean max/mean rank cost {stats['mean_max_over_mean']:.4f} balanced, "
          f"{stats['mean_max_over_mean_unbalanced']:.4f} unbalanced")
    assert stats["mean_max_over_mean"] <= 1.05
    assert stats["mean_max_over_mean_unbalanced"] > stats["mean_max_over_mean"]


def test_fingerprints_equal_unbalanced_on_every_world_size(long_tailed):
    reference = _lines(long_tailed(), 1, 4)
    for world_size in (1, 2, 4):
        assert _lines(long_tailed(balance="attention"), world_size, 4) == reference, f"W={world_size}"
    assert _lines(long_tailed(balance="attention", num_workers=2), 2, 4) == reference, "W=2, 2 workers"


def test_ranks_get_other_ranks_sequences(long_tailed):
    loader = ZephonLoader(long_tailed(balance="attention"), rank=1, world_size=4)
    try:
        indices = [i for _ in range(loader.topology.micro_steps_per_step) for i in next(loader)["global_indices"].tolist()]
    finally:
        loader.close()
    assert len(indices) == BATCH // 4 and all(0 <= i < BATCH for i in indices)
    assert any(i % 4 != 1 for i in indices)  # balancing moved sequences between ranks


def test_resume_w2_to_w4_is_exact(long_tailed):
    config = long_tailed(balance="attention")
    make = loader_runs(config, [{"world_size": 2}, {"world_size": 2}, {"world_size": 4}])
    check_resume(make, steps=6, cut_points=[3], expected=_lines(long_tailed(), 1, 6))


# -- real ranks ----------------------------------------------------------------------------------
def _simulated_rows(config, world_size, steps):
    loaders = [ZephonLoader(config, rank=r, world_size=world_size) for r in range(world_size)]
    rows = [{} for _ in range(world_size)]
    try:
        for _ in range(steps):
            for rank, loader in enumerate(loaders):
                for _ in range(loader.topology.micro_steps_per_step):
                    batch = next(loader)
                    for index, ids, labels in zip(batch["global_indices"].tolist(), batch["input_ids"].numpy(),
                                                  batch["labels"].numpy()):
                        rows[rank][str(index)] = [rank, batch["step"], sequence_bytes(ids, labels).hex()]
    finally:
        for loader in loaders:
            loader.close()
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_real_gloo_ranks_agree_with_simulated_ranks(long_tailed, tmp_path, world_size):
    config = long_tailed(balance="attention")
    config_path, out = tmp_path / "config.json", tmp_path / "rows.json"
    config_path.write_text(json.dumps(config.to_dict()))
    steps = 3
    launch_ranks(world_size, "tests.loader.dist_worker", [str(config_path), str(out), str(steps), "-", "run"],
                 timeout_s=240)
    real = json.loads(out.read_text())["ranks"]
    simulated = _simulated_rows(config, world_size, steps)
    for rank in range(world_size):
        assert real[rank]["rows"] == simulated[rank], f"rank {rank}"
    assert any(int(i) % world_size != 0 for i in real[0]["rows"])  # the exchange moved sequences


def test_zephon_fingerprints_notes_the_rank_costs(long_tailed, tmp_path, capsys):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(long_tailed(balance="attention").to_dict()))
    assert fingerprints_command([str(config_path), "--steps", "0:3", "--world-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if not line.startswith("#")]) == 3
    note = [line for line in out if line.startswith("# balance attention W=2")]
    assert note and "over 3 steps" in note[0] and "unbalanced" in note[0]


def test_zephon_diff_counts_balance_as_runtime_and_a_window_as_stream(long_tailed):
    plain = long_tailed()
    assert config_differences(plain, long_tailed(balance="attention")) == [
        {"field": "balance", "kind": "runtime", "a": None, "b": "attention"}]
    assert [d["kind"] for d in config_differences(plain, long_tailed(packing_window=64))] == ["stream"]


def test_balance_over_a_packing_window_keeps_its_stream(long_tailed):
    assert _lines(long_tailed(packing_window=64, balance="attention"), 2, 3) == \
        _lines(long_tailed(packing_window=64), 1, 3)
