"""Fast checks of the before/after runner's plumbing (bench/before_after.py): no benchmark runs."""

from __future__ import annotations

import sys

import pytest

from bench import before_after as ba
from bench import compare


def _run(tokens: int, seconds: float, startup: float = 0.0, cpu: float = 1.0) -> dict:
    return {"tokens": tokens, "seconds": seconds, "startup_s": startup, "cpu_s": cpu}


def test_defaults_are_the_pretokenized_cases_against_the_landed_commit():
    a = ba.parse_args([])
    assert a.cases == list(ba.DEFAULT_CASES) and all(ba.CASES[c][0] == "pre" for c in a.cases)
    assert a.old == "576b270" and a.rounds >= 3 and a.epochs == 2.0
    assert {ba.CASES[c][2] for c in a.cases} == {0, 2}  # in-process and with workers
    assert {ba.CASES[c][1] for c in a.cases} == {"concat", "best_fit"}


@pytest.mark.parametrize("argv, needle", [
    (["--cases", "pre_concat_k0,nope"], "nope"),
    (["--cases", ","], "(empty)"),
    (["--rounds", "0"], "--rounds"),
    (["--epochs", "0"], "--epochs"),
    (["--docs", "3"], "--docs"),
])
def test_bad_arguments_are_refused_with_the_value(argv, needle, capsys):
    with pytest.raises(SystemExit):
        ba.parse_args(argv)
    err = capsys.readouterr().err
    assert needle in err
    if "nope" in argv[-1]:
        assert "pre_best_fit_k2" in err  # lists the known cases


def test_schedule_interleaves_trees_and_flips_the_order_every_round():
    order = ba.schedule(["a", "b"], 3)
    assert len(order) == 3 * 2 * 2
    assert order[:4] == [(0, "a", "old"), (0, "a", "new"), (0, "b", "old"), (0, "b", "new")]
    assert order[4:8] == [(1, "a", "new"), (1, "a", "old"), (1, "b", "new"), (1, "b", "old")]
    assert order[8:10] == [(2, "a", "old"), (2, "a", "new")]


def test_steady_rate_leaves_out_the_first_micro_batch():
    # 1,000 tokens in 3 s, of which the first micro-batch (100 tokens) took 1 s: 900 / 2 s
    assert ba.steady_rate(_run(1000, 3.0, startup=1.0), first_tokens=100) == pytest.approx(450.0)
    assert ba.cpu_rate(_run(1000, 3.0, cpu=4.0)) == pytest.approx(250.0)


def test_summarize_takes_ratios_within_rounds_and_skips_failed_rounds():
    old = [_run(1100, 2.0, 1.0), _run(1100, 3.0, 1.0), {"error": "exit 1: boom"}, _run(1100, 1.5, 0.5)]
    new = [_run(1100, 3.0, 1.0), _run(1100, 3.0, 1.0), _run(1100, 1.0, 0.0), None]
    s = ba.summarize(old, new, first_tokens=100)
    # steady rates: old 1000, 500, -, 1000; new 500, 500, 1000, -
    assert s["pairs"] == 2 and s["rounds"] == 4 and s["errors"] == ["exit 1: boom"]
    assert s["ratio"] == pytest.approx(0.75) and (s["ratio_min"], s["ratio_max"]) == (0.5, 1.0)
    assert s["old_tokens_per_s"] == 1000 and s["new_tokens_per_s"] == 500
    assert s["ratio_of_medians"] == pytest.approx(0.5)
    assert s["status"] == "FAIL"
    assert ba.summarize(old, new, first_tokens=100, goal=0.75)["status"] == "PASS"
    assert ba.summarize([None], [{"error": "x"}], first_tokens=1)["status"] == "NO DATA"


