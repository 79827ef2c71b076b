"""``zephon inspect`` on manifests written directly (no Beam needed)."""

from __future__ import annotations

import json

import pytest

from beam_jobs import inspect_dataset
from loader import cli
from loader.io.manifest import MANIFEST_NAME, FileEntry, Manifest
from loader.kinds.chat import REJECT_REASONS


def _entry(lane: int, part: int, rows: int, tokens=None) -> FileEntry:
    return FileEntry(path=f"lane={lane:05d}/part-{part:05d}.parquet", lane=lane, part=part, rows=rows,
                     bytes=1000 * rows, sha256=f"{lane:02d}{part:02d}" * 16, tokens=tokens, row_groups=1)


def _write(tmp_path, manifest: Manifest) -> str:
    (tmp_path / MANIFEST_NAME).write_text(manifest.with_fingerprint().to_json())
    return str(tmp_path)


@pytest.fixture
def tokenized_dataset(tmp_path):
    files = [_entry(0, 0, 10, 100), _entry(0, 1, 5, 50), _entry(1, 0, 20, 400), _entry(3, 0, 30, 300)]
    rejected = {reason: 0 for reason in REJECT_REASONS} | {"empty_text": 3, "malformed_json": 2}
    manifest = Manifest(seed=7, num_lanes=4, source_name="web", files=files, documents=65, rejected=rejected,
                        schema=[{"name": "key", "type": "string"}, {"name": "input_ids", "type": "list<int32>"}],
                        tokenizer={"fingerprint": "ab" * 32, "vocab_size": 8000}, files_per_lane=2)
    return _write(tmp_path, manifest), manifest.with_fingerprint()


def test_json_summary_has_counts_balance_rejects_and_fingerprint(tokenized_dataset, capsys):
    path, manifest = tokenized_dataset
    assert inspect_dataset.main([path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dataset_fingerprint"] == manifest.dataset_fingerprint
    assert (summary["source_name"], summary["num_lanes"], summary["files"]) == ("web", 4, 4)
    assert (summary["documents"], summary["tokens"], summary["bytes"]) == (65, 850, 65_000)
    # lanes hold 15, 20, 0, 30 documents; the empty lane counts
    assert summary["lane_documents"] == {"min": 0, "median": 17.5, "max": 30, "mean": 16.25, "max_over_mean": 1.8462}
    assert summary["lane_tokens"]["max"] == 400 and summary["empty_lanes"] == 1
    assert summary["rejected"] == {"empty_text": 3, "malformed_json": 2} and summary["rejected_total"] == 5


def test_text_summary_is_readable(tokenized_dataset, capsys):
    path, manifest = tokenized_dataset
    assert cli.main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert manifest.dataset_fingerprint in text
    assert "documents      65" in text and "tokens         850 (pre-tokenized" in text
    assert "min 0 / median 17.5 / max 30 (max/mean 1.846)" in text
    assert "rejected       5 (7.14% of records): empty_text 3, malformed_json 2" in text
    assert "1 lane(s) hold no documents" in text


def test_untokenized_dataset_has_no_token_figures(tmp_path, capsys):
    manifest = Manifest(seed=0, num_lanes=2, source_name="s", schema=[], files=[_entry(0, 0, 3), _entry(1, 0, 4)],
                        documents=7)
    path = _write(tmp_path, manifest)
    assert inspect_dataset.main([path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] is None and summary["lane_tokens"] is None and summary["rejected_total"] == 0
    assert inspect_dataset.main([path]) == 0
    assert "not pre-tokenized" in capsys.readouterr().out


def test_missing_or_tampered_manifest_is_an_error(tmp_path, tokenized_dataset, capsys):
    assert inspect_dataset.main([str(tmp_path / "nowhere")]) == 1
    assert "is not a Zephon dataset" in capsys.readouterr().err
    path, _ = tokenized_dataset
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    data["documents"] = 1
    data["files"][0]["rows"] = 999
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    assert inspect_dataset.main([path]) == 1
    assert "does not match its content" in capsys.readouterr().err
