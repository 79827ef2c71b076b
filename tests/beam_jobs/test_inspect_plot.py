"""``zephon inspect DATASET --plot FILE.png``: the figure holds the dataset's lengths, lanes
and records, recomputed here from the documents written (not from the manifest's numbers).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from beam_jobs.inspect_plot import dataset_figure, document_lengths, histogram_bins
from loader.samples import default_tokenizer_path
from loader import cli
from loader.order.hashing import file_bucket, lane_of_key, order_key_of
from loader.io.manifest import MANIFEST_NAME, lane_file_path, read_manifest
from tests.dataset_factory import synthetic_texts, write_dataset

LANES = 4
SEED = 9
REJECTS = {"empty_text": 3, "malformed_json": 5}


@pytest.fixture(scope="module")
def texts():
    return synthetic_texts(150, seed=31, max_words=60)


def _dataset(path, texts, tokenizer=None) -> str:
    write_dataset(str(path), texts, num_lanes=LANES, seed=SEED, source_name="web", tokenizer=tokenizer,
                  files_per_lane=2, row_group_rows=8)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["rejected"] = REJECTS  # not part of the dataset fingerprint
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return str(path)


def _file_of(doc: int) -> str:
    """The lane file document ``doc`` was written to, from the hashes alone."""
    key = f"doc-{doc:07d}"
    return lane_file_path(lane_of_key(SEED, key, LANES), file_bucket(order_key_of(SEED, key), 2))


def _axes(figure) -> dict:
    return {ax.get_label(): ax for ax in figure.axes}


def test_pretokenized_plot_holds_token_lengths_lanes_and_rejects(tmp_path, texts, capsys):
    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    path = _dataset(tmp_path / "web", texts, tokenizer)
    out = tmp_path / "web.png"
    assert cli.main(["inspect", path, "--plot", str(out)]) == 0
    assert f"plot           {out} (lengths in tokens of 150 documents from 8 of 8 lane files)" in capsys.readouterr().out
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 800
        image.verify()

    token_counts = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    manifest = read_manifest(path)
    lengths = document_lengths(path, manifest, 0)
    assert lengths.unit == "tokens" and sorted(lengths.values.tolist()) == sorted(token_counts)
    axes = _axes(dataset_figure(manifest, lengths, path))

    bins = histogram_bins(np.array(token_counts))
    heights = [p.get_height() for p in axes["lengths"].patches]
    assert heights == np.histogram(token_counts, bins=bins)[0].tolist() and sum(heights) == len(texts)
    assert "tokens" in axes["lengths"].get_xlabel()

    per_lane = [0] * LANES
    for k, count in enumerate(token_counts):
        per_lane[lane_of_key(SEED, f"doc-{k:07d}", LANES)] += count
    assert [p.get_height() for p in axes["lanes"].patches] == per_lane
    assert axes["lanes"].get_ylabel() == "tokens"

    assert [p.get_width() for p in axes["records"].patches] == [len(texts), 5, 3]
    assert [t.get_text() for t in axes["records"].get_yticklabels()] == [
        "kept (web)", "rejected: malformed_json", "rejected: empty_text"]


def test_text_plot_measures_characters_and_samples_files(tmp_path, texts, capsys):
    path = _dataset(tmp_path / "text", texts)
    out = tmp_path / "text.png"
    assert cli.main(["inspect", path, "--plot", str(out), "--plot-max-files", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["plot"]["length_unit"] == "characters" and summary["plot"]["files_read"] == 3
    with Image.open(out) as image:
        image.verify()

    manifest = read_manifest(path)
    lengths = document_lengths(path, manifest, 3)
    ordered = sorted(manifest.files, key=lambda f: (f.lane, f.part))
    sampled = {ordered[0].path, ordered[len(ordered) // 2].path, ordered[-1].path}  # evenly spaced, both ends
    expected = [len(t) for k, t in enumerate(texts) if _file_of(k) in sampled]
    assert sorted(lengths.values.tolist()) == sorted(expected) and 0 < len(expected) < len(texts)
    all_lengths = document_lengths(path, manifest, 0)
    assert sorted(all_lengths.values.tolist()) == sorted(len(t) for t in texts)  # code points, not bytes
    axes = _axes(dataset_figure(manifest, all_lengths, path))
    assert axes["lanes"].get_ylabel() == "documents"
    per_lane = [0] * LANES
    for k in range(len(texts)):
        per_lane[lane_of_key(SEED, f"doc-{k:07d}", LANES)] += 1
    assert [p.get_height() for p in axes["lanes"].patches] == per_lane


def test_plot_errors_are_one_line(tmp_path, texts, monkeypatch, capsys):
    path = _dataset(tmp_path / "text", texts)
    assert cli.main(["inspect", path, "--plot", str(tmp_path / "x.bmpx")]) == 2
    assert "cannot tell the image type from the extension 'bmpx'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["inspect", path, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install matplotlib" in err
