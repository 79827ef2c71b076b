"""Tampered datasets: every outcome is a named error or the untampered batches (issue 14).

A small pre-tokenized dataset (2 lanes, 2 part files per lane, row groups of 8 rows) is read
for exactly one epoch (``max_epochs = 1``), so every row group of every lane file is decoded.
Then, many times over:

* a bit of a lane file is flipped: in every page header (two of its first bytes, located
  from the footer's ``data_page_offset``), in the footer and its length, and at offsets
  spread over the file (~70 flips);
* a manifest field is edited, once with the dataset fingerprint left stale and once with it
  recomputed (a consistent forgery);
* a lane file is truncated, emptied or deleted.

Each run must end in a :class:`loader.errors.ZephonError` whose message names the culprit
(the lane file, or the manifest and its field), or deliver exactly the untampered batches:
never different batches, a bare library exception or a hang. With ``verify_local_files``
every flipped bit is an error.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from loader.samples import default_tokenizer_path
from loader.io import integrity, storage_options
from loader.config import LoaderConfig
from loader.errors import ZephonError
from loader.io.manifest import MANIFEST_NAME, FileEntry, Manifest
from loader.pipeline import ZephonLoader
from tests.dataset_factory import synthetic_texts, write_dataset

NUM_LANES = 2
TARGET = "lane=00001/part-00000.parquet"  # the lane file whose bits are flipped


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("integrity") / "clean")
    write_dataset(path, synthetic_texts(96, seed=5, max_words=30), num_lanes=NUM_LANES, seed=1,
                  files_per_lane=2, row_group_rows=8, tokenizer=Tokenizer.from_file(default_tokenizer_path()))
    return path


def config(path: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, "max_epochs": 1}], seq_len=32, global_batch_size=4,
                  micro_batch_size=2, seed=3, tokenizer=default_tokenizer_path(), verify_local_files=False)
    fields.update(overrides)
    return LoaderConfig(**fields)


def batches(path: str, **overrides) -> list[str]:
    """SHA-256 of every micro-batch's input_ids and labels, to the end of the first epoch."""
    digests = []
    with ZephonLoader(config(path, **overrides)) as loader:
        for batch in loader:
            digests.append(hashlib.sha256(batch["input_ids"].numpy().tobytes()
                                          + batch["labels"].numpy().tobytes()).hexdigest())
    return digests


@pytest.fixture(scope="module")
def clean_batches(clean) -> list[str]:
    digests = batches(clean)
    assert len(digests) > 20 and len(set(digests)) == len(digests)  # a real stream, not a vacuous one
    return digests


def outcome(path: str, must_name: tuple[str, ...], clean_batches: list[str], **overrides) -> str:
    """"error" (a ZephonError naming one of ``must_name``) or "identical"; anything else fails."""
    try:
        got = batches(path, **overrides)
    except ZephonError as exc:
        message = str(exc)
        assert any(name in message for name in must_name), f"error does not name {must_name}: {message}"
        return "error"
    # Anything but a ZephonError (a bare pyarrow/numpy error, a TimeoutError from the hang
    # guard) propagates and fails the test.
    assert got == clean_batches, f"batches changed silently ({sum(a != b for a, b in zip(got, clean_batches))} differ, " \
                            f"{len(got)} vs {len(clean_batches)} batches)"
    return "identical"


def copy_dataset(clean: str, dest: str) -> str:
    shutil.copytree(clean, dest)
    return dest


# ---------------------------------------------------------------------------------------
# (a) bit flips