def test_report_has_a_row_and_a_goal_line_per_case():
    ok = ba.summarize([_run(100, 1.0)], [_run(99, 1.0)], first_tokens=0)
    lines = ba.report({"pre_concat_k0": ok, "pre_concat_k2": ba.summarize([None], [None], 0)})
    assert any(line.startswith("| pre_concat_k0 | 0.00 M | 0.00 M | 0.990 (0.990-0.990)") for line in lines)
    assert "GOAL pre_concat_k0 new/old >= 0.97: 0.990 PASS" in lines
    assert "GOAL pre_concat_k2 new/old >= 0.97: - NO DATA" in lines


def _fake_tree(root, warm_start: bool) -> ba.Tree:
    """A tree with a ``loader.pipeline.ZephonLoader`` (with ``wait_for_workers`` or without) and a
    ``bench/loader_throughput.py`` whose loader child reports what it got."""
    (root / "loader").mkdir(parents=True)
    (root / "bench").mkdir()
    (root / "loader" / "__init__.py").write_text("")
    (root / "bench" / "__init__.py").write_text("")
    waits = "    def wait_for_workers(self):\n        self.waited = True\n" if warm_start else ""
    (root / "loader" / "pipeline.py").write_text(
        "class ZephonLoader:\n    waited = False\n    def __init__(self, config):\n        self.config = config\n" + waits)
    (root / "bench" / "loader_throughput.py").write_text(
        "def child_loader(dataset, num_workers):\n"
        "    from loader.pipeline import ZephonLoader\n"
        "    zl = ZephonLoader(dataset)\n"
        "    return {'tokens': 10, 'seconds': 1.0, 'startup_s': 0.5, 'cpu_s': 1.0, 'waited': zl.waited,\n"
        "            'config': zl.config, 'workers': num_workers}\n"
        "CHILDREN = {'loader': child_loader}\n")
    return ba.Tree("old", str(root), "abc1234")


def test_a_tree_runs_its_own_child_with_only_its_own_root_on_pythonpath(tmp_path):
    tree = _fake_tree(tmp_path / "t", warm_start=False)
    env = tree.env({"PYTHONPATH": compare.REPO + ":/elsewhere", "HOME": "/h"})
    assert env == {"PYTHONPATH": tree.root, "HOME": "/h"}
    r = compare.Runner(sys.executable, str(tmp_path / "log"))
    spec = {"kind": "loader", "dataset": "/data/x", "num_workers": 2}
    res = r.run_command(tree.child_command(sys.executable, spec), 60, cwd=tree.root, env=tree.env(r.env),
                        prefix="RESULT ")
    assert res["config"] == "/data/x" and res["workers"] == 2
    assert res["loader_file"] == str(tmp_path / "t" / "loader" / "pipeline.py")
    assert ba.under(res["loader_file"], tree.root) and not ba.under(res["loader_file"], compare.REPO)
    assert res["waited_for_workers"] is False and res["waited"] is False


def test_a_loader_with_a_warm_start_waits_for_its_workers_before_the_child_times_it(tmp_path):
    tree = _fake_tree(tmp_path / "t", warm_start=True)
    r = compare.Runner(sys.executable, str(tmp_path / "log"))
    res = r.run_command(tree.child_command(sys.executable, {"kind": "loader", "dataset": "d", "num_workers": 2}),
                        60, cwd=tree.root, env=tree.env(r.env), prefix="RESULT ")
    assert res["waited_for_workers"] is True and res["waited"] is True


def test_runner_runs_a_command_in_the_given_tree_and_reads_its_result_line(tmp_path):
    r = compare.Runner(sys.executable, str(tmp_path / "log"))
    code = "import json, os; print('noise'); print('RESULT ' + json.dumps({'cwd': os.getcwd(), 'pp': os.environ['PYTHONPATH']}))"
    tree = ba.Tree("old", str(tmp_path), "x")
    res = r.run_command([sys.executable, "-c", code], 60, cwd=tree.root, env=tree.env(r.env), prefix="RESULT ")
    assert res == {"cwd": str(tmp_path), "pp": str(tmp_path)}
    failed = r.run_command([sys.executable, "-c", "raise SystemExit('no result')"], 60, prefix="RESULT ")
    assert failed["error"].startswith("exit 1") and "no result" in failed["error"]
