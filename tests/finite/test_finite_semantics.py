"""What finite data does at its end, beyond "every document once" (test_exactly_once.py):
fill rows in the batch and the metrics, ``epoch_tail = "drop"`` as before, checkpoints of either
mode, and the lane count ``zephon shard`` picks without ``--num-lanes``."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from beam_jobs import shard
from beam_jobs.lane_balance import balanced_lane_count
from beam_jobs.lane_count import AUTO_LANE_COUNTS, choose_lane_count, lane_mask
from loader.samples import default_tokenizer_path
from loader.checkpoint.state import StateError
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints, fill_note
from loader.io.manifest import read_manifest
from loader.order.hashing import lane_of_key
from loader.pipeline import ZephonLoader
from tests.dataset_factory import write_dataset
from tests.finite.epoch_stream import marked_texts, run_stream


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("finite_semantics") / "ds")
    write_dataset(path, marked_texts(150, max_words=20), num_lanes=8, seed=3,
                  tokenizer=Tokenizer.from_file(default_tokenizer_path()), files_per_lane=2, row_group_rows=4)
    return path


def _config(path: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path, "max_epochs": 1}], seq_len=64, global_batch_size=16, micro_batch_size=4,
                  seed=11, tokenizer=default_tokenizer_path(), packing="best_fit", best_fit_open_bins=4)
    fields.update(overrides)
    return LoaderConfig(**fields)


def test_fill_rows_are_marked_unsupervised_and_counted(dataset):
    fills = steps = 0
    with ZephonLoader(_config(dataset), output="numpy") as loader:
        for batch in loader:
            steps += batch["micro_step"] == 0
            fill = batch["fill"]
            assert fill.dtype == bool and len(fill) == 4
            assert (batch["source_ids"][fill] == -1).all() and (batch["source_ids"][~fill] == 0).all()
            assert (batch["labels"][fill] == -100).all(), "a fill row holds a supervised token"
            assert (batch["position_ids"][fill] == np.arange(64)).all()  # one segment of padding
            fills += int(fill.sum())
        metrics = loader.metrics()
    assert fills > 0 and metrics.total.fill_rows == fills and f"fill rows {fills}" in metrics.line()
    assert metrics.total.sequences == steps * 16
    results, _ = collect_fingerprints(_config(dataset), world_size=2, end_step=1000)
    assert sum(r.fill_rows for r in results) == fills and len(results) == steps
    assert fill_note(results, 16).startswith(f"# fill rows: {fills} of {steps * 16} rows")


def test_drop_ends_at_the_first_lane_that_runs_out_and_has_no_fill_field(dataset):
    drop = run_stream(_config(dataset, epoch_tail="drop"))
    fill = run_stream(_config(dataset))
    assert not drop.fill_rows() and drop.steps < fill.steps
    assert all(fill.rows[i][:2] == row[:2] for i, row in drop.rows.items()), "the stream before the end is one"
    with ZephonLoader(_config(dataset, epoch_tail="drop"), output="numpy") as loader:
        assert "fill" not in next(loader)
    with ZephonLoader(_config(dataset, datasets=[{"path": dataset}]), output="numpy") as loader:
        assert "fill" not in next(loader)  # endless data: no fill rows, the batch is as before


def test_fingerprints_of_endless_and_drop_configs_are_unchanged(dataset):
    endless = _config(dataset, datasets=[{"path": dataset}])
    assert "epoch_tail" not in endless.stream_fields() and "overlong" not in endless.stream_fields()
    assert endless.fingerprint() == endless.replace(epoch_tail="drop").fingerprint()
    assert "epoch_tail" not in _config(dataset, epoch_tail="drop").stream_fields()
    assert _config(dataset).stream_fields()["epoch_tail"] == "fill"


def test_a_checkpoint_keeps_its_ending(dataset):
    """A finite checkpoint made before epoch_tail existed (or with "drop") continues only with
    "drop"; one of "fill" only with "fill": the message names the field and the fix."""
    for saved_tail, other in (("drop", "fill"), ("fill", "drop")):
        run = run_stream(_config(dataset, epoch_tail=saved_tail), save_at=2)
        with ZephonLoader(_config(dataset, epoch_tail=other)) as loader:
            with pytest.raises(StateError, match=rf"config.epoch_tail: checkpoint '{saved_tail}', now '{other}'.*"
                                                 rf"set epoch_tail = '{saved_tail}'"):
                loader.load_state_dict(run.state)
        rest = run_stream(_config(dataset, epoch_tail=saved_tail), load_state=run.state)
        assert rest.rows == {i: r for i, r in run_stream(_config(dataset, epoch_tail=saved_tail)).rows.items()
                             if i >= 32}


def test_the_automatic_lane_count_is_the_largest_that_fills_every_lane():
    keys = [f"k{n}" for n in range(300)]
    mask = 0
    for key in keys:
        mask |= lane_mask(0, key)
    chosen = choose_lane_count(mask)
    assert chosen in AUTO_LANE_COUNTS and 64 % chosen == 0
    assert len({lane_of_key(0, key, chosen) for key in keys}) == chosen
    larger = [c for c in AUTO_LANE_COUNTS if c > chosen]
    assert all(len({lane_of_key(0, key, c) for key in keys}) < c for c in larger)
    assert choose_lane_count((1 << 64) - 1) == 64 and choose_lane_count(0) == 0 and choose_lane_count(1) == 1
    # balanced lanes: 8 documents per lane from 16 lanes up, never fewer than 8 lanes where 8 fill
    assert [balanced_lane_count(n) for n in (0, 5, 9, 100, 128, 300, 512, 10**6)] == [0, 4, 8, 8, 16, 32, 64, 64]


def _shard_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loader.cli", "shard", *args, "--runner=FnApiRunner",
                           "--direct_running_mode=in_memory"], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # three `zephon shard` processes (~20 s on 2 busy cores)
def test_shard_without_num_lanes_says_what_it_chose_and_refuses_too_many_lanes_in_one_line(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"id": f"d{k}", "text": t}) + "\n" for k, t in enumerate(marked_texts(300))))
    chosen = _shard_cli("--input", str(source), "--output", str(tmp_path / "auto"), "--id-field", "id")
    assert chosen.returncode == 0, chosen.stderr
    manifest = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert f"into {manifest['num_lanes']} lanes" in chosen.stdout
    assert f"lane count {manifest['num_lanes']} chosen automatically" in chosen.stdout
    bounded = _shard_cli("--input", str(source), "--output", str(tmp_path / "many"), "--num-lanes", "512")
    assert bounded.returncode == 2 and bounded.stderr.count("zephon shard: error:") == 1
    assert "at most 300 documents" in bounded.stderr and "Traceback" not in bounded.stderr
    assert not (tmp_path / "many").exists(), "refused before the pipeline ran"
    empty_lane = _shard_cli("--input", str(source), "--output", str(tmp_path / "l64"), "--id-field", "id",
                            "--num-lanes", "64")
    assert manifest["num_lanes"] < 64, "these 300 keys leave a lane of 64 empty (the hash is pinned)"
    assert empty_lane.returncode == 1 and "Traceback" not in empty_lane.stderr
    assert [line for line in empty_lane.stderr.splitlines() if "lanes received a document" in line] == [
        line for line in empty_lane.stderr.splitlines() if line.startswith("zephon shard: error:")]
    assert empty_lane.stderr.count("received a document") == 1


def test_balanced_lanes_differ_by_at_most_one_document_and_are_recorded(tmp_path):
    source = tmp_path / "docs.jsonl"
    texts = marked_texts(300)
    source.write_text("".join(json.dumps({"id": f"d{k}", "text": t}) + "\n" for k, t in enumerate(texts)))
    manifests = {}
    for name, mode in (("balanced", "in_memory"), ("balanced_mt", "multi_threading"), ("hash", "in_memory")):
        shard.run(["--input", str(source), "--output", str(tmp_path / name), "--id-field", "id", "--num-lanes", "16",
                   *(["--lane-balance", "documents"] if name != "hash" else []),
                   "--runner=FnApiRunner", f"--direct_running_mode={mode}"])
        manifests[name] = read_manifest(str(tmp_path / name))
    balanced = manifests["balanced"]
    per_lane = np.bincount([f.lane for f in balanced.files for _ in range(f.rows)], minlength=16)
    assert per_lane.max() - per_lane.min() <= 1 and balanced.lane_assignment == "balanced"
    assert manifests["balanced_mt"].dataset_fingerprint == balanced.dataset_fingerprint, "runner-dependent lanes"
    assert manifests["hash"].lane_assignment is None and "lane_assignment" not in manifests["hash"].to_dict()
    hash_lanes = np.bincount([f.lane for f in manifests["hash"].files for _ in range(f.rows)], minlength=16)
    assert hash_lanes.max() - hash_lanes.min() > 1  # what balancing is for
    fills = {}
    for name in ("balanced", "hash"):
        stream = run_stream(_config(str(tmp_path / name)))
        found = stream.markers(Tokenizer.from_file(default_tokenizer_path()), 16)
        assert sorted(found) == list(range(300)) and set(found.values()) == {1}
        fills[name] = len(stream.fill_rows()) / len(stream.rows)
    assert fills["balanced"] < fills["hash"], fills