def flip_offsets(path: str) -> list[int]:
    """Every page header's first bytes, the footer (thrift, length, magic), and offsets spread
    over the whole file (~70 in all)."""
    size = os.path.getsize(path)
    metadata = pq.ParquetFile(path).metadata
    headers = []
    for g in range(metadata.num_row_groups):
        for c in range(metadata.num_columns):
            chunk = metadata.row_group(g).column(c)
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            headers += [start, start + 1, start + 3, start + 6]  # type, sizes, crc fields
    with open(path, "rb") as fh:
        fh.seek(size - 8)
        footer_len = int.from_bytes(fh.read(4), "little")
    footer_start = size - 8 - footer_len
    footer = np.linspace(footer_start, size - 9, 16).astype(int).tolist() + [size - 8, size - 5, size - 1]
    spread = np.linspace(0, size - 1, 24).astype(int).tolist()
    offsets = sorted(set(headers[::max(1, len(headers) // 24)] + footer + spread))
    assert any(o in offsets for o in headers) and footer_start in offsets
    return offsets


def flipped_copy(clean: str, dest: str, offset: int, bit: int) -> str:
    copy_dataset(clean, dest)
    target = os.path.join(dest, TARGET)
    with open(target, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))
    return dest


@pytest.mark.timeout(90)
def test_bit_flips_anywhere_in_a_lane_file_are_errors_or_harmless(clean, clean_batches, tmp_path):
    offsets = flip_offsets(os.path.join(clean, TARGET))
    seen = {"error": 0, "identical": 0}
    for k, offset in enumerate(offsets):
        dest = flipped_copy(clean, str(tmp_path / f"flip{k}"), offset, bit=k % 8)
        seen[outcome(dest, (TARGET,), clean_batches)] += 1
        shutil.rmtree(dest)
    # Not vacuous: a flip in the token column's pages or headers, or in the footer, is caught.
    assert seen["error"] >= len(offsets) // 4, seen


@pytest.mark.timeout(60)
def test_with_verify_local_files_every_bit_flip_is_an_error(clean, clean_batches, tmp_path):
    offsets = flip_offsets(os.path.join(clean, TARGET))[1::2]  # half of them: each fails on open
    for k, offset in enumerate(offsets):
        dest = flipped_copy(clean, str(tmp_path / f"flip{k}"), offset, bit=(k * 3) % 8)
        with pytest.raises(ZephonError, match="SHA-256") as raised:
            batches(dest, verify_local_files=True)
        assert TARGET in str(raised.value)
        shutil.rmtree(dest)
    assert batches(clean, verify_local_files=True) == clean_batches


def test_a_flipped_page_header_that_drops_rows_is_caught_by_the_row_count(clean, tmp_path):
    """The reported case: a page header whose value count is damaged decodes fewer rows
    without a pyarrow error (page checksums cover page bodies only)."""
    metadata = pq.ParquetFile(os.path.join(clean, TARGET)).metadata
    start = metadata.row_group(0).column(metadata.schema.names.index("input_ids")).data_page_offset
    errors = []
    for byte in range(start, start + 24):
        for bit in range(8):
            dest = flipped_copy(clean, str(tmp_path / f"h{byte}_{bit}"), byte, bit)
            try:
                batches(dest)
            except ZephonError as exc:
                errors.append(str(exc))
            shutil.rmtree(dest)
            if any("decoded to" in e for e in errors):
                assert TARGET in errors[-1] and "row group 0 decoded to" in errors[-1], errors[-1]
                return
    pytest.fail(f"no flip in the first page header dropped rows; errors seen: {errors[:5]}")


def test_errors_on_read_ahead_threads_and_in_workers_name_the_file(clean, tmp_path):
    metadata = pq.ParquetFile(os.path.join(clean, TARGET)).metadata
    column = metadata.schema.names.index("input_ids")
    last = metadata.num_row_groups - 1  # read by a read-ahead thread, not the first direct read
    start = metadata.row_group(last).column(column).data_page_offset
    dest = flipped_copy(clean, str(tmp_path / "late"), start + 30, 2)  # inside the page body: CRC
    for overrides in ({"read_ahead": True}, {"read_ahead": False}, {"num_workers": 1}):
        with pytest.raises(ZephonError) as raised:
            batches(dest, **overrides)
        assert TARGET in str(raised.value) and f"row group {last}" in str(raised.value), overrides


def test_each_file_is_hashed_once_per_process(clean, clean_batches, monkeypatch):
    hashed = []
    real = storage_options.sha256_of_file
    monkeypatch.setattr(storage_options, "sha256_of_file", lambda handle: hashed.append(1) or real(handle))
    integrity._verified_local_files.clear()
    two_epochs = [{"path": clean, "max_epochs": 2}]
    assert batches(clean, datasets=two_epochs, verify_local_files=True)[:len(clean_batches) // 2] == clean_batches[:len(clean_batches) // 2]
    assert len(hashed) == 2 * NUM_LANES  # every file once, though each was opened twice
    batches(clean, verify_local_files=True)
    assert len(hashed) == 2 * NUM_LANES  # a second loader in the process does not hash again


# ---------------------------------------------------------------------------------------
# (b) manifest edits


def _other_sha(sha: str) -> str:
    return ("0" if sha[0] != "0" else "1") + sha[1:]


def manifest_edits() -> dict:
    """name -> edit(manifest dict), in place. ``files[0]`` is lane 0 part 0, ``files[1]`` lane 0 part 1."""

    def on_file(field, value):
        def edit(m):
            m["files"][0][field] = value(m["files"][0][field]) if callable(value) else value
        return edit

    def swap_parts(m):  # the two files of lane 0 swap part numbers and paths: their order flips
        a, b = m["files"][0], m["files"][1]
        for field in ("part", "path"):
            a[field], b[field] = b[field], a[field]

    def move_to_lane(m):  # lane, part and path changed together, to a (lane, part) nobody has
        m["files"][0].update(lane=1, part=7, path="lane=00001/part-00007.parquet")

    def duplicate(m):
        m["files"].append(copy.deepcopy(m["files"][0]))

    def duplicate_consistent(m):
        duplicate(m)
        m["documents"] += m["files"][0]["rows"]

    def remove(m):
        m["files"].pop(0)

    def remove_consistent(m):
        m["documents"] -= m["files"].pop(0)["rows"]

    def rows_zero_consistent(m):
        m["documents"] -= m["files"][0]["rows"]
        m["files"][0]["rows"] = 0

    def set_top(field, value):
        def edit(m):
            m[field] = value(m[field]) if callable(value) else value
        return edit

    return {
        "lane+1": on_file("lane", lambda v: v + 1),
        "lane-1": on_file("lane", -1),
        "lane_str": on_file("lane", "0"),
        "part+1": on_file("part", lambda v: v + 1),
        "part-1": on_file("part", -1),
        "swap_parts": swap_parts,
        "move_to_lane": move_to_lane,
        "path_missing": on_file("path", "lane=00000/part-00009.parquet"),
        "path_other_file": on_file("path", "lane=00000/part-00001.parquet"),
        "path_dot": on_file("path", "./lane=00000/part-00000.parquet"),
        "path_absolute": on_file("path", "/etc/passwd"),
        "rows+1": on_file("rows", lambda v: v + 1),
        "rows-1": on_file("rows", lambda v: v - 1),
        "rows0": on_file("rows", 0),
        "rows0_consistent": rows_zero_consistent,
        "rows_negative": on_file("rows", -8),
        "rows_float": on_file("rows", 8.0),
        "bytes+1": on_file("bytes", lambda v: v + 1),
        "bytes-1": on_file("bytes", lambda v: v - 1),
        "bytes_negative": on_file("bytes", -1),
        "sha256_other": on_file("sha256", _other_sha),
        "sha256_upper": on_file("sha256", str.upper),
        "sha256_short": on_file("sha256", lambda v: v[:20]),
        "tokens+1": on_file("tokens", lambda v: v + 1),
        "tokens-1": on_file("tokens", lambda v: v - 1),
        "tokens_null": on_file("tokens", None),
        "tokens_negative": on_file("tokens", -5),
        "row_groups+1": on_file("row_groups", lambda v: v + 1),
        "row_groups-1": on_file("row_groups", lambda v: v - 1),
        "row_groups0": on_file("row_groups", 0),  # "not recorded": read from the footer
        "row_groups_negative": on_file("row_groups", -1),
        "row_groups_str": on_file("row_groups", "2"),
        "documents+1": set_top("documents", lambda v: v + 1),
        "documents-1": set_top("documents", lambda v: v - 1),
        "num_lanes+1": set_top("num_lanes", lambda v: v + 1),
        "num_lanes-1": set_top("num_lanes", lambda v: v - 1),
        "num_lanes0": set_top("num_lanes", 0),
        "seed+1": set_top("seed", lambda v: v + 1),  # the loader's seed is its config's
        "schema_dropped_column": set_top("schema", lambda v: v[:-1]),
        "schema_other_type": set_top("schema", lambda v: [dict(c, type="string") for c in v]),
        "tokenizer_null": set_top("tokenizer", None),
        "files_per_lane0": set_top("files_per_lane", 0),
        "fingerprint_removed": lambda m: m.pop("dataset_fingerprint"),
        "fingerprint_garbage": set_top("dataset_fingerprint", "not a fingerprint"),
        "duplicate_entry": duplicate,
        "duplicate_entry_consistent": duplicate_consistent,
        "removed_entry": remove,
        "removed_entry_consistent": remove_consistent,
    }


def recomputed_fingerprint(m: dict) -> str:
    """The fingerprint a forger would write: the real formula over the edited content."""
    files = [FileEntry(**f) for f in m["files"]]
    manifest = Manifest(seed=m["seed"], num_lanes=m["num_lanes"], source_name=m["source_name"], schema=m["schema"],
                        files=files, documents=m["documents"], tokenizer=m["tokenizer"])
    return manifest.compute_fingerprint()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fingerprint", ["stale", "recomputed"])
def test_every_manifest_edit_is_an_error_or_harmless(clean, clean_batches, tmp_path, fingerprint):
    original = json.loads(open(os.path.join(clean, MANIFEST_NAME)).read())
    assert original["files"][0]["path"] == "lane=00000/part-00000.parquet"
    assert original["files"][1]["path"] == "lane=00000/part-00001.parquet"
    seen = {}
    for name, edit in manifest_edits().items():
        data = copy.deepcopy(original)
        edit(data)
        if fingerprint == "recomputed" and not name.startswith("fingerprint_"):
            data["dataset_fingerprint"] = recomputed_fingerprint(data)
        dest = copy_dataset(clean, str(tmp_path / name))
        with open(os.path.join(dest, MANIFEST_NAME), "w") as fh:
            json.dump(data, fh)
        # A manifest error names the manifest; a file error names the lane file it is about.
        names = (MANIFEST_NAME, "lane=00000/", "lane=00001/")
        seen[name] = outcome(dest, names, clean_batches)
        shutil.rmtree(dest)
    harmless = {n for n, o in seen.items() if o == "identical"}
    if fingerprint == "stale":
        # The fingerprint covers path, rows, tokens, sha256, seed, lanes, schema and tokenizer;
        # lane, part, bytes, row_groups, documents and files_per_lane are caught by the
        # structural checks (row_groups 0 means "not recorded": the footer's count is used).
        assert harmless <= {"row_groups0"}, harmless  # the rest are caught by the structural checks
    else:
        # Consistently forged: only edits of fields the loader does not read may pass.
        assert harmless <= {"row_groups0", "seed+1", "sha256_other", "schema_dropped_column",
                            "schema_other_type"}, harmless


def test_a_manifest_error_reports_every_problem_with_its_entry(clean, tmp_path):
    data = json.loads(open(os.path.join(clean, MANIFEST_NAME)).read())
    data["files"][0]["rows"] = 0
    data["files"][1]["lane"] = 1
    data["files"].append(copy.deepcopy(data["files"][2]))
    dest = copy_dataset(clean, str(tmp_path / "many"))
    with open(os.path.join(dest, MANIFEST_NAME), "w") as fh:
        json.dump(data, fh)
    with pytest.raises(ZephonError) as raised:
        batches(dest)
    message = str(raised.value)
    assert os.path.join(dest, MANIFEST_NAME) in message
    assert "files[0] (lane=00000/part-00000.parquet): field 'rows' must be >= 1" in message
    assert "files[1] (lane=00000/part-00001.parquet): path 'lane=00000/part-00001.parquet' is not the path of lane 1" \
        in message
    assert f"files[{len(data['files']) - 1}] (lane=00001/part-00000.parquet): duplicates files[2]" in message
    assert "dataset_fingerprint" in message


# ---------------------------------------------------------------------------------------
# (c) truncated, empty, missing files


@pytest.mark.parametrize("damage", ["truncated_half", "truncated_footer", "empty", "missing", "extra_bytes"])
@pytest.mark.parametrize("fingerprint", ["manifest_kept", "manifest_forged"])
def test_truncated_empty_or_missing_lane_files_are_errors(clean, clean_batches, tmp_path, damage, fingerprint):
    dest = copy_dataset(clean, str(tmp_path / damage))
    target = os.path.join(dest, TARGET)
    data = open(target, "rb").read()
    if damage == "missing":
        os.remove(target)
    else:
        cut = {"truncated_half": data[: len(data) // 2], "truncated_footer": data[:-3], "empty": b"",
               "extra_bytes": data + b"\0" * 16}[damage]
        with open(target, "wb") as fh:
            fh.write(cut)
        if fingerprint == "manifest_forged":  # the size and hash updated to the damaged file
            manifest = json.loads(open(os.path.join(dest, MANIFEST_NAME)).read())
            entry = next(f for f in manifest["files"] if f["path"] == TARGET)
            entry.update(bytes=len(cut), sha256=hashlib.sha256(cut).hexdigest())
            manifest["dataset_fingerprint"] = recomputed_fingerprint(manifest)
            with open(os.path.join(dest, MANIFEST_NAME), "w") as fh:
                json.dump(manifest, fh)
    with pytest.raises(ZephonError) as raised:
        batches(dest, verify_local_files=True)
    assert TARGET in str(raised.value)
    with pytest.raises(ZephonError) as raised:
        batches(dest)  # without the hash: the size and the footer checks
    assert TARGET in str(raised.value)
