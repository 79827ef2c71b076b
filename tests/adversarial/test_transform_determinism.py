"""Transforms that are not functions of their document are refused by name (issue 28, class 2).

Each instance of :data:`tests.adversarial.hostile_transforms.NOT_DETERMINISTIC` passes the
old check (two calls on each of the first 8 documents): a counter read as ``calls // 2``, a
quota, a closure over a list, a global ``random`` or ``numpy.random`` that decides one document
in 50, the clock, ``id()``, ``set`` order and ``hash()`` of strings. Every one must end in a
:class:`TransformError` naming it, in-process, in loader workers and in the Beam job: never a
run that completes with other batches than the next run. Seeded transforms pass untouched.
"""

from __future__ import annotations

import json
import os

import pytest

from beam_jobs import shard
from loader.errors import TransformError, ZephonError
from loader.pipeline import ZephonLoader
from loader.transforms import chain as chain_module
from loader.transforms import probe
from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document
from loader.transforms.spec import TransformSpec
from tests.adversarial.hostile_transforms import NOT_DETERMINISTIC, SEEN_BY_TWO_CALLS, reset_counters
from tests.dataset_factory import synthetic_texts
from tests.transforms.conftest import loader_config, transform_corpus  # noqa: F401 - a fixture, found by name

HOSTILE = "tests.adversarial.hostile_transforms:"
SEEDED = ("tests.transforms.functions:drop_random_words", "tests.transforms.functions:shout_every_other_word",
          "tests.transforms.functions:drop_multiple_of_three")
TEXTS = synthetic_texts(300, seed=3, max_words=30)


@pytest.fixture(autouse=True)
def fresh_chains():
    """Every test probes its transforms afresh (a process keeps one chain per spec)."""
    chain_module._chains.clear()
    reset_counters()
    yield
    chain_module._chains.clear()


def _documents(count: int = 300):
    return [Document(f"k{n:04d}", text=TEXTS[n % len(TEXTS)], seed_base=5) for n in range(count)]


def _run_chain(function: str, count: int = 300) -> list:
    chain = TransformChain([TransformSpec(function)], seed=5, source="web", pretokenized=False)
    counts = TransformCounts.zeros(1)
    out = []
    for document in _documents(count):
        result = chain.apply(document, counts)
        out.append(None if result is None else result.text)
    return out


@pytest.mark.parametrize("name", NOT_DETERMINISTIC)
def test_each_hidden_dependence_is_refused_by_name(name):
    with pytest.raises(TransformError, match=rf"hostile_transforms:{name} \(transforms\[0\] of source 'web'\) "
                                             r"is not deterministic: .*document 'k\d+'"):
        _run_chain(HOSTILE + name)


def _plain_call(function, document, args, where):
    return function(document, **args)


def _no_check(*args):
    return None


def _seed_globals() -> None:
    """The global generators seeded where two calls of each rare draw agree on the probe documents,
    so that the runs without a guard below are the same on every run."""
    import random

    import numpy as np

    random.seed(20261209)
    np.random.seed(20261209)


@pytest.mark.parametrize("name", [n for n in NOT_DETERMINISTIC if n not in SEEN_BY_TWO_CALLS])
def test_the_old_two_call_check_alone_lets_each_through(name, monkeypatch):
    """The vacuity guard of the test above: without the new checks, each instance passes."""
    for guard, off in (("call_watched", _plain_call), ("recheck", _no_check), ("compare_in_child", _no_check)):
        monkeypatch.setattr(chain_module, guard, off)
    _seed_globals()
    _run_chain(HOSTILE + name)


# Mutation check per guard: with it disabled (and the other interpreter's check, which sees most
# instances too), the instances it catches go through.
GUARDS = {"call_watched": (_plain_call, ("rare_random", "rare_numpy_random")),
          "recheck": (_no_check, ("quota", "pair_counter", "remembering")),
          "compare_in_child": (_no_check, ("word_set", "salted_hash"))}


@pytest.mark.parametrize("guard", GUARDS)
def test_each_guard_is_what_catches_its_instances(guard, monkeypatch):
    off, instances = GUARDS[guard]

    def disable():
        monkeypatch.setattr(chain_module, guard, off)
        if guard == "call_watched":
            monkeypatch.setattr(probe, guard, off)  # the re-checks watch the generators too
        monkeypatch.setattr(chain_module, "compare_in_child", _no_check)

    disable()
    for name in instances:
        chain_module._chains.clear()
        reset_counters()
        _seed_globals()
        _run_chain(HOSTILE + name)
        if guard != "compare_in_child":
            monkeypatch.undo()
            chain_module._chains.clear()
            reset_counters()
            monkeypatch.setattr(chain_module, "compare_in_child", _no_check)
            _seed_globals()
            with pytest.raises(TransformError, match=f"{name} .*is not deterministic"):
                _run_chain(HOSTILE + name)
            disable()


@pytest.mark.parametrize("function", SEEDED)
def test_seeded_transforms_pass_every_check_and_repeat(function):
    first = _run_chain(function, 1100)  # past the 64 and 1,024 re-checks, through the other interpreter
    chain_module._chains.clear()
    assert _run_chain(function, 1100) == first


