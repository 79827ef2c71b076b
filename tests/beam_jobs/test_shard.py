"""End-to-end runs of the Beam sharding job on small inputs (real pipelines, marked ``beam``).

Runners: ``DirectRunner`` tries Prism first and falls back to the ``FnApiRunner`` here
(FIELD-NOTES), so the runner-mode comparison names ``FnApiRunner`` with
``--direct_running_mode`` to stay the same on machines that have Prism, and adds one run
through plain ``DirectRunner`` as users would call it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

from beam_jobs import inspect_dataset, shard
from loader.order.hashing import file_bucket, lane_of_key, order_key_of
from loader.io.manifest import DOCUMENT_REJECT_REASONS, MANIFEST_NAME, read_manifest
from loader.stages.tokenizer import describe

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_PATH = str(REPO_ROOT / "beam_jobs" / "assets" / "tokenizer.json")
IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
MULTI_PROCESSING = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
DIRECT_RUNNER = ["--runner=DirectRunner"]
WORDS = ["lane", "shard", "token", "über", "数据", "学习", "🚀", "naïve", "the", "of", "model", "x" * 30, "\n", "\t"]


def make_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"id": f"doc-{n}", "text": f"doc {n}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))),
         "lang": rng.choice(["en", "de", "zh"]), "meta": {"n": n}}
        for n in range(count)
    ]


def write_jsonl(path: Path, records, compression: str = "none") -> str:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if compression == "gzip":
        data = gzip.compress(data, mtime=0)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def write_parquet(path: Path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=37)
    return str(path)


def lane_file_bytes(dataset: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dataset)): p.read_bytes() for p in sorted(dataset.glob("lane=*/*.parquet"))}


def job_args(inputs, output, *extra) -> list[str]:
    return ["--input", *inputs, "--output", str(output), "--id-field", "id", "--keep-fields", "lang,meta",
            "--num-lanes", "4", "--seed", "5", "--target-file-mb", "0.02", "--tokenizer", TOKENIZER_PATH,
            "--source-name", "unit", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 300 records sharded four ways: runner modes, and a re-split, re-ordered input."""
    base = tmp_path_factory.mktemp("shard_runs")
    records = make_records(300)
    whole = write_jsonl(base / "in_whole" / "all.jsonl", records)
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    split = [  # different number of files, formats and directories; listed in reverse order
        write_jsonl(base / "in_split" / "a" / "one.jsonl.gz", shuffled[:90], "gzip"),
        write_parquet(base / "in_split" / "b" / "two.parquet", shuffled[90:200]),
        write_jsonl(base / "in_split" / "c" / "three.jsonl.zst", shuffled[200:], "zstd"),
    ][::-1]
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        # multi_processing workers are fresh interpreters: they must import beam_jobs too.
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        for name, inputs, runner in [("in_memory", [whole], IN_MEMORY),
                                     ("multi_processing", [whole], MULTI_PROCESSING),
                                     ("direct", [whole], DIRECT_RUNNER),
                                     ("split", split, IN_MEMORY)]:
            manifest = shard.run(job_args(inputs, base / name, *runner))
            results[name] = (base / name, manifest)
    return records, results


@pytest.mark.beam
def test_runner_modes_give_byte_identical_lanes_and_fingerprint(runs):
    _, results = runs
    reference_dir, reference = results["in_memory"]
    reference_files = lane_file_bytes(reference_dir)
    assert reference.files_per_lane == 2 and len(reference_files) == 8
    for name in ("multi_processing", "direct"):
        dataset, manifest = results[name]
        assert lane_file_bytes(dataset) == reference_files, name
        assert manifest.dataset_fingerprint == reference.dataset_fingerprint, name
        assert (dataset / MANIFEST_NAME).read_bytes() == (reference_dir / MANIFEST_NAME).read_bytes()


@pytest.mark.beam
def test_resplit_and_reordered_input_gives_identical_dataset(runs):
    _, results = runs
    (whole_dir, whole), (split_dir, split) = results["in_memory"], results["split"]
    assert lane_file_bytes(split_dir) == lane_file_bytes(whole_dir)
    assert split.dataset_fingerprint == whole.dataset_fingerprint
    assert (split_dir / MANIFEST_NAME).read_bytes() == (whole_dir / MANIFEST_NAME).read_bytes()


