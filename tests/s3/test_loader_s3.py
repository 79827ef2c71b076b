"""The loader on ``s3://``: the local batches through faults and the cache, or a loud error.

A small text dataset (4 lanes, one file per lane, row groups of 4 documents so a lane reads
its file over several steps) is written locally by :mod:`tests.dataset_factory` and copied
to moto object by object, manifest last. The reference is the local dataset's fingerprints.
Requests go through the fault proxy where a test says so (``storage.s3_endpoint_url``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from beam_jobs.image_records import _Reject, read_image_file
from dataset_factory import synthetic_texts, write_dataset
from loader.chat import load_chat_template
from loader.config import LoaderConfig
from loader.io import storage
from loader.io.storage import StorageError, StorageNotFoundError, StorageOptions
from loader.pipeline import ZephonLoader
from loader.vision.images import ImageLimits
from tests.resume_harness import LoaderRun
from tests.s3.s3_testing import S3Fault, fingerprint_lines, loader_config, raw_client, upload_tree

pytestmark = [pytest.mark.s3, pytest.mark.timeout(90)]

TEMPLATE = str(Path(__file__).resolve().parents[1] / "chat" / "templates" / "chatml_generation.jinja")
STEPS = 10
FIRST_FILE = "lane=00000/part-00000.parquet"


@pytest.fixture(scope="module")
def dataset(moto_s3, tmp_path_factory) -> tuple[str, str]:
    local = str(tmp_path_factory.mktemp("s3-loader") / "text")
    write_dataset(local, synthetic_texts(160, seed=5), num_lanes=4, seed=11, files_per_lane=1, row_group_rows=4,
                  source_name="web")
    remote = moto_s3.url("loader/text")
    upload_tree(local, remote)
    return local, remote


@pytest.fixture
def private_copy(dataset, moto_s3, request) -> str:
    """An s3:// copy of the dataset for a test that damages objects (``bucket`` given by the test)."""
    bucket = getattr(request, "param", moto_s3.bucket)
    remote = f"s3://{bucket}/damaged/{request.node.name}".replace("[", "-").replace("]", "")
    upload_tree(dataset[0], remote)
    return remote


def make_config(path: str, **overrides) -> LoaderConfig:
    return loader_config(path, seq_len=256, **overrides)


def fingerprints(config: LoaderConfig) -> list[str]:
    return fingerprint_lines(config, STEPS)


@pytest.fixture(scope="module")
def reference(dataset) -> list[str]:
    return fingerprints(make_config(dataset[0]))


RANGED = {"whole_file_max_bytes": 0, "readahead_bytes": 2048}


def lane_file_gets(proxy) -> list:
    return [r for r in proxy.object_gets("part-")]


@pytest.mark.parametrize("reads", ["whole", "ranged"])
def test_transient_faults_leave_batches_unchanged(dataset, reference, s3_proxy, quick_backoff, reads):
    faults = [S3Fault("status", status=503, code="SlowDown", match="head"), S3Fault("status", status=503),
              S3Fault("reset"), S3Fault("truncate"), S3Fault("status", status=500, code="InternalError")]
    s3_proxy.inject(*faults)
    storage_table = {"s3_endpoint_url": s3_proxy.endpoint, **(RANGED if reads == "ranged" else {})}
    assert fingerprints(make_config(dataset[1], storage=storage_table)) == reference
    assert s3_proxy.pending() == 0 and len([r for r in s3_proxy.log if r.fault]) == len(faults)


def test_cache_cold_then_warm(dataset, reference, s3_proxy, tmp_path):
    config = make_config(dataset[1], storage={"s3_endpoint_url": s3_proxy.endpoint},
                         cache_dir=str(tmp_path / "cache"))
    assert fingerprints(config) == reference
    cold = lane_file_gets(s3_proxy)
    assert cold and len({r.path for r in cold}) == len(cold)  # each file downloaded once
    s3_proxy.reset_log()
    assert fingerprints(config) == reference
    assert [r for r in s3_proxy.log if "part-" in r.path] == []  # warm: not even a HEAD


