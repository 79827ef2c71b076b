"""A new kind is one module: the test-only ``utf8-bytes`` kind (tests/kinds/utf8_bytes_kind.py).

No core file names it. Importing its module registers it with the loader and with the Beam
job; the real job (in-memory runner) shards records with ``--kind utf8-bytes``, the manifest
records ``"kind": "utf8-bytes"``, and the loader decodes its lanes with it: the tokens are the
documents' UTF-8 bytes (checked against the records, multi-byte characters included). Through
the elastic matrix: the same global batches for W 1/2/4, 0 or 2 worker processes (which import
the kind's module by name: loader.kinds.base.kind_modules), concat and best_fit, and across
resumes on other topologies (tests/resume_harness.py).
"""

from __future__ import annotations

import json
import random
import time
from contextlib import closing

import numpy as np
import pytest

import tests.kinds.utf8_bytes_kind as utf8_bytes_kind  # registers the kind (loader and Beam sides)
from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.config import LoaderConfig
from loader.errors import ConfigError, ManifestError, ShardConfigError
from loader.io.manifest import Manifest, read_manifest
from loader.kinds.base import kind_modules, lane_kind, named_kinds, register_kind, unregister_kind
from loader.pipeline import ZephonLoader
from tests.resume_harness import LoaderRun, check_resume

BEAM_IN_MEMORY = ("--runner=FnApiRunner", "--direct_running_mode=in_memory")
NUM_LANES = 8
STEPS = 10
EOS = 0  # the shipped tokenizer's <|endoftext|>; no document holds a NUL byte
# (world_size, num_workers, micro_batch_size) of a global batch of 8; the first is the reference
TOPOLOGIES = ((1, 0, 2), (2, 2, 4), (4, 0, 1), (1, 2, 8))
RESUME = ((1, 0, 8), (2, 2, 2), (4, 0, 1))
WORDS = ("zephon", "lane", "naïve", "façade", "日本語", "данные", "🙂", "Ω", "straße", "kind", "bytes", "ok")


def _documents(count: int) -> list[str]:
    rng = random.Random(33)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 16))) + f" #{k}" for k in range(count)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    base = tmp_path_factory.mktemp("utf8_bytes")
    texts = _documents(400)
    source = base / "in.jsonl"
    source.write_text("".join(json.dumps({"id": k, "text": t}, ensure_ascii=False) + "\n"
                              for k, t in enumerate(texts)), encoding="utf-8")
    output = str(base / "lanes")
    shard.run(["--input", str(source), "--output", output, "--id-field", "id", "--kind", utf8_bytes_kind.NAME,
               "--num-lanes", str(NUM_LANES), "--target-file-mb", "0.001", *BEAM_IN_MEMORY])
    return output, texts


def _config(path: str, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": path}], seq_len=64, global_batch_size=8, micro_batch_size=2, seed=5,
                  tokenizer=default_tokenizer_path(), num_workers=0, prefetch=2, worker_timeout_s=60.0)
    fields.update(overrides)
    return LoaderConfig(**fields)


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
    loader = ZephonLoader(_config(path, packing=packing, micro_batch_size=8, seq_len=256))
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


def _run_on(config, world_size: int, num_workers: int, micro: int) -> LoaderRun:
    """A run whose worker processes (if any) serve from its first batch: without the wait the
    loader reads in-process until they are ready (its warm start), and a short run might never
    reach them, so the kind's import in the workers would go untested."""
    run = LoaderRun(config.replace(num_workers=num_workers, micro_batch_size=micro), world_size)
    deadline = time.monotonic() + 60
    while num_workers and not all(loader._pool.all_ready() for loader in run.loaders):
        assert time.monotonic() < deadline, "worker processes did not start"
        time.sleep(0.05)
    return run


def _lines(config, world_size: int, num_workers: int, micro: int) -> list[str]:
    with closing(_run_on(config, world_size, num_workers, micro)) as run:
        lines = run.run(STEPS)
        assert all(not loader._run.warm_start for loader in run.loaders) or not num_workers  # the workers served
        return lines


@pytest.mark.slow  # ~40 s each on 2 busy cores: 7 loader runs, 3 of them starting worker processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_batches_are_the_same_on_every_topology_and_across_resumes(dataset, packing):
    path, _ = dataset
    config = _config(path, packing=packing)
    reference = _lines(config, *TOPOLOGIES[0])
    assert len(reference) == STEPS
    for topology in TOPOLOGIES[1:]:
        assert _lines(config, *topology) == reference, f"(W, workers, micro) = {topology}"

    def make(k: int) -> LoaderRun:
        world_size, num_workers, micro = RESUME[k % len(RESUME)]
        return _run_on(config, world_size, num_workers, micro)

    check_resume(make, steps=STEPS, cut_points=[3, 7], expected=reference)


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
            loader = ZephonLoader(_config(path))
            try:
                next(iter(loader))
            finally:
                loader.close()
    finally:
        register_kind(utf8_bytes_kind.UTF8_BYTES)