@pytest.mark.beam
def test_lane_files_follow_the_hash_layout_and_manifest(runs):
    records, results = runs
    dataset, manifest = results["in_memory"]
    seen = {}
    assert sum(manifest.rejected.values()) == 0 and manifest.documents == len(records)
    for lane_id in range(manifest.num_lanes):
        lane_order_keys = []
        for entry in manifest.lane_files(lane_id):
            data = (dataset / entry.path).read_bytes()
            assert (entry.bytes, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())
            parquet = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
            assert parquet.metadata.num_row_groups == entry.row_groups
            table = parquet.read()
            assert table.num_rows == entry.rows and sum(table.column("num_tokens").to_pylist()) == entry.tokens
            for row in table.to_pylist():
                assert lane_of_key(5, row["key"], 4) == lane_id
                assert row["order_key"] == order_key_of(5, row["key"])
                assert file_bucket(row["order_key"], manifest.files_per_lane) == entry.part
                seen[row["key"]] = row
                lane_order_keys.append(row["order_key"])
        assert lane_order_keys == sorted(lane_order_keys)  # part order is order-key order
    assert sorted(seen) == sorted(r["id"] for r in records)
    for record in records:
        row = seen[record["id"]]
        assert row["text"] == record["text"]
        assert json.loads(row["lang"]) == record["lang"] and json.loads(row["meta"]) == record["meta"]
    assert [c["name"] for c in manifest.schema] == ["key", "order_key", "text", "input_ids", "num_tokens", "lang", "meta"]


@pytest.mark.beam
def test_offline_tokenized_lanes_hold_the_tokenizers_ids(runs):
    records, results = runs
    dataset, manifest = results["in_memory"]
    tokenizer = Tokenizer.from_file(TOKENIZER_PATH)
    assert manifest.tokenizer == describe(tokenizer).to_dict()
    total = 0
    for entry in manifest.files:
        table = pq.read_table(dataset / entry.path, columns=["text", "input_ids", "num_tokens"])
        for text, ids, num_tokens in zip(*(table.column(c).to_pylist() for c in ("text", "input_ids", "num_tokens"))):
            ids = np.frombuffer(ids, dtype="<i4").tolist()  # documented layout: little-endian int32 bytes
            assert ids == tokenizer.encode(text, add_special_tokens=False).ids
            assert num_tokens == len(ids)
            total += num_tokens
        assert table.schema.field("input_ids").type == pa.binary()
    assert manifest.total_tokens == total


