"""``zephon shard --s3-endpoint-url / --s3-region / --s3-profile / --storage-*``: the job's own S3 options.

``AWS_ENDPOINT_URL`` is removed from the environment, so the only way the job (its launcher
and every worker) can find moto's server is the ``--s3-endpoint-url`` flag it was given:
the options must travel with the steps. An s3:// -> s3:// job must then write the bytes
of the same job run on local files, in-process and with two worker processes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from loader.cli import run_command
from loader.io import storage
from loader.io.manifest import read_manifest
from loader.io.storage_options import StorageOptions
from tests.s3.s3_testing import TOKENIZER

pytestmark = [pytest.mark.s3, pytest.mark.beam, pytest.mark.timeout(180)]

LANES = 2


def corpus_files() -> dict[str, bytes]:
    """Two input files (plain and gzip) with one record without text: a rejection to write too."""
    lines = [json.dumps({"id": f"doc-{n:03d}", "text": f"document {n}: " + " ".join(f"w{(n * 5 + j) % 31}"
                                                                                  for j in range(3 + n % 17))})
             for n in range(40)]
    lines[7] = json.dumps({"id": "doc-007", "body": "no text field"})
    return {"part-0.jsonl": "\n".join(lines[:20]).encode() + b"\n",
            "part-1.jsonl.gz": gzip.compress(("\n".join(lines[20:]) + "\n").encode(), mtime=0)}


def job_args(inputs: str, output: str, tokenizer: str) -> list[str]:
    return ["--input", inputs, "--output", output, "--id-field", "id", "--num-lanes", str(LANES), "--seed", "2",
            "--source-name", "flags", "--tokenizer", tokenizer, "--target-file-mb", "0.0003",
            "--max-reject-fraction", "0.1"]


@pytest.fixture
def no_endpoint_variable(moto_s3, monkeypatch):
    """moto's endpoint URL, with ``AWS_ENDPOINT_URL`` gone from this process and every child it starts."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    return moto_s3.endpoint


@pytest.fixture
def local_run(tmp_path):
    """The local job: its corpus folder and its manifest."""
    from beam_jobs import shard

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, data in corpus_files().items():
        (corpus / name).write_bytes(data)
    output = tmp_path / "local"
    manifest = shard.run([*job_args(str(corpus / "*.jsonl*"), str(output), TOKENIZER), "--runner=FnApiRunner"])
    assert manifest.rejected["missing_text_field"] == 1 and manifest.documents == 39
    return output, manifest


def upload_corpus(options: StorageOptions, prefix: str) -> tuple[str, str]:
    for name, data in corpus_files().items():
        storage.write_atomically(f"{prefix}/corpus/{name}", data, options)
    storage.write_atomically(f"{prefix}/tokenizer.json", Path(TOKENIZER).read_bytes(), options)
    return f"{prefix}/corpus/*.jsonl*", f"{prefix}/tokenizer.json"


def assert_same_dataset(remote: str, local: Path, options: StorageOptions) -> None:
    manifest = read_manifest(str(local))
    remote_manifest = read_manifest(remote, options)
    assert remote_manifest.dataset_fingerprint == manifest.dataset_fingerprint
    assert len(manifest.files) > LANES  # several parts per lane: more than one write per lane
    for entry in manifest.files:
        assert storage.read_bytes(f"{remote}/{entry.path}", options) == (local / entry.path).read_bytes(), entry.path
    assert storage.read_bytes(f"{remote}/manifest.json", options) == (local / "manifest.json").read_bytes()
    # the rejection names its input file: the same but for where the corpus is
    name = "_rejected/rejected-00000.jsonl"
    remote_rejected = json.loads(storage.read_bytes(f"{remote}/{name}", options))
    local_rejected = json.loads((local / name).read_bytes())
    assert remote_rejected.pop("input_file").endswith("/corpus/part-0.jsonl")
    assert local_rejected.pop("input_file").endswith("/corpus/part-0.jsonl")
    assert remote_rejected == local_rejected and remote_rejected["reason"] == "missing_text_field"