def test_the_global_generators_are_left_as_the_caller_had_them():
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(1)
    _run_chain(SEEDED[0], 100)
    assert random.random() == pytest.approx(0.13436424411240122)
    assert np.random.random() == pytest.approx(0.417022004702574)


@pytest.mark.parametrize("name", ["pair_counter", "rare_random", "word_set", "remembering"])
def test_the_loader_refuses_them_in_process(transform_corpus, name):  # noqa: F811
    config = loader_config(transform_corpus.text_path, [{"function": HOSTILE + name}])
    with pytest.raises(TransformError, match=f"hostile_transforms:{name} .*is not deterministic"):
        with ZephonLoader(config) as loader:
            for _ in range(200):
                next(loader)


@pytest.mark.parametrize("name", ["remembering", "rare_numpy_random", "salted_hash"])
def test_the_loader_refuses_them_with_two_workers(transform_corpus, name):  # noqa: F811
    config = loader_config(transform_corpus.text_path, [{"function": HOSTILE + name}], num_workers=2)
    with pytest.raises(TransformError, match=f"hostile_transforms:{name} .*is not deterministic"):
        with ZephonLoader(config) as loader:
            for _ in range(200):
                next(loader)


@pytest.mark.parametrize("name", ["quota", "word_set"])
def test_the_beam_job_refuses_them(tmp_path, name):
    records = [{"id": f"r{k:04d}", "text": t} for k, t in enumerate(TEXTS[:120])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ZephonError, match=f"hostile_transforms:{name} .*is not deterministic"):
        shard.run(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--id-field", "id",
                   "--num-lanes", "4", "--transform", HOSTILE + name,
                   "--runner=FnApiRunner", "--direct_running_mode=in_memory"])
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_probe_child_leaves_no_process(transform_corpus):  # noqa: F811
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    with pytest.raises(ZephonError):
        _run_chain(HOSTILE + "word_set")
    children = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in before]
    for pid in children:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                assert int(fh.read().rsplit(")", 1)[1].split()[1]) != os.getpid()
        except FileNotFoundError:
            pass
    assert probe.probe_pid() == os.getpid()


def test_zephon_diff_names_the_transform_that_made_two_runs_differ(transform_corpus, tmp_path, monkeypatch,  # noqa: F811
                                                                   capsys):
    """Two runs of one config differ because a transform slipped past the checks (here: the
    checks disabled while the runs are made); ``zephon diff A.log B.log --config`` names it."""
    from loader.cli import run_command
    from loader.commands.fingerprints import collect_fingerprints

    # pair_counter passes the two-call check only while its calls come in pairs: one reading
    # thread (no read-ahead threads interleaving the lanes' calls), counted from zero.
    config = loader_config(transform_corpus.text_path, [{"function": HOSTILE + "pair_counter"}], read_ahead=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    for guard, off in (("call_watched", _plain_call), ("recheck", _no_check), ("compare_in_child", _no_check)):
        monkeypatch.setattr(chain_module, guard, off)
    logs = []
    reset_counters()  # the count of calls made by earlier tests in this process would shift its pairs
    for run in ("a", "b"):  # run b continues the counter: its documents differ from run a's
        chain_module._chains.clear()
        results, _ = collect_fingerprints(config, world_size=1, end_step=3)
        logs.append(tmp_path / f"{run}.log")
        logs[-1].write_text("".join(r.line() + "\n" for r in results))
    monkeypatch.undo()
    capsys.readouterr()
    assert run_command("diff", [str(logs[0]), str(logs[1])], debug=False) == 1
    assert "pair_counter" not in capsys.readouterr().out  # a log alone does not know the transforms
    assert run_command("diff", [str(logs[0]), str(logs[1]), "--config", str(path), "--json"], debug=False) == 1
    report = json.loads(capsys.readouterr().out)
    (found,) = report["transforms"]
    assert found["function"] == HOSTILE + "pair_counter" and found["position"] == 0 and found["source"] == "synthetic"
    assert len(found["spec_sha256"]) == 64 and "is not deterministic" in found["message"]
    assert report["causes"][0].startswith(f"transform {HOSTILE}pair_counter (transforms[0] of source 'synthetic'")


def test_zephon_diff_names_no_transform_when_they_are_functions(transform_corpus, tmp_path, capsys):  # noqa: F811
    from loader.cli import run_command

    config = loader_config(transform_corpus.text_path, [{"function": SEEDED[0], "args": {"p": 0.3}}])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("0 " + "0" * 64 + "\n")
    b.write_text("0 " + "1" * 64 + "\n")
    assert run_command("diff", [str(a), str(b), "--config", str(path), "--json"], debug=False) == 1
    assert json.loads(capsys.readouterr().out)["transforms"] == []


def test_the_reverse_pass_names_state_the_probe_never_revisits():
    from loader.commands.transform_culprit import _reverse_pass

    position, key, message = _reverse_pass([TransformSpec(HOSTILE + "remembering").resolved(False)], _documents(64))
    assert position == 0 and key == "k0000" and "reverse order" in message
    assert _reverse_pass([TransformSpec(SEEDED[0]).resolved(False)], _documents(64)) is None
