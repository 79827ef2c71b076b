"""Bad input to every ``zephon`` subcommand: one ``zephon <command>: error: ...`` line, no traceback.

The convention (docs/guides/reliability.md, "Command-line errors"; :mod:`loader.cli`): a ZephonError or an
OSError about a file the user named prints exactly one line to stderr and exits non-zero
(2 for usage errors: options, config, topology, state and tokenizer files; 1 for data and
failed jobs, and for file errors); argparse's own errors print its usage synopsis above its
``<prog>: error:`` line; ``--debug`` / ``ZEPHON_DEBUG=1`` adds the traceback; anything
else is a bug and keeps its traceback.

A few cases run the real command in a subprocess (each Python start costs about a second,
more when it imports torch or Beam); the rest call :func:`loader.cli.main` in-process,
which is the same code path after ``sys.argv``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from loader.samples import default_tokenizer_path
from loader import cli
from loader.checkpoint.state import StateError
from tests.dataset_factory import synthetic_texts, write_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_LANES = 8


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=90,
                          env={**os.environ, **(env or {})})


def assert_one_error_line(stderr: str, prog: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli") / "web"
    write_dataset(str(path), synthetic_texts(64, seed=3, max_words=20), num_lanes=NUM_LANES, row_group_rows=4)
    return str(path)


def write_config(directory, dataset: str, **overrides) -> str:
    fields = dict(datasets=[{"path": dataset}], seq_len=32, global_batch_size=8, micro_batch_size=2, seed=5,
                  tokenizer=default_tokenizer_path())
    fields.update(overrides)
    path = os.path.join(str(directory), "loader.json")
    with open(path, "w") as fh:
        json.dump(fields, fh)
    return path


# -- subprocesses: the real entry points ------------------------------------------------------
def test_fingerprints_config_of_wrong_types(tmp_path):
    config = write_config(tmp_path, "data/web", add_eos="false", worker_timeout_s=float("inf"))
    result = run("-m", "loader.cli", "fingerprints", config, "--steps", "0:2")
    line = assert_one_error_line(result.stderr, "zephon fingerprints")
    assert result.returncode == 2 and config in line and "add_eos must be true or false" in line
    assert "worker_timeout_s must be a finite number > 0 (got inf)" in line


def test_fingerprints_pickle_state_is_never_unpickled(tmp_path):
    config = write_config(tmp_path, "data/web")
    state = tmp_path / "state.pkl"
    state.write_bytes(pickle.dumps({"format": "zephon.loader_state"}, protocol=4))
    result = run("-m", "loader.cli", "fingerprints", config, "--steps", "0:2", "--load-state", str(state))
    line = assert_one_error_line(result.stderr, "zephon fingerprints")
    assert result.returncode == 2 and f"--load-state {state}" in line and "never loaded" in line


def test_inspect_without_a_dataset_and_with_debug(tmp_path):
    missing = str(tmp_path / "nowhere")
    result = run("-m", "loader.cli", "inspect", missing)
    line = assert_one_error_line(result.stderr, "zephon inspect")
    assert result.returncode == 1 and missing in line
    debug = run("-m", "loader.cli", "--debug", "inspect", missing)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert "ManifestError" in debug.stderr and debug.stderr.strip().splitlines()[-1] == line


def test_make_sample_into_a_file(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    result = run("-m", "loader.cli", "make-sample", str(target), "--docs", "10")
    line = assert_one_error_line(result.stderr, "zephon make-sample")
    assert result.returncode == 1 and str(target) in line


def test_quickstart_option_out_of_range_is_an_argparse_error():
    result = run("-m", "loader.cli", "quickstart", "--steps", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "zephon quickstart: error: --steps must be >= 2 (got 1)"


def test_train_tokenizer_check_against_a_missing_file_fails_before_training(tmp_path):
    missing = str(tmp_path / "tokenizer.json")
    result = run("-m", "beam_jobs.train_tokenizer", "--check", "--out", missing)
    line = assert_one_error_line(result.stderr, "python -m beam_jobs.train_tokenizer")
    assert result.returncode == 1 and missing in line and "No such file or directory" in line


# -- in process: the same dispatcher ---------------------------------------------------------
def test_fingerprints_world_size_that_does_not_divide_the_lanes(tmp_path, capsys, dataset):
    config = write_config(tmp_path, dataset)
    assert cli.main(["fingerprints", config, "--steps", "0:2", "--world-size", "3"]) == 2
    line = assert_one_error_line(capsys.readouterr().err, "zephon fingerprints")
    assert "world_size=3 does not divide the dataset's lane count L=8" in line and "divisors: [1, 2, 4, 8]" in line


@pytest.mark.parametrize("argv, code, expected", [
    (["--input", "{tmp}/none/*.jsonl", "--output", "{tmp}/out"], 2, "{tmp}/none/*.jsonl matches no files"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/out", "--num-lanes", "1", "--tokenizer", "{tmp}"], 2, "tokenizer {tmp} is a directory"),
])
def test_shard_bad_inputs(tmp_path, capsys, argv, code, expected):
    """``python -m beam_jobs.shard`` is ``shard.main``, which reports through the same dispatcher."""
    from beam_jobs import shard

    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    assert shard.main([a.format(tmp=tmp_path) for a in argv]) == code
    line = assert_one_error_line(capsys.readouterr().err, "zephon shard")
    assert expected.format(tmp=tmp_path) in line


@pytest.mark.parametrize("content, code, expected", [
    (b"\x80\x04\x95 not json", 2, "must be JSON text (not UTF-8"),
    (b"{not json", 2, "must be JSON text"),
    (b'{"format": "something.else"}', 2, "not a Zephon loader state"),
    (b"[1, 2, 3]", 2, "must be a JSON object"),
    (None, 1, "No such file or directory"),
    ("dir", 1, "Is a directory"),
])
def test_fingerprints_state_files(tmp_path, capsys, content, code, expected):
    config = write_config(tmp_path, "data/web")
    state = tmp_path / "state.json"
    if content == "dir":
        state.mkdir()
    elif content is not None:
        state.write_bytes(content)
    assert cli.main(["fingerprints", config, "--steps", "0:2", "--load-state", str(state)]) == code
    line = assert_one_error_line(capsys.readouterr().err, "zephon fingerprints")
    assert str(state) in line and expected in line


def test_refused_resume_lists_every_difference_on_one_line(tmp_path, capsys, dataset):
    config = write_config(tmp_path, dataset)
    state = tmp_path / "state.json"
    assert cli.main(["fingerprints", config, "--steps", "0:1", "--save-state", "1", str(state)]) == 0
    (tmp_path / "other").mkdir()
    other = write_config(tmp_path / "other", dataset, seed=6, seq_len=16)
    assert cli.main(["fingerprints", other, "--steps", "1:2", "--load-state", str(state)]) == 2
    line = assert_one_error_line(capsys.readouterr().err, "zephon fingerprints")
    assert "cannot resume" in line and "seed: checkpoint 5, now 6" in line and "seq_len: checkpoint 32, now 16" in line


def test_save_state_step_outside_the_steps_is_a_usage_error(tmp_path, capsys):
    config = write_config(tmp_path, "data/web")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fingerprints", config, "--steps", "0:2", "--save-state", "nine", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("zephon fingerprints: error: --save-state STEP")


def test_unknown_command(capsys):
    assert cli.main(["fingerprint"]) == 2
    assert_one_error_line(capsys.readouterr().err, "zephon")


def test_multi_line_messages_are_folded_and_debug_shows_the_traceback(monkeypatch, capsys):
    import beam_jobs.inspect_dataset as inspect_dataset

    def refuse(argv):
        raise StateError("cannot resume. Differences:\n  - seed: 1 vs 2\n  - seq_len: 8 vs 16")

    monkeypatch.setattr(inspect_dataset, "command", refuse)
    assert cli.main(["inspect", "x"]) == 2
    line = assert_one_error_line(capsys.readouterr().err, "zephon inspect")
    assert line == "zephon inspect: error: cannot resume. Differences: - seed: 1 vs 2 - seq_len: 8 vs 16"
    monkeypatch.setenv("ZEPHON_DEBUG", "1")
    assert cli.main(["inspect", "x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1] == line


def test_a_bug_keeps_its_traceback(monkeypatch):
    import beam_jobs.inspect_dataset as inspect_dataset

    def bug(argv):
        raise KeyError("lanes")  # not a ZephonError: must not be dressed up as a user error

    monkeypatch.setattr(inspect_dataset, "command", bug)
    with pytest.raises(KeyError):
        cli.main(["inspect", "x"])
