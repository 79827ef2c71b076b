"""A new kind is one module: the test-only ``utf8-bytes`` kind (tests/kinds/utf8_bytes_kind.py).

No core file names it. Importing its module registers it with the loader and with the Beam
job; the real job (in-memory runner) shards records with ``--kind utf8-bytes``, the manifest
records ``"kind": "utf8-bytes"``, and the loader decodes its lanes with it: the tokens are the
documents' UTF-8 bytes (checked against the records, multi-byte characters included). The
dataset is written by ``tests/kinds/conftest.py``; the elastic matrix (``tests/elastic``) streams
the same kind and dataset on every topology, its worker processes importing the kind's module
by name (``loader.kinds.base.kind_modules``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tests.kinds.utf8_bytes_kind as utf8_bytes_kind  # registers the kind (loader and Beam sides)
from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.errors import ConfigError, ManifestError, ShardConfigError
from loader.io.manifest import Manifest, read_manifest
from loader.kinds.base import kind_modules, lane_kind, named_kinds, register_kind, unregister_kind
from loader.pipeline import ZephonLoader
from tests.kinds.conftest import NUM_LANES, utf8_config

STEPS = 10
EOS = 0  # the shipped tokenizer's <|endoftext|>; no document holds a NUL byte


def test_the_job_records_the_kind_and_the_loader_picks_it_by_name(dataset):
    path, texts = dataset
    manifest = read_manifest(path)
    assert manifest.kind == utf8_bytes_kind.NAME and not manifest.pretokenized
    assert manifest.documents == len(texts) and len({f.lane for f in manifest.files}) == NUM_LANES
    assert len(manifest.files) > NUM_LANES  # several files per lane: epochs permute files too
    assert utf8_bytes_kind.NAME in named_kinds()
    assert kind_modules() == ("tests.kinds.utf8_bytes_kind",)  # what worker processes import
    assert lane_kind(manifest.kind, pretokenized=False) is utf8_bytes_kind.UTF8_BYTES
    with open(f"{path}/manifest.json") as fh:
        data = json.load(fh)
    assert data["kind"] == utf8_bytes_kind.NAME
    # The kind is in the fingerprint: the same lanes without the entry are another dataset.
    without = {k: v for k, v in data.items() if k != "kind"}
    with pytest.raises(ManifestError, match="does not match its content"):
        Manifest.from_dict(without)


def test_an_unknown_kind_is_refused_naming_the_registered_ones(dataset, tmp_path):
    path, _ = dataset
    with pytest.raises(ManifestError, match=r"'kind' is 'audio'.*registered named kinds: utf8-bytes"):
        lane_kind("audio", pretokenized=False)
    with pytest.raises(ShardConfigError, match=r"--kind 'audio' is not a registered lane kind.*registered: utf8-bytes"):
        shard.parse_args(["--input", "x.jsonl", "--output", str(tmp_path / "o"), "--kind", "audio"])
    with pytest.raises(ShardConfigError, match="cannot be combined with --tokenizer"):
        shard.parse_args(["--input", "x.jsonl", "--output", str(tmp_path / "o"), "--kind", utf8_bytes_kind.NAME,
                          "--tokenizer", default_tokenizer_path()])


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_the_tokens_are_the_documents_utf8_bytes(dataset, packing):
    path, texts = dataset
    documents = {t.encode("utf-8") for t in texts}
    whole, multibyte = set(), 0
    loader = ZephonLoader(utf8_config(path, packing=packing, micro_batch_size=8, seq_len=256))
    try:
        for _, batch in zip(range(STEPS), loader):
            ids = np.asarray(batch["input_ids"])
            assert ids.min() >= 0 and ids.max() <= 255
            for row in ids:
                runs = bytes(row.astype(np.uint8)).split(bytes([EOS]))
                for k, run in enumerate(runs):
                    if not run:  # best_fit's padding (pad = EOS); no document is empty
                        continue
                    if 0 < k < len(runs) - 1:  # between two EOS: a whole document
                        assert run in documents, run[:40]
                        whole.add(run)
                        multibyte += any(b >= 0x80 for b in run)
                    else:  # cut by the row's ends: a piece of a document
                        assert any(run in d for d in documents), run[:40]
    finally:
        loader.close()
    assert len(whole) >= 20 and multibyte >= 10


def test_kind_module_imports_the_kind_for_the_job_and_a_missing_one_is_an_error(tmp_path):
    options, _ = shard.parse_args(["--input", "x.jsonl", "--output", str(tmp_path / "o"),
                                   "--kind-module", "tests.kinds.utf8_bytes_kind", "--kind", utf8_bytes_kind.NAME])
    assert options.kind == utf8_bytes_kind.NAME and options.record_spec().kind == utf8_bytes_kind.NAME
    with pytest.raises(ShardConfigError, match=r"--kind-module: No module named 'no_such_kinds'"):
        shard.parse_args(["--input", "x.jsonl", "--output", str(tmp_path / "o"), "--kind-module", "no_such_kinds"])


def test_a_kind_defined_in_main_is_refused_when_workers_need_it(monkeypatch):
    class ScriptKind(utf8_bytes_kind.Utf8BytesKind):
        name = "script-bytes"

    monkeypatch.setattr(ScriptKind, "__module__", "__main__")
    register_kind(ScriptKind())
    try:
        with pytest.raises(ConfigError, match=r"'script-bytes' is defined in the __main__ script.*num_workers=0"):
            kind_modules()
    finally:
        unregister_kind("script-bytes")
    assert kind_modules() == ("tests.kinds.utf8_bytes_kind",)


def test_the_manifest_kind_entry_is_checked(dataset):
    path, _ = dataset
    with open(f"{path}/manifest.json") as fh:
        data = json.load(fh)
    with pytest.raises(ManifestError, match=r"field 'kind' must be absent or a lane kind's name \(got 3\)"):
        Manifest.from_dict({**data, "kind": 3})
    with pytest.raises(ManifestError, match=r"field 'kind' \('utf8-bytes'\) names a lane kind of its own.*'tokenizer'"):
        Manifest.from_dict({**data, "tokenizer": {"fingerprint": "0" * 64, "vocab_size": 256}})


def test_the_loader_refuses_a_dataset_whose_kind_no_module_registers(dataset):
    path, _ = dataset
    unregister_kind(utf8_bytes_kind.NAME)
    try:
        with pytest.raises(ManifestError, match=r"field 'kind' is 'utf8-bytes', which no imported module registers"):
            loader = ZephonLoader(utf8_config(path))
            try:
                next(iter(loader))
            finally:
                loader.close()
    finally:
        register_kind(utf8_bytes_kind.UTF8_BYTES)
