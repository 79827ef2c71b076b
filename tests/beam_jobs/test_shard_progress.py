"""The sharding job's progress and its end-of-job summary (:mod:`beam_jobs.progress`)."""

from __future__ import annotations

import logging
import statistics

import pytest
from tokenizers import Tokenizer

from beam_jobs import progress, shard
from loader.io.manifest import read_manifest
from tests.beam_jobs.test_shard import IN_MEMORY, TOKENIZER_PATH, make_records, write_jsonl


def test_summary_of_a_manifest(tmp_path):
    from tests.dataset_factory import synthetic_texts, write_dataset

    texts = synthetic_texts(90, seed=2)
    manifest = write_dataset(str(tmp_path / "ds"), texts, num_lanes=5, tokenizer=Tokenizer.from_file(TOKENIZER_PATH),
                             files_per_lane=2)
    manifest = manifest.__class__(**{**manifest.__dict__, "rejected": {"empty_text": 3, "malformed_json": 0}})
    summary = progress.ShardSummary.of(manifest, 2.0, {"files_read": 4, "duplicate_keys": 2}, input_bytes=3 * 1024**2)
    rows = [sum(e.rows for e in manifest.files if e.lane == lane) for lane in range(5)]
    tokens = [sum(e.tokens for e in manifest.files if e.lane == lane) for lane in range(5)]
    assert (summary.rows_per_lane.minimum, summary.rows_per_lane.maximum) == (min(rows), max(rows))
    assert summary.rows_per_lane.median == statistics.median(rows)
    assert summary.tokens_per_lane.max_over_mean == pytest.approx(max(tokens) / (sum(tokens) / 5))
    assert summary.rejected == {"empty_text": 3} and summary.input_files == 4
    text = summary.text().splitlines()
    assert text[0] == f"sharded 90 documents in 2.0 s (45 documents/s) into 5 lanes, {len(manifest.files)} files"
    assert text[1].startswith("  input: 4 files, 3.0 MiB; written: ") and f"tokens: {manifest.total_tokens:,}" in text[1]
    assert text[2] == "  rejected: 3 (empty_text=3)"
    assert text[3] == "  duplicate keys: 2 rows (all kept)"
    assert text[4] == (f"  rows per lane: min {min(rows):,} / median {statistics.median(rows):,.0f} / max {max(rows):,} "
                       f"(max / mean {max(rows) / (sum(rows) / 5):.2f})")
    assert text[5].startswith(f"  tokens per lane: min {min(tokens):,} / ")


@pytest.mark.beam
def test_job_reports_progress_and_its_summary(tmp_path, monkeypatch, caplog, capsys):
    """A real run: progress lines from the stages (interval 0: every update), then the summary,
    whose numbers are the manifest's and the job's Beam counters."""
    records = make_records(200) + [{"id": "empty", "text": ""}, {"id": "nope"}]
    for k in range(3):
        write_jsonl(tmp_path / "in" / f"part-{k}.jsonl", records[k::3])
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(progress, "_stages", {})
    summaries = []
    options, pipeline_args = shard.parse_args(
        ["--input", str(tmp_path / "in" / "*.jsonl"), "--output", str(tmp_path / "out"), "--id-field", "id",
         "--num-lanes", "4", "--tokenizer", TOKENIZER_PATH, "--max-reject-fraction", "0.5", *IN_MEMORY])
    with caplog.at_level(logging.INFO, logger="beam_jobs.progress"):
        manifest = shard.run_shard(options, pipeline_args, on_summary=summaries.append)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
    assert "progress: ReadFiles 3 of 3 input files" in " ".join(lines)  # the in-memory runner sees the totals
    assert any(line.startswith("progress: WriteLaneFiles ") and " of at most 4 lane files" in line for line in lines)
    assert lines and all(line.endswith(" left)") for line in lines)
    [summary] = summaries
    assert manifest == read_manifest(str(tmp_path / "out"))
    assert summary.documents == manifest.documents == 200
    assert summary.rejected == {k: v for k, v in manifest.rejected.items() if v} == {"empty_text": 1,
                                                                                    "missing_text_field": 1}
    c = summary.counters
    assert (c["files_read"], c["documents_read"], c["records_rejected"]) == (3, 200, 2)
    assert (c["lane_files_written"], c["rows_written"]) == (len(manifest.files), 200)
    assert c["bytes_written"] == summary.bytes_written == sum(e.bytes for e in manifest.files)
    assert c["tokens_written"] == summary.tokens == manifest.total_tokens
    assert summary.input_bytes == sum((tmp_path / "in" / f"part-{k}.jsonl").stat().st_size for k in range(3))
    assert summary.seconds > 0 and summary.tokens_per_lane.maximum > 0
    # the command prints the summary, then its one-line result
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="beam_jobs.progress"):
        shard.command(["--input", str(tmp_path / "in" / "*.jsonl"), "--output", str(tmp_path / "out2"),
                       "--id-field", "id", "--num-lanes", "4", "--max-reject-fraction", "0.5", *IN_MEMORY])
    out = capsys.readouterr().out.splitlines()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ReadFiles")]
    assert lines[-1].startswith("progress: ReadFiles 3 of 3 input files, 200 documents, 2 rejected (100%, about ")
    # each job counts anew
    assert out[0].startswith("sharded 200 documents in ") and out[-1].startswith("wrote 200 documents")
    assert any(line.startswith("  rows per lane: min ") for line in out)
    assert not any(line.startswith("  tokens per lane") for line in out)  # text lanes: no token counts


def test_progress_line_shows_the_total_share_and_time_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    stage = progress.StageProgress("ReadFiles", interval_s=3600)
    stage.expect(4)
    now[0] = 130.0
    stage.add(files=1, documents=10)  # 30 s for the first of 4 files
    assert stage.line() == "progress: ReadFiles 1 of 4 input files, 10 documents (25%, about 1 min 30 s left)"
    without_total = progress.StageProgress("WriteLaneFiles", interval_s=3600)
    without_total.counts = {"files": 2, "rows": 5, "bytes": 2048}
    assert without_total.line() == "progress: WriteLaneFiles 2 lane files, 5 rows, 2.0 KiB written"


def test_totals_are_taken_in_the_launching_process_only(monkeypatch):
    monkeypatch.setattr(progress, "_stages", {})
    progress.reset_stages()
    progress.expect("ReadFiles", 7)
    assert progress.stage("ReadFiles").total_files == 7
    monkeypatch.setattr(progress, "_launcher_pid", -1)  # a worker process of another runner
    progress.expect("WriteLaneFiles", 9)
    assert progress.stage("WriteLaneFiles").total_files is None


def test_stage_timer_table():
    timer = progress.StageTimer()
    assert timer.stop() is None  # nothing started
    timer.start("shard")
    timer.start("stream")  # starting a stage ends the previous one
    assert timer.stop() >= 0 and [name for name, _ in timer.stages] == ["shard", "stream"]
    rows = timer.table().splitlines()
    assert [r.split()[0] for r in rows] == ["shard", "stream", "total"]
    assert float(rows[-1].split()[1]) == pytest.approx(sum(s for _, s in timer.stages), abs=0.1)
