"""Fast checks of the metrics-overhead benchmark's plumbing (bench/metrics_overhead.py): no benchmark runs."""

from __future__ import annotations

import pytest

from bench import loader_throughput as lt
from bench import metrics_overhead as mo


def test_cases_are_pretokenized_replay_only():
    a = mo.parse_args([])
    assert a.cases == list(mo.DEFAULT_CASES) and a.probes >= 1
    with pytest.raises(SystemExit):
        mo.parse_args(["--cases", "text_concat_k0"])  # the goal is about pre-tokenized replay


def test_probe_times_a_twin_and_leaves_the_real_counts_alone():
    class Recorder:
        def __init__(self):
            self.calls = 0

        def count(self, items, batch, wait_s, rank_position):
            self.calls += 1

    real, spent = Recorder(), {"metrics_s": 0.0, "micro_batches": 0}
    probed = lt._probed_count(real, spent)
    for position in range(3):
        probed([], {}, 0.0, position)
    assert real.calls == 3 and spent["micro_batches"] == 3 and spent["metrics_s"] > 0
    assert lt._NoMetrics().count([], {}, 0.0, 0) is None and not lt._NoMetrics.copies_token_sources
