"""Pre-tokenized text documents longer than a best_fit sequence (loader.transforms.overlong).

The job records a pre-tokenized text dataset's longest document (the manifest's
``longest_tokens``, outside the dataset fingerprint); ``zephon record-longest`` adds it to a
dataset sharded before. With ``overlong = "drop"`` / ``"truncate"`` the loader drops (counted) or
truncates exactly the documents that do not fit; the stream is the same whether the entry is
recorded or not, and a dataset whose longest document fits gets no transform at all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.checkpoint.state import StateError
from loader.config import LoaderConfig
from loader.errors import ManifestError
from loader.io.manifest import Manifest, read_manifest
from loader.pipeline import ZephonLoader
from loader.transforms.overlong import text_overlong_transforms
from tests.dataset_factory import write_dataset
from tests.finite.epoch_stream import marker, run_stream

FIT = 63  # seq_len 64 minus the loader's EOS
IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]


def _texts(count: int) -> list[str]:
    """Documents of 5 to ~130 tokens, marker first: a truncated one keeps its marker."""
    return [f"{marker(k)} " + "word " * (3 + (k * 37) % 120) for k in range(count)]


def _zephon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loader.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("longest")
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    texts = _texts(96)
    lengths = {k: len(tokenizer.encode(t, add_special_tokens=False).ids) for k, t in enumerate(texts)}
    old = str(base / "old")  # written as before the entry: no longest_tokens
    write_dataset(old, texts, num_lanes=4, seed=3, tokenizer=tokenizer, files_per_lane=2, row_group_rows=4)
    recorded = str(base / "recorded")
    shutil.copytree(old, recorded)
    done = _zephon("record-longest", recorded)
    assert done.returncode == 0, done.stderr
    source = base / "docs.jsonl"
    source.write_text("".join(json.dumps({"id": f"d{k}", "text": t}) + "\n" for k, t in enumerate(texts)))
    shard.run(["--input", str(source), "--output", str(base / "job"), "--id-field", "id", "--num-lanes", "4",
               "--tokenizer", default_tokenizer_path(), *IN_MEMORY])
    return {"base": base, "old": old, "recorded": recorded, "job": str(base / "job"), "lengths": lengths,
            "tokenizer": tokenizer, "record_stdout": done.stdout}


def _config(path: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, "max_epochs": 1}], seq_len=64, global_batch_size=8, micro_batch_size=2,
                  seed=5, tokenizer=default_tokenizer_path(), packing="best_fit", best_fit_open_bins=4)
    fields.update(overrides)
    return LoaderConfig(**fields)


def _max_num_tokens(path: str) -> int:
    manifest = read_manifest(path)
    return max(max(pq.read_table(f"{path}/{f.path}", columns=["num_tokens"])["num_tokens"].to_pylist())
               for f in manifest.files)


def test_the_job_and_record_longest_record_the_longest_document_outside_the_fingerprint(data):
    longest = max(data["lengths"].values())
    assert longest > FIT
    job = read_manifest(data["job"])
    assert job.longest_tokens == _max_num_tokens(data["job"]) == longest
    assert dataclasses.replace(job, longest_tokens=None).compute_fingerprint() == job.dataset_fingerprint
    old, recorded = read_manifest(data["old"]), read_manifest(data["recorded"])
    assert old.longest_tokens is None and recorded.longest_tokens == longest
    assert recorded.dataset_fingerprint == old.dataset_fingerprint
    assert f"longest document {longest} tokens" in data["record_stdout"]
    # the manifest gained exactly the entry, nothing else
    before = json.loads(open(f"{data['old']}/manifest.json").read())
    after = json.loads(open(f"{data['recorded']}/manifest.json").read())
    assert after.pop("longest_tokens") == longest and after == before
    again = _zephon("record-longest", data["recorded"])
    assert again.returncode == 0 and "(longest_tokens recorded)" in again.stdout


def test_record_longest_refuses_what_it_cannot_record_in_one_line(data, tmp_path):
    text = str(tmp_path / "text")
    write_dataset(text, _texts(8), num_lanes=2, seed=3)
    done = _zephon("record-longest", text)
    assert done.returncode == 1 and done.stderr.count("zephon record-longest: error:") == 1
    assert "not pre-tokenized" in done.stderr and "Traceback" not in done.stderr
    edited = tmp_path / "edited"
    shutil.copytree(data["recorded"], edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["longest_tokens"] = 7
    (edited / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    done = _zephon("record-longest", "--check", str(edited))
    assert done.returncode == 1 and "longest_tokens is 7, but the longest document" in done.stderr


@pytest.mark.parametrize("overlong", ("refuse", "drop", "truncate"))
def test_overlong_text_is_cut_dropped_or_truncated_exactly_with_or_without_the_entry(data, overlong, caplog):
    lengths = data["lengths"]
    fits = {k for k, n in lengths.items() if n <= FIT}
    assert 0 < len(fits) < len(lengths)
    streams = {}
    for name in ("old", "recorded"):
        config = _config(data[name], overlong=overlong)
        with caplog.at_level(logging.INFO, logger="loader.transforms.overlong"):
            streams[name] = stream = run_stream(config)
        found = stream.markers(data["tokenizer"], 4)
        assert set(found.values()) == {1}
        assert sorted(found) == sorted(fits if overlong == "drop" else lengths)
        with ZephonLoader(config) as loader:
            for _ in loader:
                pass
            counts = loader.transform_counts().get(loader.source_names[0], {})
        if overlong == "refuse":
            assert not counts  # documents longer than a sequence are cut into pieces, as best_fit always did
        elif overlong == "drop":
            (key,) = [k for k in counts if k.endswith("length_tokens")]
            assert counts[key]["dropped"] == len(lengths) - len(fits)
        else:
            (key,) = [k for k in counts if k.endswith("truncate_tokens")]
            assert counts[key]["changed"] == len(lengths) - len(fits) and counts[key]["dropped"] == 0
    assert streams["old"].digest() == streams["recorded"].digest(), "the entry changed the stream"
    if overlong == "refuse":
        assert f"its longest document has {max(lengths.values())} tokens" in caplog.text
        assert sum(m.count("cuts such documents") for m in caplog.messages) >= 1
    if overlong == "truncate":  # every document fits now: no real row holds a piece of another row's document
        assert len(streams["old"].rows) < len(run_stream(_config(data["old"])).rows)


def test_a_dataset_whose_longest_document_fits_gets_no_transform(data):
    longest = read_manifest(data["recorded"]).longest_tokens
    config = _config(data["recorded"], seq_len=longest + 1, overlong="drop")
    with ZephonLoader(config) as loader:
        for _ in loader:
            pass
        assert not loader.transform_counts().get(loader.source_names[0])
    # without the entry the loader cannot know: the transform runs and drops nothing
    with ZephonLoader(_config(data["old"], seq_len=longest + 1, overlong="drop")) as loader:
        for _ in loader:
            pass
        counts = loader.transform_counts()[loader.source_names[0]]
        assert [c["dropped"] for c in counts.values()] == [0]
    # a checkpoint listing that transform is refused where the entry makes it unneeded (strict, documented)
    saved = run_stream(_config(data["old"], seq_len=longest + 1, overlong="drop"), save_at=1).state
    with ZephonLoader(config) as loader:
        with pytest.raises(StateError, match="transforms of source"):
            loader.load_state_dict(saved)


def test_truncate_keeps_whole_supervised_runs_of_token_inputs_with_a_loss_mask(data):
    manifest = read_manifest(data["old"])
    with_mask = dataclasses.replace(manifest, schema=manifest.schema + [{"name": "loss_mask", "type": "binary"}])
    (spec,) = text_overlong_transforms("truncate", with_mask, "s", seq_len=64, packing="best_fit", wrap_tokens=1)
    assert spec.function == "truncate_turns" and spec.args == {"max_tokens": FIT}
    (spec,) = text_overlong_transforms("truncate", manifest, "s", seq_len=64, packing="best_fit", wrap_tokens=1)
    assert spec.function == "truncate_tokens"
    assert text_overlong_transforms("drop", manifest, "s", seq_len=64, packing="concat", wrap_tokens=1) == ()


def test_the_manifest_entry_is_checked(data, tmp_path):
    raw = json.loads(open(f"{data['recorded']}/manifest.json").read())
    for bad, message in ((0, "must be a positive int"), (True, "must be a positive int"), ("9", "must be a positive int")):
        with pytest.raises(ManifestError, match=f"longest_tokens' {message}"):
            Manifest.from_dict({**raw, "longest_tokens": bad})
    text = str(tmp_path / "text")
    write_dataset(text, _texts(8), num_lanes=2, seed=3)
    untokenized = json.loads(open(f"{text}/manifest.json").read())
    with pytest.raises(ManifestError, match="'longest_tokens' belongs to a pre-tokenized text dataset"):
        Manifest.from_dict({**untokenized, "longest_tokens": 5})
    assert Manifest.from_dict(raw).longest_tokens == raw["longest_tokens"]
