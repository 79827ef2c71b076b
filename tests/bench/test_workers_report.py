"""Issue 16 harness plumbing: goals from results, the process-tree RSS, pre-packed rows, batched tokenization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import workers_report as wr
from bench.peers import run
from bench.peers.common import Layout, TokenizeTexts, packed_rows, tokenized_in_batches

PROF = {"busy_ms": 1.0, "sleep_ms": 4.0, "seq_len": 8, "global_batch": 2, "repeats": 3, "trainer_warmup": 2,
        "trainer_steps": 10, "trainer_seconds": 1.0, "seconds": 1.0, "replay_epochs": 2.0}


def _trainer(step_ms, p99=0.1, first=0.2, restore=0.1):
    return [{"step_ms": step_ms + d, "next_p50_ms": 0.01, "next_p99_ms": p99, "next_max_ms": 1.0, "tokens_per_s": 1e6,
             "first_batch_s": first, "restore_new_s": restore, "restore_inplace_s": restore, "tree_rss_mb": 100.0,
             "descendants": 2} for d in (-0.01, 0.0, 0.01)]


def _results(zephon_step_ms, grain_step_ms, k2_rate, k0_step_ms=5.2, zephon_p99=0.1, ids_rate=100e6):
    return {
        "trainer": {wr.key("zephon", "pretok", 2): _trainer(zephon_step_ms, p99=zephon_p99),
                    wr.key("zephon", "pretok", 0): _trainer(k0_step_ms),
                    wr.key("grain_packed", "pretok", 2): _trainer(grain_step_ms, p99=0.2),
                    wr.key("litdata", "pretok", 2): [{"error": "boom"}],
                    wr.key("zephon", "text", 2): _trainer(5.1, first=0.7)},
        "replay": {wr.key("zephon", "pretok", 0): [{"tokens_per_s": ids_rate}],
                   wr.key("zephon_full", "pretok", 0): [{"tokens_per_s": 70e6}],
                   wr.key("zephon", "pretok", 2): [{"tokens_per_s": k2_rate}],
                   wr.key("litdata", "pretok", 0): [{"tokens_per_s": 40e6}],
                   wr.key("zephon", "text", 0): [{"tokens_per_s": 2.0e6}]},
        "floors": {"tokenize": {"tokens_per_s": 2.5e6}, "scan": {"tokens_per_s": 105e6}},
        "rss": {wr.key("zephon", "pretok", 0, "N"): [{"tree_rss_mb": 300.0}],
                wr.key("zephon", "pretok", 0, "10N"): [{"tree_rss_mb": 320.0}]},
    }


def test_goals_compare_zephon_with_the_best_peer_and_the_thresholds():
    # Overheads over the 5 ms nominal: Zephon +50 us with 2 workers, +200 us in-process, Grain +100 us.
    got = {g: (s, n) for g, s, n in wr.goals(_results(5.05, 5.10, 95e6), PROF)}
    overhead = next(v for g, v in got.items() if g.startswith("2 workers: trainer overhead"))
    assert overhead[0] == "PASS" and "+50 us" in overhead[1] and "+100 us" in overhead[1] and "+200 us" in overhead[1]
    assert got[next(g for g in got if "next() p99" in g)][0] == "PASS"  # 0.1 <= Grain's 0.2 ms
    assert got[next(g for g in got if "replay tok/s" in g)][0] == "PASS"  # 95 >= 0.9 x 100
    assert got[next(g for g in got if "input_ids only" in g)][0] == "PASS"  # 100 >= 0.9 x 105 (scan floor)
    assert got[next(g for g in got if "full batch" in g)][0] == "FAIL"  # 70 < 0.75 x 105
    assert got[next(g for g in got if "tokenizer floor" in g)][0] == "FAIL"  # 2.0 < 0.9 x 2.5
    assert got[next(g for g in got if "first batch" in g and "(text)" in g)][0] == "FAIL"  # 0.7 s
    assert got[next(g for g in got if "RSS" in g and "0 workers" in g)][0] == "PASS"  # 320 <= 1.1 x 300
    assert got[next(g for g in got if "RSS" in g and "2 workers" in g)][0] == "n/a"  # not measured

    worse = {g: s for g, s, _ in wr.goals(_results(5.20, 5.10, 80e6, zephon_p99=0.3, ids_rate=90e6), PROF)}
    assert worse[next(g for g in worse if g.startswith("2 workers: trainer overhead"))] == "FAIL"  # +200 > Grain's
    assert worse[next(g for g in worse if "next() p99" in g)] == "FAIL"  # 0.3 > 0.2 ms
    assert worse[next(g for g in worse if "replay tok/s" in g)] == "FAIL"  # 80 < 0.9 x 100
    assert worse[next(g for g in worse if "input_ids only" in g)] == "FAIL"  # 90 < 0.9 x 105
    # Below the best peer but above half the in-process overhead (+50 us vs +80 us in-process).
    half = {g: s for g, s, _ in wr.goals(_results(5.05, 5.10, 95e6, k0_step_ms=5.08), PROF)}
    assert half[next(g for g in half if g.startswith("2 workers: trainer overhead"))] == "FAIL"


def test_render_has_every_goal_and_a_row_per_measured_case():
    results = _results(5.05, 5.10, 80e6)
    results.update({"calibration": {"busy_iters": 1000, "busy_ms_median": 1.0}, "corpus_tokens": 1000})
    text = wr.render(results, PROF, ["header"], None, "/tmp/RESULTS.md")
    assert text.startswith(wr.SECTION)
    assert text.count("**PASS**") + text.count("**FAIL**") + text.count("**n/a**") == len(wr.goals(results, PROF))
    assert "FAILED: boom" in text and "Grain, pre-packed rows" in text


def test_tree_peak_rss_counts_live_child_processes():
    alone = run.tree_peak_rss_mb()
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(50 << 20); time.sleep(30)"])
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            with_child = run.tree_peak_rss_mb()
            if with_child["descendants"] >= 1 and with_child["tree_rss_mb"] >= alone["tree_rss_mb"] + 45:
                break
            time.sleep(0.1)
        assert with_child["descendants"] >= alone["descendants"] + 1
        assert with_child["tree_rss_mb"] >= alone["tree_rss_mb"] + 45  # the child's 50 MB
    finally:
        child.kill()
        child.wait()


def test_calibrated_busy_loop_takes_about_the_asked_time():
    cal = run.task_calibrate({"busy_ms": 1.0})
    assert cal["busy_iters"] > 1000
    assert 0.5 < cal["busy_ms_min"] < 2.0


def _layout(tmp_path, docs):
    layout = Layout(str(tmp_path))
    os.makedirs(os.path.dirname(layout.flat("web")), exist_ok=True)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    np.save(layout.flat("web") + ".tokens.npy", np.concatenate(docs).astype(np.int32))
    np.save(layout.flat("web") + ".offsets.npy", offsets)
    with open(layout.info_path, "w") as fh:
        json.dump({"eos_id": 0, "sources": {"web": {}}}, fh)
    return layout


def test_packed_rows_are_the_documents_with_eos_cut_every_seq_len(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=int(rng.integers(1, 20))) for _ in range(30)]
    rows = packed_rows(_layout(tmp_path, docs), "web", 8)
    stream = np.concatenate([np.append(d, 0) for d in docs])
    assert rows.shape == (len(stream) // 8, 8)
    assert np.array_equal(rows.reshape(-1), stream[: rows.size])


@pytest.fixture(scope="module")
def tokenizer_path():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "beam_jobs", "assets", "tokenizer.json")
    pytest.importorskip("tokenizers")
    return os.path.abspath(path)


def test_batched_tokenization_gives_the_ids_of_one_call_per_document(tokenizer_path):
    from tokenizers import Tokenizer

    texts = [f"the {i} river of north {'city ' * (i % 7)}" for i in range(150)]
    tok = Tokenizer.from_file(tokenizer_path)
    expected = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    got = [ids.tolist() for ids in tokenized_in_batches(iter(texts), TokenizeTexts(tokenizer_path), size=64)]
    assert got == expected
    as_collate = TokenizeTexts(tokenizer_path, key="text")([{"text": t} for t in texts[:3]])
    assert [x.tolist() for x in as_collate] == expected[:3]


def test_rounds_interleave_cases_and_drop_a_case_after_its_failure():
    calls = []

    def fake_run(task, payload, timeout):
        calls.append(payload["name"])
        if payload["name"] == "b":
            return {"error": "no"}
        if payload["name"] == "d":
            return {"error": "timed out after 1 s"}
        if payload["name"] == "c" and calls.count("c") == 1:
            return {"error": "SyntaxError (a file mid-edit)"}
        return {"x": len(calls)}

    cases = {n: {"name": n} for n in ("a", "b", "c", "d")}
    out = wr.run_rounds(fake_run, "trainer", cases, 3, 1.0, lambda k, x: "")
    # round by round; b given up after two failures, d after its timeout, c's one failure retried
    assert calls == ["a", "b", "c", "d", "a", "b", "c", "a", "c"]
    assert [r["x"] for r in out["a"]] == [1, 5, 8] and len(out["b"]) == 2
    assert [("error" in r) for r in out["c"]] == [True, False, False]
    assert wr.error_of(out["c"]) is None and wr.med(out["c"], "x") == 8
