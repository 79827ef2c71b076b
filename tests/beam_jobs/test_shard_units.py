"""Sharding job pieces that need no Beam pipeline: inputs, readers, lane layout, options."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from beam_jobs import inputs, lane_files, readers, shard
from beam_jobs.outputs import ShardJobError, check_reject_fraction, prepare_output
from loader.order.hashing import file_bucket, lane_of_key, order_key_of

# ---------------------------------------------------------------------------------------
# Inputs


def _touch(path, data=b"{}\n"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def test_input_root_is_longest_common_directory_of_static_parts(tmp_path):
    root = str(tmp_path)
    assert inputs.input_root([f"{root}/data/web/*.jsonl", f"{root}/data/books/x-*.parquet"]) == f"{root}/data/"
    assert inputs.input_root([f"{root}/data/web/a.jsonl"]) == f"{root}/data/web/"
    # Character-wise common prefix "data/we" must not cut a directory name in half.
    assert inputs.input_root([f"{root}/data/web/*.jsonl", f"{root}/data/wet/*.jsonl"]) == f"{root}/data/"
    assert inputs.input_root(["gs://b/corpus/en/*.jsonl", "gs://b/corpus/de/*.jsonl"]) == "gs://b/corpus/"


def test_expand_inputs_sorts_dedupes_and_makes_relative_paths(tmp_path):
    a = _touch(tmp_path / "d" / "web" / "b.jsonl.gz")
    b = _touch(tmp_path / "d" / "web" / "a.jsonl")
    c = _touch(tmp_path / "d" / "books" / "c.parquet")
    files = inputs.expand_inputs([f"{tmp_path}/d/web/*", f"{tmp_path}/d/books/*.parquet", b])
    assert [f.path for f in files] == sorted([a, b, c])
    assert [f.relative_path for f in files] == ["books/c.parquet", "web/a.jsonl", "web/b.jsonl.gz"]
    assert [f.file_index for f in files] == [0, 1, 2]
    assert [(f.format, f.compression) for f in files] == [("parquet", "none"), ("jsonl", "none"), ("jsonl", "gzip")]


def test_expand_inputs_errors_name_the_pattern_or_file(tmp_path):
    _touch(tmp_path / "x.csv")
    with pytest.raises(inputs.InputError, match=r"nothing-\*\.jsonl matches no files"):
        inputs.expand_inputs([f"{tmp_path}/nothing-*.jsonl"])
    with pytest.raises(inputs.InputError, match=r"x\.csv.*--format"):
        inputs.expand_inputs([f"{tmp_path}/x.csv"])
    assert inputs.expand_inputs([f"{tmp_path}/x.csv"], "jsonl")[0].format == "jsonl"
    with pytest.raises(inputs.InputError, match="is a directory"):
        inputs.expand_inputs([str(tmp_path)])


@pytest.mark.parametrize("name,fmt,compression", [
    ("a.jsonl", "jsonl", "none"), ("a.json", "jsonl", "none"), ("a.jsonl.gz", "jsonl", "gzip"),
    ("a.jsonl.zst", "jsonl", "zstd"), ("a.parquet", "parquet", "none"), ("a.txt", "text", "none"),
    ("A.TXT.GZ", "text", "gzip"),
])
def test_format_and_compression_inferred_from_name(name, fmt, compression):
    assert inputs.infer_format(name, None) == fmt
    assert inputs.infer_compression(name) == compression


# ---------------------------------------------------------------------------------------
# Readers


def _input_file(path, relative="f", fmt="jsonl", compression="none"):
    return inputs.InputFile(path=str(path), relative_path=relative, file_index=3, format=fmt, compression=compression)


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_jsonl_reader_handles_compression_and_counts_lines(tmp_path, compression):
    lines = [json.dumps({"text": "one"}), "", "   ", json.dumps({"text": "two"})]
    data = ("\n".join(lines) + "\n").encode()
    data = {"none": lambda d: d, "gzip": gzip.compress, "zstd": zstandard.ZstdCompressor().compress}[compression](data)
    path = _touch(tmp_path / "f.jsonl", data)
    out = list(readers.read_records(_input_file(path, "sub/f.jsonl", compression=compression), readers.RecordSpec()))
    # Blank lines are not records, but the record index stays the line number.
    assert out == [(True, ("sub/f.jsonl#0", "one", 3, ())), (True, ("sub/f.jsonl#3", "two", 3, ()))]


def test_jsonl_reader_rejects_each_bad_record_once(tmp_path):
    spec = readers.RecordSpec(id_field="id", keep_fields=("lang",))
    lines = [
        b'{"id": 1, "text": "ok", "lang": "en"}',
        b'{"id": 2, "text": "cut',
        b'{"id": 3}',
        b'{"id": 4, "text": 5}',
        b'{"id": 5, "text": "caf\xe9"}',
        b'{"id": 6, "text": " \\n\\t"}',
        b'{"text": "no id"}',
        b'{"id": 8, "text": "lone \\ud800 surrogate"}',
        b'[1, 2]',
        b'{"id": {"b": 1, "a": 2}, "text": "dict id"}',
    ]
    path = _touch(tmp_path / "f.jsonl", b"\n".join(lines))
    out = list(readers.read_records(_input_file(path), spec))
    docs = [element for ok, element in out if ok]
    rejects = [element for ok, element in out if not ok]
    assert docs == [("1", "ok", 2, ('"en"',)), ('{"a":2,"b":1}', "dict id", 7, (None,))]
    assert [(r[2], r[3]) for r in rejects] == [
        (1, "malformed_json"), (2, "missing_text_field"), (3, "non_string_text"), (4, "invalid_utf8"),
        (5, "empty_text"), (6, "missing_id_field"), (7, "invalid_utf8"), (8, "malformed_json"),
    ]
    assert all(r[0] == 3 and r[1] == path for r in rejects)
    assert rejects[3][5] == '{"id": 5, "text": "caf\\xe9"}'  # the bad byte stays visible


def test_parquet_reader_validates_utf8_and_types(tmp_path):
    table = pa.table({
        "text": pa.array([b"good", b"bad \xff", None, b"   ", b"fine"], pa.binary()),
        "id": pa.array(["a", "b", "c", "d", None]),
    })
    path = tmp_path / "f.parquet"
    pq.write_table(table, path)
    out = list(readers.read_records(_input_file(path, "f.parquet", "parquet"), readers.RecordSpec(id_field="id")))
    assert [ok for ok, _ in out] == [True, False, False, False, False]
    assert out[0][1] == ("a", "good", 4, ())
    assert [r[3] for ok, r in out if not ok] == ["invalid_utf8", "non_string_text", "empty_text", "missing_id_field"]


def test_parquet_reader_missing_text_column_rejects_every_row(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"body": ["x", "y"]}), path)
    out = list(readers.read_records(_input_file(path, fmt="parquet"), readers.RecordSpec()))
    assert [(ok, r[3]) for ok, r in out] == [(False, "missing_text_field")] * 2


@pytest.mark.parametrize("name,fmt,compression,data", [
    ("f.jsonl.gz", "jsonl", "gzip", gzip.compress(b'{"text": "a"}\n' * 50)[:-30]),  # truncated gzip
    ("f.jsonl.zst", "jsonl", "zstd", b"not zstd at all"),
    ("f.parquet", "parquet", "none", b"PAR1 not really parquet"),
])
def test_unreadable_file_is_one_rejection_with_the_error(tmp_path, name, fmt, compression, data):
    path = _touch(tmp_path / name, data)
    out = list(readers.read_records(_input_file(path, name, fmt, compression), readers.RecordSpec()))
    rejects = [r for ok, r in out if not ok]
    assert len(rejects) == 1 and rejects[0][3] == "unreadable_file"
    assert rejects[0][4]  # carries the exception text
    assert all(ok for ok, _ in out[:-1])  # what was readable before the failure is kept


def test_text_reader_is_one_document_per_file(tmp_path):
    path = _touch(tmp_path / "a.txt", "line one\nline two\n".encode())
    out = list(readers.read_records(_input_file(path, "a.txt", "text"), readers.RecordSpec()))
    assert out == [(True, ("a.txt#0", "line one\nline two\n", 18, ()))]


# ---------------------------------------------------------------------------------------
# Lane layout


def test_lane_balance_64_lanes_100k_documents():
    """The largest of 64 lanes holds at most 1.15x the mean over 100k keys of both kinds."""
    for keys in ([f"doc-{i}" for i in range(100_000)], [f"web/part-{i % 97:04d}.jsonl#{i}" for i in range(100_000)]):
        counts = np.bincount([lane_of_key(7, key, 64) for key in keys], minlength=64)
        assert counts.max() <= 1.15 * counts.mean(), counts.max() / counts.mean()


@given(st.lists(st.one_of(st.integers(0, 3000), st.integers(0, 600_000)), max_size=3000))
@settings(max_examples=60, deadline=None)
def test_row_group_bounds_cover_rows_and_respect_limits(text_nbytes):
    bounds = lane_files.row_group_bounds(np.array(text_nbytes, dtype=np.int64))
    starts = [start for start, _ in bounds]
    assert starts == [0, *[stop for _, stop in bounds[:-1]]][: len(bounds)]
    assert (bounds[-1][1] if bounds else 0) == len(text_nbytes)
    assert all(stop > start for start, stop in bounds)
    for start, stop in bounds[:-1]:
        rows, size = stop - start, sum(text_nbytes[start:stop])
        assert rows == lane_files.ROW_GROUP_MAX_ROWS or size >= lane_files.ROW_GROUP_TEXT_BYTES
        assert size - text_nbytes[stop - 1] < lane_files.ROW_GROUP_TEXT_BYTES  # closed on the first row over


def test_row_groups_follow_content_not_batches():
    nbytes = np.full(5000, 900, dtype=np.int64)  # 1165 rows of 900 B = 1 MiB
    bounds = lane_files.row_group_bounds(nbytes)
    assert [stop - start for start, stop in bounds] == [1024] * 4 + [904]
    big = np.full(10, 400_000, dtype=np.int64)
    assert [stop - start for start, stop in lane_files.row_group_bounds(big)] == [3, 3, 3, 1]


@pytest.mark.parametrize("total,lanes,target,expected", [
    (0, 64, 100, 1), (6400, 64, 100, 1), (6401, 64, 100, 2), (10**9, 8, 64 << 20, 2),
])
def test_files_per_lane_from_total_text_bytes(total, lanes, target, expected):
    assert lane_files.files_per_lane_for(total, lanes, target) == expected


def _rows(keys, seed=0):
    return [(order_key_of(seed, k).to_bytes(8, "big"), k, f"text of {k} " * 40, ('"x"',)) for k in keys]


def test_serialized_lane_file_is_deterministic_and_seekable():
    rows = _rows([f"k{i}" for i in range(2500)])
    shuffled = list(reversed(rows))
    a = lane_files.serialize_lane_file(lane_files.sort_rows(rows, True), ["meta"])
    b = lane_files.serialize_lane_file(lane_files.sort_rows(shuffled, True), ["meta"])
    assert a.data == b.data and a.rows == 2500 and a.row_groups == 3
    parquet = pq.ParquetFile(pa.BufferReader(a.data), page_checksum_verification=True)
    assert parquet.metadata.num_row_groups == 3
    assert parquet.schema_arrow.names == ["key", "order_key", "text", "meta"]
    assert parquet.metadata.row_group(0).column(0).compression == "ZSTD"
    order_keys = parquet.read(columns=["order_key"]).column(0).to_numpy()
    assert (np.diff(order_keys.astype(np.float64)) >= 0).all() and order_keys.dtype == np.uint64


def test_order_key_bytes_sort_like_uint64():
    keys = [order_key_of(3, f"k{i}") for i in range(2000)]
    assert sorted(keys) == [int.from_bytes(b, "big") for b in sorted(k.to_bytes(8, "big") for k in keys)]
    assert any(k >= 2**63 for k in keys)  # the unsigned half is exercised


def test_assign_lane_uses_the_shared_hash_functions():
    fn = lane_files.AssignLaneFn(seed=11, num_lanes=16)
    ((lane, part), row), = fn.process(("my-key", "text", 4, ()), files_per_lane=3)
    order_key = order_key_of(11, "my-key")
    assert lane == lane_of_key(11, "my-key", 16) and part == file_bucket(order_key, 3)
    assert row == (order_key.to_bytes(8, "big"), "my-key", "text", ())


# ---------------------------------------------------------------------------------------
# Options, output checks, errors


def test_help_documents_every_option_with_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        shard.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--input", "--format", "--text-field", "--id-field", "--keep-fields", "--source-name",
                   "--num-lanes", "--lane-balance", "--seed", "--tokenizer", "--token-compression", "--target-file-mb", "--output",
                   "--overwrite", "--max-reject-fraction", "--messages-field", "--chat-template", "--chat-loss-on",
                   "--chat-max-tokens", "--chat-overflow", "--image-field", "--image-root", "--image-policy",
                   "--max-image-mb", "--max-image-pixels", "--max-image-aspect-ratio", "--max-images-per-document",
                   "--s3-endpoint-url", "--s3-region", "--s3-profile", "--storage-retry-max-attempts",
                   "--storage-retry-deadline-s", "--storage-request-timeout-s", "--kind", "--kind-module"):
        assert option in text
    # the other 18 options (--lane-balance the 18th), --transform/--dedup, the 7 image options, the 6 storage
    # options and --kind/--kind-module
    assert text.count("(default") == 18 + 2 + 7 + 6 + 2 and text.count("(required)") == 2


def test_parse_args_splits_job_and_pipeline_options():
    options, pipeline_args = shard.parse_args([
        "--input", "a/*.jsonl", "b/*.parquet", "--output", "out", "--keep-fields", "url,lang", "meta",
        "--runner=DirectRunner", "--direct_num_workers", "2", "--num-lanes", "8",
    ])
    assert options.inputs == ("a/*.jsonl", "b/*.parquet") and options.keep_fields == ("url", "lang", "meta")
    assert options.num_lanes == 8 and pipeline_args == ["--runner=DirectRunner", "--direct_num_workers", "2"]
    assert shard.with_default_runner([]) == ["--runner=FnApiRunner"]
    assert shard.with_default_runner(["--runner", "DataflowRunner"]) == ["--runner", "DataflowRunner"]


@pytest.mark.parametrize("changes,message", [
    ({"num_lanes": 0}, "--num-lanes must be positive"),
    ({"keep_fields": ("text",)}, "lane file columns"),
    ({"max_reject_fraction": 1.5}, "--max-reject-fraction must be in"),
    ({"target_file_mb": 0}, "--target-file-mb"),
    ({"format": "csv"}, "--format must be one of"),
    ({"token_compression": "gzip"}, "--token-compression must be one of lz4, zstd, none"),
])
def test_bad_options_are_named(changes, message):
    with pytest.raises(shard.ShardConfigError, match=message):
        shard.ShardOptions(inputs=("x",), output="o", **changes)


def test_id_field_with_text_input_is_refused(tmp_path):
    _touch(tmp_path / "a.txt", b"hello")
    options = shard.ShardOptions(inputs=(f"{tmp_path}/*.txt",), output=str(tmp_path / "out"), id_field="id")
    with pytest.raises(shard.ShardConfigError, match="--id-field 'id' cannot apply to text input"):
        shard.run_shard(options)


def test_existing_dataset_needs_overwrite_and_manifest_goes_first(tmp_path, monkeypatch):
    out = tmp_path / "ds"
    _touch(out / "manifest.json")
    _touch(out / "lane=00000" / "part-00000.parquet")
    _touch(out / "_rejected" / "rejected-00000.jsonl")
    _touch(out / "README.txt")
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare_output(str(out), overwrite=False)
    removed = []
    real_remove = os.remove
    monkeypatch.setattr(os, "remove", lambda p: (removed.append(os.path.basename(p)), real_remove(p)))
    prepare_output(str(out), overwrite=True)
    assert removed[0] == "manifest.json"
    assert sorted(os.listdir(out)) == ["README.txt"]  # unrelated files are left alone
    prepare_output(str(tmp_path / "new"), overwrite=False)  # nothing there: fine


def test_reject_fraction_message_names_counts_and_option():
    check_reject_fraction(99, {"empty_text": 1}, 0.01)  # exactly at the limit is allowed
    with pytest.raises(ShardJobError, match=r"2 of 100 input records were rejected .*empty_text=2.*--max-reject-fraction=0.01"):
        check_reject_fraction(98, {"empty_text": 2, "malformed_json": 0}, 0.01)
    with pytest.raises(ShardJobError, match="no records"):
        check_reject_fraction(0, {}, 0.5)
    with pytest.raises(ShardJobError, match="none of the 3 input records is a valid document"):
        check_reject_fraction(0, {"missing_text_field": 3}, 1.0)


def test_job_error_message_found_in_remote_tracebacks():
    remote = ("Traceback ...\\n  raise ShardJobError(...)\\nbeam_jobs.outputs.ShardJobError: zephon shard: 5 of 9 "
              "input records were rejected (55.56%: empty_text=5), more than --max-reject-fraction=0.01."
              " [while running 'Shard/CommitManifest']\\n")
    assert shard._job_error_message(RuntimeError(remote)).startswith("5 of 9 input records were rejected")
    assert shard._job_error_message(RuntimeError("unrelated")) is None
