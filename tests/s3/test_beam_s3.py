"""The sharding job from ``s3://`` JSONL to an ``s3://`` dataset, streamed by the loader.

The same corpus is sharded twice, from local files to a local dataset and from moto's S3 to
S3 (the job's own s3:// I/O: pinned reads, one PUT per file, the manifest last). Both
datasets must be the same bytes, and every topology read from S3 must give the global
batches of the local dataset read by one rank without workers: W=1 and 2, 0 and 2 worker
processes, and a run resumed across both. The CLI commands (`zephon inspect`,
`fingerprints`, `diff`, `audit`) take the s3:// paths as they take local ones.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from loader.cli import run_command
from loader.config import LoaderConfig
from loader.io import storage
from loader.io.manifest import read_manifest
from tests.resume_harness import check_resume, loader_runs
from tests.s3.s3_testing import TOKENIZER, fingerprint_lines, loader_config

pytestmark = [pytest.mark.s3, pytest.mark.beam, pytest.mark.timeout(120)]

STEPS = 8
LANES = 4


def write_corpus(directory: Path, files: int = 2, per_file: int = 150) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(directory / f"part-{f}.jsonl", "w") as fh:
            for k in range(per_file):
                n = f * per_file + k
                words = " ".join(f"w{(n * 7 + j) % 97}" for j in range(5 + n % 60))
                fh.write(json.dumps({"id": f"doc-{n:05d}", "text": f"document {n}: {words}"}) + "\n")


@pytest.fixture(scope="module")
def sharded(moto_s3, tmp_path_factory):
    """(local dataset, s3:// dataset, s3:// tokenizer): the same corpus sharded on each side."""
    from beam_jobs import shard

    root = tmp_path_factory.mktemp("beam-s3")
    write_corpus(root / "corpus")
    remote_corpus = moto_s3.url("beam/corpus")
    for path in sorted((root / "corpus").iterdir()):
        storage.write_atomically(f"{remote_corpus}/{path.name}", path.read_bytes())
    common = ["--id-field", "id", "--num-lanes", str(LANES), "--seed", "1", "--source-name", "corpus",
              "--target-file-mb", "0.004", "--runner=FnApiRunner"]
    local_dir = str(root / "local")
    remote_dir = moto_s3.url("beam/ds")
    local = shard.run(["--input", str(root / "corpus" / "*.jsonl"), "--output", local_dir, *common])
    remote = shard.run(["--input", f"{remote_corpus}/*.jsonl", "--output", remote_dir, *common])
    tokenizer = moto_s3.url("beam/tokenizer.json")
    storage.write_atomically(tokenizer, Path(TOKENIZER).read_bytes())
    return local, remote, local_dir, remote_dir, tokenizer


def make_config(path: str, **overrides) -> LoaderConfig:
    return loader_config(path, seq_len=128, **overrides)


def fingerprints(config: LoaderConfig, world_size: int = 1) -> list[str]:
    return fingerprint_lines(config, STEPS, world_size)


@pytest.fixture(scope="module")
def reference(sharded) -> list[str]:
    _, _, local_dir, _, _ = sharded
    lines = fingerprints(make_config(local_dir))
    assert len(set(line.split()[1] for line in lines)) == STEPS  # distinct batches: not vacuous
    return lines


def test_s3_job_writes_the_local_dataset(sharded):
    local, remote, local_dir, remote_dir, _ = sharded
    assert remote.dataset_fingerprint == local.dataset_fingerprint
    assert read_manifest(remote_dir).to_dict() == local.to_dict()
    assert len(remote.files) > LANES  # several parts per lane
    for entry in remote.files:
        with open(os.path.join(local_dir, entry.path), "rb") as fh:
            assert storage.read_bytes(storage.join(remote_dir, entry.path)) == fh.read(), entry.path
    written = storage.list_prefix(remote_dir + "/")
    assert not [p for p in written if p.endswith(".inprogress")]  # one PUT per object, no temporaries
    assert f"{remote_dir}/manifest.json" in written


def test_s3_dataset_streams_the_local_batches_at_w1_and_w2(sharded, reference):
    _, _, _, remote_dir, tokenizer = sharded
    config = make_config(remote_dir, tokenizer=tokenizer)  # the tokenizer read from s3:// too
    assert fingerprints(config) == reference
    assert fingerprints(config, world_size=2) == reference


def test_resume_across_world_sizes_from_s3(sharded, reference, tmp_path):
    _, _, _, remote_dir, _ = sharded
    config = make_config(remote_dir, cache_dir=str(tmp_path / "cache"))  # through the node-shared cache
    make = loader_runs(config, [{"world_size": 1}, {"world_size": 2}, {"world_size": 1}, {"world_size": 2}])
    check_resume(make, steps=STEPS, cut_points=[3, 5], expected=reference)


@pytest.mark.timeout(240)
def test_workers_read_s3_and_resume(sharded, reference, tmp_path):
    """Two spawned workers per rank find the store through the AWS_* variables they inherit,
    and fill one node-shared cache (each file once, complete and verified)."""
    local, _, _, remote_dir, _ = sharded
    config = make_config(remote_dir)
    cache_dir = tmp_path / "cache"
    assert fingerprints(config.replace(num_workers=2, cache_dir=str(cache_dir))) == reference
    cached = sorted(p.name for p in (cache_dir / "zephon-cache-v1" / "objects").rglob("*.parquet"))
    assert cached == sorted(f"{f.sha256}-{f.bytes}.parquet" for f in local.files)
    assert list((cache_dir / "zephon-cache-v1" / "tmp").iterdir()) == []
    make = loader_runs(config, [{"world_size": 1}, {"world_size": 2, "num_workers": 2}, {"world_size": 1}])
    check_resume(make, steps=STEPS, cut_points=[4], expected=reference, compare_states=False)


def test_cli_takes_s3_paths(sharded, reference, tmp_path, capsys):
    local, _, local_dir, remote_dir, tokenizer = sharded
    assert run_command("inspect", [remote_dir, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset_fingerprint"] == local.dataset_fingerprint
    configs = {}
    for name, path in (("local", local_dir), ("s3", remote_dir)):
        configs[name] = tmp_path / f"{name}.json"
        configs[name].write_text(json.dumps({"datasets": [{"path": path}], "seq_len": 128, "global_batch_size": 8,
                                             "micro_batch_size": 2, "seed": 3, "tokenizer": tokenizer}))
    state = tmp_path / "state.json"
    assert run_command("fingerprints", [str(configs["s3"]), "--steps", f"0:{STEPS}",
                                        "--save-state", "2", str(state)]) == 0
    assert capsys.readouterr().out.splitlines() == reference
    assert run_command("diff", [str(configs["local"]), str(configs["s3"]), "--steps", "0:4"]) == 0
    capsys.readouterr()
    assert run_command("audit", [str(configs["s3"]), "--step", "3", "--load-state", str(state), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 3 and len(report["sequences"]) == 8
    assert all(p["key"].startswith("doc-") for seq in report["sequences"] for p in seq["pieces"])


def test_unsupported_output_scheme_is_one_line(capsys, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, files=1, per_file=20)
    code = run_command("shard", ["--input", str(corpus / "*.jsonl"), "--output", "az://container/ds",
                                 "--num-lanes", "2", "--runner=FnApiRunner"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("zephon shard: error: --output az://container/ds: the storage scheme az:// is not "
                             "supported; supported: gs://, s3://")


def test_image_job_reads_images_from_s3(moto_s3, tmp_path, capsys):
    """Relative image paths resolved against an s3:// --image-root: the dataset of a local root."""
    from beam_jobs import shard
    from tests.vision.image_factory import image_bytes

    images = tmp_path / "images"
    (images / "img").mkdir(parents=True)
    records = []
    for i in range(12):
        data = image_bytes(30 + i, 20 + i, "PNG", seed=i)
        (images / "img" / f"{i:02d}.png").write_bytes(data)
        storage.write_atomically(moto_s3.url(f"images/img/{i:02d}.png"), data)
        records.append(json.dumps({"id": f"im-{i:02d}", "image": f"img/{i:02d}.png", "text": f"picture {i}"}))
    (tmp_path / "records.jsonl").write_text("\n".join(records) + "\n")
    common = ["--input", str(tmp_path / "records.jsonl"), "--id-field", "id", "--num-lanes", "2",
              "--image-field", "image", "--runner=FnApiRunner"]
    local = shard.run([*common, "--output", str(tmp_path / "local"), "--image-root", str(images)])
    remote = shard.run([*common, "--output", str(tmp_path / "remote"), "--image-root", moto_s3.url("images")])
    assert remote.dataset_fingerprint == local.dataset_fingerprint
    assert remote.documents == 12 and sum(remote.rejected.values()) == 0
    capsys.readouterr()
    code = run_command("shard", [*common, "--output", str(tmp_path / "az"), "--image-root", "az://c/images"])
    assert code == 2
    assert "--image-root az://c/images: the storage scheme az:// is not supported" in capsys.readouterr().err


def test_existing_s3_output_is_refused_then_overwritten(moto_s3, tmp_path):
    from beam_jobs import shard
    from beam_jobs.outputs import OutputExistsError

    write_corpus(tmp_path / "corpus", files=1, per_file=60)
    output = moto_s3.url("beam/overwrite")
    stale = f"{output}/lane=00009/part-00000.parquet"  # a lane this run does not have
    storage.write_atomically(stale, b"left by an older job")
    args = ["--input", str(tmp_path / "corpus" / "*.jsonl"), "--output", output, "--num-lanes", "2",
            "--id-field", "id", "--runner=FnApiRunner"]
    with pytest.raises(OutputExistsError, match=re.escape(f"--output {output} already holds a dataset")):
        shard.run(args)
    manifest = shard.run([*args, "--overwrite"])
    assert not storage.exists(stale) and read_manifest(output).to_dict() == manifest.to_dict()


def test_a_storage_failure_while_reading_an_input_fails_the_job():
    """The store failing is not bad data: the records are not rejected, the job stops."""
    from beam_jobs.outputs import ShardJobError
    from beam_jobs.records import _guarded

    def reads():
        yield b"first line\n"
        raise storage.StorageError("s3://b/in.jsonl changed while being read (HTTP 412 ...)")

    items = _guarded(reads())
    assert next(items) == b"first line\n"
    with pytest.raises(ShardJobError, match=re.escape("zephon shard: s3://b/in.jsonl changed while being read")):
        next(items)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_multi_processing_workers_write_the_same_s3_dataset(sharded, moto_s3):
    """Beam's worker processes find the store through the AWS_* variables they inherit."""
    from beam_jobs import shard

    local, _, _, _, _ = sharded
    common = ["--id-field", "id", "--num-lanes", str(LANES), "--seed", "1", "--source-name", "corpus",
              "--target-file-mb", "0.004"]
    manifest = shard.run(["--input", f"{moto_s3.url('beam/corpus')}/*.jsonl", "--output", moto_s3.url("beam/mp"),
                          *common, "--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    assert manifest.to_dict() == local.to_dict()