def forge(url: str) -> None:
    """Rewrite ``url`` with other bytes of the same size (the manifest's size check passes)."""
    original = storage.read_bytes(url)
    storage.write_atomically(url, original[:4] + bytes(b ^ 0x55 for b in original[4:-8]) + original[-8:])


def test_lane_object_replaced_mid_run_fails_naming_it(private_copy):
    """Unversioned bucket: the open file's ETag no longer matches; the next ranged GET is a 412."""
    url = f"{private_copy}/{FIRST_FILE}"
    run = LoaderRun(make_config(private_copy, storage=RANGED, read_ahead=False))
    try:
        assert len(run.run(1)) == 1
        forge(url)
        with pytest.raises(StorageError, match=re.escape(f"{url} changed while being read")):
            run.run(STEPS - 1)
    finally:
        run.close()


@pytest.fixture(scope="module")
def versioned_bucket(moto_s3) -> str:
    client = raw_client(moto_s3.endpoint)
    client.create_bucket(Bucket="zephon-versioned-loader")
    client.put_bucket_versioning(Bucket="zephon-versioned-loader", VersioningConfiguration={"Status": "Enabled"})
    return "zephon-versioned-loader"


def test_lane_object_replaced_in_a_versioned_bucket_keeps_the_opened_version(dataset, reference, versioned_bucket):
    """Versioned bucket: reads name the version id seen at open, so the run gives the local batches."""
    remote = f"s3://{versioned_bucket}/text"
    upload_tree(dataset[0], remote)
    run = LoaderRun(make_config(remote, storage=RANGED, read_ahead=False))
    try:
        lines = run.run(1)
        forge(f"{remote}/{FIRST_FILE}")
        lines += run.run(STEPS - 1)
    finally:
        run.close()
    assert lines == reference
    # A new open pins the new version, whose S3 SHA-256 is not the manifest's: refused before reading.
    with pytest.raises(StorageError, match=re.escape(f"{remote}/{FIRST_FILE}: S3's SHA-256 of the object")):
        fingerprints(make_config(remote, storage=RANGED))


def test_deleted_lane_object_names_it(private_copy):
    url = f"{private_copy}/{FIRST_FILE}"
    storage.backend_for(url).delete(url, StorageOptions())
    with pytest.raises(StorageNotFoundError, match=re.escape(f"{url} does not exist")) as caught:
        fingerprints(make_config(private_copy))
    assert "re-run the Beam job or restore" in str(caught.value)


def test_missing_bucket_in_a_config_names_it():
    with pytest.raises(StorageNotFoundError, match="the bucket 'zephon-absent' does not exist"):
        ZephonLoader(make_config("s3://zephon-absent/text"))


def test_chat_template_and_image_paths_on_s3(moto_s3):
    template = moto_s3.url("assets/chatml.jinja")
    storage.write_atomically(template, Path(TEMPLATE).read_bytes())
    assert load_chat_template(template).sources == load_chat_template(TEMPLATE).sources
    image = moto_s3.url("assets/pixel.png")
    storage.write_atomically(image, b"\x89PNG-bytes")
    limits = ImageLimits()
    assert read_image_file(image, limits) == b"\x89PNG-bytes"
    with pytest.raises(_Reject) as caught:
        read_image_file(moto_s3.url("assets/gone.png"), limits)
    assert caught.value.reason == "image_missing"


def test_a_remote_image_is_read_once_from_its_pinned_version_and_bounded(moto_s3, monkeypatch):
    from loader.io import remote_files

    image = moto_s3.url("assets/big.png")
    storage.write_atomically(image, b"x" * 5000)
    fetched = []
    real_fetch = remote_files.RangedReader._get
    monkeypatch.setattr(remote_files.RangedReader, "_get",
                        lambda self, start, end: fetched.append(end - start) or real_fetch(self, start, end))
    with pytest.raises(_Reject) as caught:
        read_image_file(image, ImageLimits(max_bytes=4096))
    assert caught.value.reason == "image_too_large" and fetched == []  # refused on the size alone
    assert read_image_file(image, ImageLimits(max_bytes=5000)) == b"x" * 5000 and len(fetched) == 1