def shard_cli(args: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = run_command("shard", args)
    return code, capsys.readouterr().err.strip().splitlines()


def test_endpoint_given_only_by_flag_shards_s3_to_s3(no_endpoint_variable, local_run, moto_s3, capsys):
    options = StorageOptions(s3_endpoint_url=no_endpoint_variable)
    inputs, tokenizer = upload_corpus(options, moto_s3.url("flags/inprocess"))
    output = moto_s3.url("flags/inprocess/ds")
    flags = ["--s3-endpoint-url", no_endpoint_variable, "--s3-region", "us-east-1", "--runner=FnApiRunner"]
    code, err = shard_cli([*job_args(inputs, output, tokenizer), *flags], capsys)
    assert code == 0, err
    local, _ = local_run
    assert_same_dataset(output, local, options)
    # listing, refusing and deleting the old dataset go through the flags too
    code, err = shard_cli([*job_args(inputs, output, tokenizer), *flags], capsys)
    assert code == 1 and err[-1].startswith(f"zephon shard: error: --output {output} already holds a dataset")
    code, err = shard_cli([*job_args(inputs, output, tokenizer), *flags, "--overwrite"], capsys)
    assert code == 0, err
    assert_same_dataset(output, local, options)


def test_without_the_flag_the_job_does_not_find_the_store(no_endpoint_variable, moto_s3, capsys):
    """The control: the environment really holds no endpoint, so the flag is what made the job work."""
    inputs, tokenizer = upload_corpus(StorageOptions(s3_endpoint_url=no_endpoint_variable), moto_s3.url("flags/none"))
    code, err = shard_cli([*job_args(inputs, moto_s3.url("flags/none/ds"), tokenizer), "--runner=FnApiRunner",
                           "--storage-retry-max-attempts", "1", "--storage-request-timeout-s", "2"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"zephon shard: error: --input {inputs}: listing failed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_processes_receive_the_storage_flags(no_endpoint_variable, local_run, moto_s3, capsys):
    options = StorageOptions(s3_endpoint_url=no_endpoint_variable)
    inputs, tokenizer = upload_corpus(options, moto_s3.url("flags/workers"))
    output = moto_s3.url("flags/workers/ds")
    code, err = shard_cli([*job_args(inputs, output, tokenizer), "--s3-endpoint-url", no_endpoint_variable,
                           "--direct_running_mode=multi_processing", "--direct_num_workers=2"], capsys)
    assert code == 0, err
    assert_same_dataset(output, local_run[0], options)


def test_unknown_profile_is_one_error_line_naming_it(moto_s3, tmp_path, monkeypatch, capsys):
    config = tmp_path / "aws-config"
    config.write_text("[profile datasets]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    code, err = shard_cli(["--input", moto_s3.url("flags/any/*.jsonl"), "--output", str(tmp_path / "ds"),
                           "--s3-profile", "datsets", "--runner=FnApiRunner"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("zephon shard: error: --s3-profile 'datsets' is not a profile of the AWS config files")
    assert "profiles there: datasets" in err[0]


def test_bad_storage_flag_values_are_one_error_line(tmp_path, capsys):
    code, err = shard_cli(["--input", str(tmp_path / "*.jsonl"), "--output", str(tmp_path / "ds"),
                           "--storage-retry-max-attempts", "0", "--s3-region", ""], capsys)
    assert code == 2 and len(err) == 1
    assert err[0] == ("zephon shard: error: --s3-region must be a non-empty string, or absent (got ''); "
                      "--storage-retry-max-attempts must be an integer >= 1 (got 0)")


def test_named_images_are_read_with_the_flags(no_endpoint_variable, moto_s3, tmp_path):
    """``ReadFiles`` reads an image job's named images from an s3:// --image-root with the flags' endpoint."""
    from beam_jobs import shard
    from tests.vision.image_factory import image_bytes

    options = StorageOptions(s3_endpoint_url=no_endpoint_variable)
    images = tmp_path / "images"
    images.mkdir()
    records = []
    for i in range(4):
        data = image_bytes(24 + i, 16 + i, "PNG", seed=i)
        (images / f"{i}.png").write_bytes(data)
        storage.write_atomically(moto_s3.url(f"flags/images/{i}.png"), data, options)
        records.append(json.dumps({"id": f"im-{i}", "image": f"{i}.png", "text": f"picture {i}"}))
    (tmp_path / "records.jsonl").write_text("\n".join(records) + "\n")
    common = ["--input", str(tmp_path / "records.jsonl"), "--id-field", "id", "--num-lanes", "2",
              "--image-field", "image", "--runner=FnApiRunner"]
    local = shard.run([*common, "--output", str(tmp_path / "local"), "--image-root", str(images)])
    remote = shard.run([*common, "--output", str(tmp_path / "remote"), "--image-root", moto_s3.url("flags/images"),
                        "--s3-endpoint-url", no_endpoint_variable])
    assert remote.documents == 4 and sum(remote.rejected.values()) == 0
    assert remote.dataset_fingerprint == local.dataset_fingerprint
