"""``zephon diff``: planted first differences are found and named; identical runs are not.

Two small pre-tokenized sources (``web`` and ``code``, 8 lanes) mixed 1:1; each test writes
two loader configs (JSON) or two fingerprint logs and runs the command as a user would,
through ``loader.cli.main``. A planted difference is a config or dataset change whose first
effect is known without the tool: a schedule entry at step K (steps before K are identical
by the mixing contract), a lane file rewritten with one document changed (only that
document's lane can differ first), a dataset re-sharded with another seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer

from loader.samples import default_tokenizer_path
from loader import cli
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints
from loader.order.hashing import file_bucket, lane_of_key, order_key_of
from loader.io.manifest import lane_file_path
from tests.dataset_factory import synthetic_texts, write_dataset

LANES = 8
DATA_SEED = 3
FILES_PER_LANE = 2
STEPS = "0:8"
SCHEDULE_STEP = 5  # the planted schedule change


@dataclass(frozen=True)
class Data:
    web: str
    code: str
    web_edited: str  # web with document ``changed_doc``'s text changed, manifest regenerated
    web_reseeded: str  # web re-sharded with another seed
    changed_doc: int
    tokenizer: str


def _write(path, texts, tokenizer, seed=DATA_SEED, source="web"):
    return write_dataset(str(path), texts, num_lanes=LANES, seed=seed, source_name=source, tokenizer=tokenizer,
                         files_per_lane=FILES_PER_LANE, row_group_rows=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Data:
    base = tmp_path_factory.mktemp("diff")
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    web = synthetic_texts(120, seed=21, max_words=30)
    code = synthetic_texts(120, seed=22, max_words=30)
    # The first document of its lane (smallest order key), so the first epoch reads it early.
    changed_doc = min(range(len(web)), key=lambda k: order_key_of(DATA_SEED, f"doc-{k:07d}"))
    edited = list(web)
    edited[changed_doc] = "edited: " + edited[changed_doc]  # its first tokens change
    _write(base / "web", web, tokenizer)
    _write(base / "code", code, tokenizer, source="code")
    _write(base / "web_edited", edited, tokenizer)
    _write(base / "web_reseeded", web, tokenizer, seed=DATA_SEED + 1)
    return Data(str(base / "web"), str(base / "code"), str(base / "web_edited"), str(base / "web_reseeded"),
                changed_doc, default_tokenizer_path())


def _config(data: Data, web: str | None = None, **overrides) -> dict:
    fields = dict(datasets=[{"path": web or data.web, "name": "web", "weight": 1.0},
                            {"path": data.code, "name": "code", "weight": 1.0}],
                  seq_len=32, global_batch_size=8, micro_batch_size=4, seed=11, tokenizer=data.tokenizer,
                  num_workers=0, prefetch=2)
    fields.update(overrides)
    return fields


def _write_config(tmp_path, name: str, fields: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(fields))
    return str(path)


def _diff(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["diff", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _lines(fields: dict, steps: int = 8) -> list[str]:
    results, _ = collect_fingerprints(LoaderConfig(**fields), world_size=1, end_step=steps)
    return [r.line() for r in results]


def test_schedule_change_from_step_k_is_the_first_difference(tmp_path, data, capsys):
    base = _config(data)
    scheduled = _config(data, schedule=[{"step": SCHEDULE_STEP, "weights": {"web": 7, "code": 1}}])
    a, b = _write_config(tmp_path, "a", base), _write_config(tmp_path, "b", scheduled)
    code, report = _diff(capsys, a, b, "--steps", STEPS)
    assert code == 1 and not report["identical"]
    assert report["first_differing_step"] == SCHEDULE_STEP
    assert report["schedule"]["from_step"] == SCHEDULE_STEP
    assert report["schedule"]["a"] == {"web": "1/2", "code": "1/2"}
    assert report["schedule"]["b"] == {"web": "7/8", "code": "1/8"}
    assert [d["field"] for d in report["config_fields"]] == ["schedule"]
    assert all(entry["identical"] for entry in report["datasets"])
    at = report["at_first_difference"]
    assert at["a"]["source_counts"] == {"web": 4, "code": 4} and at["b"]["source_counts"] == {"web": 7, "code": 1}
    sequences = report["differing_sequences"]
    assert sequences and all(s["global_index"] // 8 == SCHEDULE_STEP for s in sequences)
    assert any(s["a"]["source"] != s["b"]["source"] for s in sequences)
    assert any("schedule differs from step 5 (the first differing step)" in c for c in report["causes"])

    # The same comparison from the two runs' fingerprint logs: the step and the counts.
    log_a, log_b = tmp_path / "a.txt", tmp_path / "b.txt"
    log_a.write_text("\n".join(_lines(base)) + "\n")
    log_b.write_text("\n".join(_lines(scheduled)) + "\n")
    code, from_logs = _diff(capsys, str(log_a), str(log_b))
    assert code == 1 and from_logs["first_differing_step"] == SCHEDULE_STEP
    assert from_logs["at_first_difference"] == {side: {"sha256": at[side]["sha256"],
                                                       "source_counts": at[side]["source_counts"]}
                                                for side in ("a", "b")}
    assert "config_fields" not in from_logs and "differing_sequences" not in from_logs


def test_changed_seed_is_a_stream_field_from_step_0(tmp_path, data, capsys):
    a = _write_config(tmp_path, "a", _config(data))
    b = _write_config(tmp_path, "b", _config(data, seed=12))
    code, report = _diff(capsys, a, b, "--steps", "0:3")
    assert code == 1 and report["first_differing_step"] == 0
    assert report["config_fields"] == [{"field": "seed", "kind": "stream", "a": 11, "b": 12}]
    assert report["causes"][0].startswith("stream field(s) seed differ")


def test_one_changed_lane_file_is_named_and_only_its_lane_differs_first(tmp_path, data, capsys):
    a = _write_config(tmp_path, "a", _config(data))
    b = _write_config(tmp_path, "b", _config(data, web=data.web_edited))
    code, report = _diff(capsys, a, b, "--steps", "0:6")
    key = f"doc-{data.changed_doc:07d}"
    lane = lane_of_key(DATA_SEED, key, LANES)
    changed_file = lane_file_path(lane, file_bucket(order_key_of(DATA_SEED, key), FILES_PER_LANE))
    assert code == 1
    web, code_source = report["datasets"]
    assert code_source["identical"] and not web["identical"]
    assert web["files_changed"] == [changed_file]
    assert web["files_only_in_a"] == web["files_only_in_b"] == []
    assert set(web["fields"]) == {"dataset_fingerprint"}
    assert [d["field"] for d in report["config_fields"]] == ["datasets[0].path"]
    first = report["first_differing_step"]
    assert first is not None, "the edited document was never read in 6 steps: the test proves nothing"
    sequences = report["differing_sequences"]
    assert sequences and {s["lane"] for s in sequences} == {lane}
    assert all(s["a"]["source"] == s["b"]["source"] == "web" for s in sequences)


def test_dataset_resharded_with_another_seed_is_named(tmp_path, data, capsys):
    a = _write_config(tmp_path, "a", _config(data))
    b = _write_config(tmp_path, "b", _config(data, web=data.web_reseeded))
    code, report = _diff(capsys, a, b, "--steps", "0:2")
    assert code == 1 and report["first_differing_step"] == 0
    fields = report["datasets"][0]["fields"]
    assert fields["seed"] == {"a": DATA_SEED, "b": DATA_SEED + 1} and "dataset_fingerprint" in fields
    assert report["datasets"][0]["files_changed"]  # documents moved between lanes


def test_identical_runs_report_no_difference(tmp_path, data, capsys):
    # Only runtime fields differ: the batches must not.
    a = _write_config(tmp_path, "a", _config(data))
    b = _write_config(tmp_path, "b", _config(data, micro_batch_size=2, prefetch=1))
    code, report = _diff(capsys, a, b, "--steps", "0:4")
    assert code == 0 and report["identical"] and report["first_differing_step"] is None
    assert {d["field"]: d["kind"] for d in report["config_fields"]} == {"micro_batch_size": "runtime",
                                                                        "prefetch": "runtime"}
    assert report["causes"] == []

    log = tmp_path / "run.txt"
    log.write_text("\n".join(_lines(_config(data), 4)) + "\n")
    copy = tmp_path / "copy.txt"
    copy.write_text("# the same run, logged again\n\n" + log.read_text())
    assert cli.main(["diff", str(log), str(copy)]) == 0
    text = capsys.readouterr().out
    assert "identical on all 4 common steps (0..3)" in text and text.rstrip().endswith("result: identical")
    # a log against the config that wrote it
    assert cli.main(["diff", str(log), a, "--steps", "0:4"]) == 0
    capsys.readouterr()


def test_a_shorter_log_that_agrees_still_differs_in_coverage(tmp_path, capsys):
    lines = [f"{step} {'ab' * 32}" for step in range(5)]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(lines[:3]) + "\n")
    code, report = _diff(capsys, str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert code == 1 and report["first_differing_step"] is None and report["steps_only_in_a"] == [3, 4]


SHA = "0f" * 32


def test_lines_with_and_without_supervised_counts_parse_and_compare(tmp_path, capsys):
    from loader.commands.diff import parse_log_line

    old, new = f"3 {SHA} web=4 code=4", f"3 {SHA} web=4 code=4 supervised: web=0 code=1234"
    assert parse_log_line(old, "a:1").line() == old and parse_log_line(old, "a:1").supervised_counts == {}
    parsed = parse_log_line(new, "b:1")
    assert parsed.line() == new and parsed.source_counts == {"web": 4, "code": 4}
    assert parsed.supervised_counts == {"web": 0, "code": 1234}
    single = f"0 {SHA} supervised: chat=77"  # one source: no sequence counts, still the suffix
    assert parse_log_line(single, "c:1").line() == single and parse_log_line(single, "c:1").source_counts == {}
    # Only the supervised counts differ: a different step, the counts in the report.
    (tmp_path / "a.txt").write_text(new + "\n")
    (tmp_path / "b.txt").write_text(new.replace("1234", "1233") + "\n")
    code, report = _diff(capsys, str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert code == 1 and report["first_differing_step"] == 3
    assert report["at_first_difference"]["b"]["supervised_counts"] == {"web": 0, "code": 1233}
    assert cli.main(["diff", str(tmp_path / "a.txt"), str(tmp_path / "a.txt")]) == 0
    capsys.readouterr()


MALFORMED = [
    (f"0 {SHA}\n1 nothex\n", 2, "the hash must be 64 lowercase hex digits"),
    (f"0 {SHA}\nstep1 {SHA}\n", 2, "the step must be a non-negative integer"),
    (f"0 {SHA} web=4 code=four\n", 1, "per-source counts are name=count"),
    (f"0 {SHA}\n{SHA}\n", 2, "expected `STEP SHA256"),
    (f"0 {SHA} web=4 supervised:\n", 1, "'supervised:' must be followed by name=count"),
    (f"0 {SHA} supervised: web=x\n", 1, "supervised-token counts are name=count"),
    (f"0 {SHA}\n\n0 {SHA}\n", 3, "step 0 is already on line 1"),
]


@pytest.mark.parametrize("content,line,message", MALFORMED)
def test_a_malformed_log_is_one_line_naming_the_file_and_line(tmp_path, capsys, content, line, message):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(f"0 {SHA}\n1 {SHA}\n")
    bad.write_text(content)
    assert cli.main(["diff", str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"zephon diff: error: {bad}:{line}: ") and message in err


def test_unusable_inputs_exit_2_not_1(tmp_path, data, capsys):
    (tmp_path / "empty.txt").write_text("# nothing\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe0 abc\n")
    (tmp_path / "log.txt").write_text(f"0 {SHA}\n1 {SHA}\n")
    config = _write_config(tmp_path, "a", _config(data))
    missing_dataset = _write_config(tmp_path, "m", _config(data, web=str(tmp_path / "no_such_dataset")))
    cases = [
        ([str(tmp_path / "empty.txt"), config], "holds no fingerprint lines"),
        ([str(tmp_path / "binary.txt"), config], "UTF-8"),
        ([config, config], "pass --steps START:END"),
        ([str(tmp_path / "missing.txt"), config, "--steps", "0:1"], "missing.txt"),
        ([config, missing_dataset, "--steps", "0:1"], "no_such_dataset"),
        ([str(tmp_path / "log.txt"), str(tmp_path / "log.txt"), "--steps", "5:9"], "no step of the log is in --steps 5:9"),
    ]
    for argv, message in cases:
        assert cli.main(["diff", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