@pytest.mark.beam
def test_inspect_reads_the_job_output(runs, capsys):
    _, results = runs
    dataset, manifest = results["in_memory"]
    assert inspect_dataset.main([str(dataset), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dataset_fingerprint"] == manifest.dataset_fingerprint
    assert summary["documents"] == 300 and summary["files"] == 8 and summary["tokens"] == manifest.total_tokens


# ---------------------------------------------------------------------------------------
# Rejections


def _bad_inputs(root: Path) -> tuple[list[str], dict[str, int], set[str]]:
    """Input files with every rejection reason; returns (patterns, expected counts, valid ids)."""
    valid = [{"id": f"ok-{n}", "text": f"valid document {n} ✓"} for n in range(12)]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in valid[:8]] + [
        b'{"id": "m1", "text": "unterminated',                   # malformed_json
        b'"just a string"',                                      # malformed_json (not an object)
        b'{"id": "t1", "body": "no text here"}',                 # missing_text_field
        b'{"id": "t2", "text": 42}',                             # non_string_text
        b'{"id": "t3", "text": null}',                           # non_string_text
        b'{"id": "u1", "text": "bad \xc3\x28 bytes"}',           # invalid_utf8 (raw bytes)
        b'{"id": "u2", "text": "lone \\udc80 surrogate"}',       # invalid_utf8 (escape)
        b'{"id": "e1", "text": ""}',                             # empty_text
        b'{"id": "e2", "text": " \\u3000\\n\\t "}',              # empty_text (Unicode whitespace)
        b'{"text": "no id at all"}',                             # missing_id_field
    ]
    (root / "in").mkdir(parents=True)
    (root / "in" / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    pq.write_table(pa.table({
        "id": pa.array(["ok-8", "ok-9", None, "p2"]),
        "text": pa.array([b"valid document 8 \xe2\x9c\x93", b"valid document 9 \xe2\x9c\x93", b"no id", b"\xff\xfe"], pa.binary()),
    }), root / "in" / "rows.parquet")
    write_jsonl(root / "in" / "more.jsonl.gz", valid[10:], "gzip")
    (root / "in" / "corrupt.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00 definitely not gzip")  # unreadable_file
    expected = {"malformed_json": 2, "missing_text_field": 1, "non_string_text": 2, "invalid_utf8": 3,
                "empty_text": 2, "missing_id_field": 2, "unreadable_file": 1}
    return [str(root / "in" / "*")], expected, {r["id"] for r in valid}


@pytest.mark.beam
def test_every_rejection_reason_is_counted_and_nothing_valid_is_lost(tmp_path):
    patterns, expected, valid_ids = _bad_inputs(tmp_path)
    manifest = shard.run(["--input", *patterns, "--output", str(tmp_path / "out"), "--id-field", "id",
                          "--num-lanes", "1", "--max-reject-fraction", "1.0", *IN_MEMORY])  # 12 docs: 3 lanes leave one empty
    assert set(expected) == set(DOCUMENT_REJECT_REASONS)
    assert manifest.rejected == expected
    keys = {key for entry in manifest.files
            for key in pq.read_table(tmp_path / "out" / entry.path, columns=["key"]).column("key").to_pylist()}
    assert keys == valid_ids and manifest.documents == len(valid_ids)
    # documents in = documents out + rejected (the unreadable file counts as one record)
    assert manifest.documents + sum(manifest.rejected.values()) == len(valid_ids) + sum(expected.values())
    rejected = [json.loads(line) for path in sorted((tmp_path / "out" / "_rejected").glob("*.jsonl"))
                for line in path.read_text().splitlines()]
    assert sorted(set(r) for r in rejected)[0] == {"input_file", "record_index", "reason", "detail", "excerpt"}
    by_reason = {}
    for r in rejected:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    assert by_reason == expected
    unreadable = next(r for r in rejected if r["reason"] == "unreadable_file")
    assert unreadable["input_file"].endswith("corrupt.jsonl.gz") and unreadable["detail"]
    utf8 = next(r for r in rejected if r["reason"] == "invalid_utf8" and r["input_file"].endswith("mixed.jsonl"))
    assert utf8["record_index"] == 13 and "\\xc3" in utf8["excerpt"]


@pytest.mark.beam
def test_keys_without_id_field_are_relative_paths_and_text_files_are_documents(tmp_path):
    (tmp_path / "corpus" / "txt").mkdir(parents=True)
    (tmp_path / "corpus" / "txt" / "a.txt").write_text("a whole file\nis one document\n")
    (tmp_path / "corpus" / "txt" / "empty.txt").write_text(" \n")
    (tmp_path / "corpus" / "txt" / "bad.txt").write_bytes(b"\xff bad")
    write_jsonl(tmp_path / "corpus" / "j" / "b.jsonl", [{"text": "first"}, {"text": "second"}])
    manifest = shard.run(["--input", f"{tmp_path}/corpus/txt/*.txt", f"{tmp_path}/corpus/j/b.jsonl",
                          "--output", str(tmp_path / "out"), "--num-lanes", "1",  # 3 docs: 2 lanes leave one empty
                          "--max-reject-fraction", "0.5", *IN_MEMORY])
    rows = {key: text for entry in manifest.files
            for key, text in zip(*pq.read_table(tmp_path / "out" / entry.path, columns=["key", "text"]).columns)}
    assert {k.as_py(): v.as_py() for k, v in rows.items()} == {
        "txt/a.txt#0": "a whole file\nis one document\n", "j/b.jsonl#0": "first", "j/b.jsonl#1": "second"}
    assert {r: c for r, c in manifest.rejected.items() if c} == {"empty_text": 1, "invalid_utf8": 1}
    assert manifest.source_name == "out" and manifest.tokenizer is None
    assert [c["name"] for c in manifest.schema] == ["key", "order_key", "text"]


@pytest.mark.beam
def test_too_many_rejects_fails_without_manifest_then_overwrite_replaces(tmp_path, capsys):
    records = [{"id": f"d{n}", "text": "" if n % 4 == 0 else f"text {n}"} for n in range(40)]  # 25% empty
    write_jsonl(tmp_path / "in" / "docs.jsonl", records)
    out = tmp_path / "out"
    base = ["--input", f"{tmp_path}/in/*.jsonl", "--output", str(out), "--id-field", "id", "--num-lanes", "4", *IN_MEMORY]

    assert shard.main(base) == 1
    error = capsys.readouterr().err
    assert "10 of 40 input records were rejected" in error and "empty_text=10" in error
    assert "--max-reject-fraction=0.01" in error and "No manifest.json was written" in error
    assert not (out / MANIFEST_NAME).exists() and (out / "_rejected").is_dir()

    (out / "lane=00077").mkdir()  # a stale lane from some older job
    assert shard.main([*base, "--max-reject-fraction", "0.3"]) == 1  # lane dirs exist: refused
    assert "--overwrite" in capsys.readouterr().err

    assert shard.main([*base, "--max-reject-fraction", "0.3", "--overwrite"]) == 0
    manifest = read_manifest(str(out))
    assert manifest.documents == 30 and manifest.rejected["empty_text"] == 10
    assert not (out / "lane=00077").exists()
    assert "dataset_fingerprint" in capsys.readouterr().out


@pytest.mark.beam
@pytest.mark.slow
def test_lane_balance_of_a_real_run_64_lanes_100k_documents(tmp_path):
    """The pipeline itself (not just the hash): largest lane <= 1.15x the mean, ~5 s."""
    lines = "".join(f'{{"id": "doc-{n}", "text": "document {n}"}}\n' for n in range(100_000))
    (tmp_path / "docs.jsonl").write_text(lines)
    manifest = shard.run(["--input", str(tmp_path / "docs.jsonl"), "--output", str(tmp_path / "out"),
                          "--id-field", "id", "--num-lanes", "64", *IN_MEMORY])
    per_lane = np.bincount([f.lane for f in manifest.files], weights=[f.rows for f in manifest.files], minlength=64)
    assert manifest.documents == 100_000 and per_lane.sum() == 100_000
    assert per_lane.max() <= 1.15 * per_lane.mean(), per_lane.max() / per_lane.mean()


@pytest.fixture
def gcs_emulator(monkeypatch):
    """An in-memory GCS emulator on a free port; Beam's gcsio is made to connect anonymously."""
    import shutil
    import socket
    import subprocess
    import time

    if shutil.which("gcp-storage-emulator") is None:
        pytest.skip("gcp-storage-emulator is not installed (pip install '.[test]')")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(["gcp-storage-emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        # Without Application Default Credentials Beam retries google.auth.default() for
        # ~27 s per process (FIELD-NOTES); mark its credential cache as "looked up: none",
        # which makes gcsio use an anonymous client, as it would after the retries.
        from apache_beam.internal.gcp import auth

        monkeypatch.setattr(auth._Credentials, "_credentials_init", True)
        monkeypatch.setattr(auth._Credentials, "_credentials", None)
        from google.cloud import storage

        client = storage.Client.create_anonymous_client()
        client.create_bucket("zephon-shard-test")
        yield client.bucket("zephon-shard-test")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.beam
@pytest.mark.gcs
def test_gcs_input_and_output_match_local(tmp_path, gcs_emulator):
    records = make_records(60)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    gcs_emulator.blob("raw/en/docs.jsonl").upload_from_string(data)
    write_jsonl(tmp_path / "raw" / "en" / "docs.jsonl", records)
    args = ["--num-lanes", "3", "--keep-fields", "lang", *IN_MEMORY]  # no --id-field: keys use relative paths
    local = shard.run(["--input", f"{tmp_path}/raw/*/*.jsonl", "--output", str(tmp_path / "ds"), *args])
    remote = shard.run(["--input", "gs://zephon-shard-test/raw/*/*.jsonl", "--output", "gs://zephon-shard-test/ds", *args])
    assert remote.dataset_fingerprint == local.dataset_fingerprint and remote.documents == 60
    for entry in local.files:
        assert gcs_emulator.blob(f"ds/{entry.path}").download_as_bytes() == (tmp_path / "ds" / entry.path).read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        shard.run(["--input", "gs://zephon-shard-test/raw/*/*.jsonl", "--output", "gs://zephon-shard-test/ds", *args])
    shard.run(["--input", "gs://zephon-shard-test/raw/*/*.jsonl", "--output", "gs://zephon-shard-test/ds",
               "--overwrite", "--num-lanes", "1", *IN_MEMORY])
    names = sorted(blob.name for blob in gcs_emulator.client.list_blobs("zephon-shard-test", prefix="ds/"))
    assert names == ["ds/lane=00000/part-00000.parquet", "ds/manifest.json"]
