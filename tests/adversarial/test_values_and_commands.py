"""Values out of range and bare exceptions in commands (issue 28, classes 3 and 6).

* A tokens transform returning ids that are negative, at or above the vocabulary size, or past
  int32 (where they used to wrap into other valid-looking ids) is a ``TransformError`` naming
  the transform and the document; the last valid id passes.
* ``zephon audit`` of a dataset transformed offline (tombstones) rebuilds every audited step
  from the lane files exactly as the training loader delivers it, past the first row group
  (it crashed with ``AttributeError`` on any block after the first).
* ``zephon diff`` on malformed logs (non-ASCII digits, numbers int() refuses) exits 2 with one
  ``zephon diff: error:`` line: never a bare ``ValueError`` with exit 1 ("the runs differ").
* A manifest that is not UTF-8, or nested too deep for the JSON parser, is a ``ManifestError``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from beam_jobs import shard
from loader.samples import default_tokenizer_path
from loader.cli import run_command
from loader.commands.audit import audit_step
from loader.config import LoaderConfig
from loader.io.manifest import MANIFEST_NAME, ManifestError, read_manifest
from loader.pipeline import ZephonLoader
from loader.stages.tokenizer import load_tokenizer
from loader.transforms.spec import TransformError
from tests.audit.conftest import rebuild_from_documents, step_batch
from tests.dataset_factory import synthetic_texts

HOSTILE = "tests.adversarial.hostile_transforms:"
VOCAB = load_tokenizer(default_tokenizer_path()).get_vocab_size()

# ---------------------------------------------------------------------------------------
# token ids out of range

OUT_OF_RANGE = [(-1, "int64"), (-2**31, "int64"), (-7, "int32"), (VOCAB, "int64"), (VOCAB + 1, "int32"),
                (2**31 - 1, "int64"), (2**31, "int64"), (2**32 + 5, "int64"), (2**40, "int64"),
                (2**63 - 1, "int64"), (2**64 - 1, "uint64"), (2**32, "uint64")]


@pytest.mark.parametrize("value,dtype", OUT_OF_RANGE, ids=[f"{v}-{d}" for v, d in OUT_OF_RANGE])
def test_ids_out_of_range_from_a_transform_are_refused_by_name(make_config, corpus, value, dtype):
    transform = {"function": HOSTILE + "set_id", "args": {"value": value, "dtype": dtype}}
    config = make_config("concat", pretokenized=True).replace(
        datasets=[{"path": corpus.pretokenized_path, "transforms": [transform]}])
    with pytest.raises(TransformError, match=rf"set_id.*input_id {value}.*document '.+'.*below"):
        with ZephonLoader(config) as loader:
            for _ in range(3):
                next(loader)


def test_the_last_id_of_the_vocabulary_passes(make_config, corpus):
    transform = {"function": HOSTILE + "set_id", "args": {"value": VOCAB - 1}}
    config = make_config("concat", pretokenized=True).replace(
        datasets=[{"path": corpus.pretokenized_path, "transforms": [transform]}])
    with ZephonLoader(config) as loader:
        batch = next(loader)
    assert int(batch["input_ids"].max()) == VOCAB - 1


# ---------------------------------------------------------------------------------------
# zephon audit of a dataset transformed offline


@pytest.fixture(scope="module")
def transformed_offline(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("audit_offline")
    texts = synthetic_texts(160, seed=7, max_words=20)
    (base / "in.jsonl").write_text("".join(json.dumps({"id": f"d{k}", "text": t}) + "\n" for k, t in enumerate(texts)))
    shard.run(["--input", str(base / "in.jsonl"), "--output", str(base / "out"), "--id-field", "id",
               "--num-lanes", "2", "--transform", "tests.transforms.functions:drop_multiple_of_three",
               "--tokenizer", default_tokenizer_path(), "--target-file-mb", "0.0004",
               "--runner=FnApiRunner", "--direct_running_mode=in_memory"])
    assert read_manifest(str(base / "out")).tombstones > 0
    return str(base / "out")


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_the_audit_of_an_offline_transformed_dataset_rebuilds_every_step(transformed_offline, packing):
    config = LoaderConfig(datasets=[{"path": transformed_offline, "name": "web"}], seq_len=16, global_batch_size=4,
                          micro_batch_size=2, seed=1, tokenizer=default_tokenizer_path(), packing=packing,
                          num_workers=0, best_fit_open_bins=3)
    for step in (0, 2, 7, 15, 31):  # past the first row group of every lane (a few documents each)
        ids, (token_format, pad_id) = step_batch(config, step)
        audit = audit_step(config, step)
        rebuilt = rebuild_from_documents(audit, {"web": transformed_offline}, token_format, pad_id, config.seq_len)
        assert rebuilt.tolist() == ids.tolist(), f"step {step}"


# ---------------------------------------------------------------------------------------
# zephon diff on malformed logs

SHA = "a" * 64
MALFORMED_LINES = [f"² {SHA}", f"{'9' * 5000} {SHA}", f"1 {SHA} web={'9' * 5000}", f"١٢ {SHA}",
                   f"3 {SHA} web=²", f"4 {SHA} supervised: web={'1' * 19}", f"{'1' * 19} {SHA}"]


@pytest.mark.parametrize("line", MALFORMED_LINES, ids=range(len(MALFORMED_LINES)))
def test_zephon_diff_of_a_malformed_log_is_a_data_error_not_runs_differ(tmp_path, capsys, line):
    good, bad = tmp_path / "good.log", tmp_path / "bad.log"
    good.write_text(f"0 {SHA}\n")
    bad.write_text(f"0 {SHA}\n{line}\n")
    assert run_command("diff", [str(good), str(bad)], debug=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zephon diff: error:") and "bad.log:2" in err[0]


# ---------------------------------------------------------------------------------------
# manifests that are not UTF-8 JSON

MANIFEST_DAMAGE = {
    "latin1_byte": lambda raw: raw.replace(b'"', b'"\xe9', 1),
    "utf16": lambda raw: raw.decode("utf-8").encode("utf-16"),
    "truncated_utf8": lambda raw: raw[:20] + "é".encode("utf-8")[:1],
    "nul_and_ff": lambda raw: b"\xff\xfe\x00" + raw,
    "nested_too_deep": lambda raw: b"[" * 200_000 + b"]" * 200_000,
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_a_manifest_that_is_not_utf8_json_is_a_manifest_error(corpus, tmp_path, damage):
    copy = tmp_path / "dataset"
    shutil.copytree(corpus.pretokenized_path, copy)
    path = copy / MANIFEST_NAME
    path.write_bytes(MANIFEST_DAMAGE[damage](path.read_bytes()))
    with pytest.raises(ManifestError, match=str(path)):
        read_manifest(str(copy))


# ---------------------------------------------------------------------------------------
# mixing_unit = "token" with an image source


def test_token_mixing_with_one_image_source_is_refused(tmp_path):
    from tests.adversarial.test_stored_bytes import DYNAMIC, image_config, image_tokenizer, shard_images
    from loader.config import ConfigError

    dataset = shard_images(tmp_path, tmp_path / "images", 8, DYNAMIC)
    config = image_config([{"path": dataset}], image_tokenizer(tmp_path / "tokenizer.json"), mixing_unit="token")
    with pytest.raises(ConfigError, match='images.*mixing_unit = "token"'):
        ZephonLoader(config)
