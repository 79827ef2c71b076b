"""The ``s3://`` backend against moto's S3 server: reads, writes, pins, checksums, schemes."""

from __future__ import annotations

import hashlib
import io
import re

import pyarrow.parquet as pq
import pytest

from loader.config import LoaderConfig
from loader.io import backends, storage
from loader.io.backends import UnsupportedSchemeError
from loader.io.manifest import FileEntry, read_manifest
from loader.order.hashing import sha256_hex
from loader.io.remote_files import RangedReader
from loader.io.storage import StorageError, StorageNotFoundError, StorageOptions
from tests.gcs.gcs_testing import make_lane_file
from tests.s3.s3_testing import raw_client

pytestmark = [pytest.mark.s3, pytest.mark.timeout(60)]

WINDOW = StorageOptions(readahead_bytes=4096)


@pytest.fixture(scope="module")
def lane_bytes() -> bytes:
    return make_lane_file(rows=400, seed=2, row_group_rows=100)  # ~200 KB, 4 row groups


def test_write_list_read_stat_delete(moto_s3):
    base = moto_s3.url("basic")
    storage.write_atomically(f"{base}/a/one.bin", b"one" * 1000)
    storage.write_atomically(f"{base}/a/two.bin", b"two")
    assert storage.exists(base) and storage.exists(f"{base}/a/one.bin") and not storage.exists(f"{base}/b")
    assert storage.list_prefix(f"{base}/a/") == [f"{base}/a/one.bin", f"{base}/a/two.bin"]
    assert storage.read_bytes(f"{base}/a/one.bin") == b"one" * 1000
    info = backends.backend_for(base).stat(f"{base}/a/one.bin", StorageOptions())
    assert info.size == 3000 and info.version.startswith('etag:"')
    # The backend uploads with ChecksumAlgorithm=SHA256: S3 keeps the object's digest.
    assert info.checksum == "sha256:" + hashlib.sha256(b"one" * 1000).hexdigest()
    backends.backend_for(base).delete(f"{base}/a/two.bin", StorageOptions())
    assert not storage.exists(f"{base}/a/two.bin")
    assert storage.join(base, "lane=00000", "part-00000.parquet") == f"{base}/lane=00000/part-00000.parquet"


def test_ranged_reader_reads_parquet_by_row_group(moto_s3, lane_bytes):
    url = moto_s3.url("ranged/part.parquet")
    storage.write_atomically(url, lane_bytes)
    handle = storage.open_input(url, WINDOW)
    assert isinstance(handle, RangedReader)
    table = pq.ParquetFile(handle, page_checksum_verification=True).read_row_group(2)
    assert table == pq.ParquetFile(io.BytesIO(lane_bytes)).read_row_group(2)
    assert 1 < handle.requests < len(lane_bytes) // 4096  # footer + one row group, not the file


def test_object_replaced_mid_read_fails_naming_it(moto_s3):
    """Unversioned bucket: the ETag pinned at open is sent as If-Match; a rewrite is a 412."""
    url = moto_s3.url("pin/replaced.bin")
    storage.write_atomically(url, b"a" * 20_000)
    handle = storage.open_input(url, WINDOW)
    assert handle.read(10) == b"a" * 10
    storage.write_atomically(url, b"b" * 20_000)  # same size, new bytes
    handle.seek(10_000)
    with pytest.raises(StorageError, match=re.escape(f"{url} changed while being read")) as caught:
        handle.read(10)
    assert "re-run the Beam job" in str(caught.value)


def test_object_deleted_mid_read_fails_naming_it(moto_s3):
    url = moto_s3.url("pin/deleted.bin")
    storage.write_atomically(url, b"a" * 20_000)
    handle = storage.open_input(url, WINDOW)
    handle.read(10)
    raw_client(moto_s3.endpoint).delete_object(Bucket=moto_s3.bucket, Key="pin/deleted.bin")
    handle.seek(10_000)
    with pytest.raises(StorageNotFoundError, match=re.escape(f"{url} does not exist")):
        handle.read(10)


def test_versioned_bucket_keeps_reading_the_opened_version(moto_s3):
    """Versioned bucket: reads name the version id seen at open, so a rewrite changes nothing."""
    client = raw_client(moto_s3.endpoint)
    client.create_bucket(Bucket="zephon-versioned")
    client.put_bucket_versioning(Bucket="zephon-versioned", VersioningConfiguration={"Status": "Enabled"})
    url = "s3://zephon-versioned/pinned.bin"
    old = bytes(range(256)) * 100
    storage.write_atomically(url, old)
    handle = storage.open_input(url, WINDOW)
    assert backends.backend_for(url).stat(url, StorageOptions()).version not in (None, "null")
    first = handle.read(5000)
    storage.write_atomically(url, b"\x00" * len(old))
    raw_client(moto_s3.endpoint).delete_object(Bucket="zephon-versioned", Key="pinned.bin")  # a delete marker
    assert first + handle.read() == old
    with pytest.raises(StorageNotFoundError):  # a new open sees the delete marker
        storage.open_input(url, WINDOW)


def test_lane_file_replaced_after_the_manifest_is_refused_before_reading(moto_s3, lane_bytes, tmp_path):
    """S3's own SHA-256 (kept from the upload) against the manifest's, before any data moves."""
    metadata = pq.ParquetFile(io.BytesIO(lane_bytes)).metadata
    entry = FileEntry(path="lane=00000/part-00000.parquet", lane=0, part=0, rows=metadata.num_rows,
                      bytes=len(lane_bytes), sha256=sha256_hex(lane_bytes), row_groups=metadata.num_row_groups)
    dataset = moto_s3.url("swap")
    storage.write_atomically(f"{dataset}/{entry.path}", lane_bytes)
    for options in (StorageOptions(), StorageOptions(whole_file_max_bytes=0), StorageOptions(cache_dir=str(tmp_path))):
        with storage.open_lane_file(dataset, entry, options) as handle:
            assert pq.ParquetFile(handle).metadata.num_rows == entry.rows
    forged = bytearray(lane_bytes)
    forged[len(forged) // 2] ^= 0xFF
    storage.write_atomically(f"{dataset}/{entry.path}", bytes(forged))
    with pytest.raises(StorageError, match=re.escape(f"{dataset}/{entry.path}: S3's SHA-256 of the object")):
        storage.open_lane_file(dataset, entry, StorageOptions(whole_file_max_bytes=0))  # even a ranged open


# -- schemes ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["az://container/data", "hf://datasets/x", "http://example.invalid/ds"])
def test_unsupported_scheme_is_refused_listing_the_supported_ones(path):
    with pytest.raises(UnsupportedSchemeError) as caught:
        read_manifest(path)
    message = str(caught.value)
    scheme = path.split("://")[0]
    assert message.startswith(f"{path}: the storage scheme {scheme}:// is not supported; supported: gs://, s3://")
    assert isinstance(caught.value, StorageError)


def test_a_config_keeps_remote_paths_as_given(tmp_path):
    """A config file's relative paths resolve against its folder; s3:// (and az://) are never local."""
    config_file = tmp_path / "loader.json"
    config_file.write_text('{"datasets": [{"path": "s3://bucket/prose"}, {"path": "az://c/x"}], "seq_len": 8, '
                           '"global_batch_size": 2, "micro_batch_size": 1, "seed": 0, "tokenizer": "s3://b/t.json"}')
    config = LoaderConfig.from_file(str(config_file))
    assert [d.path for d in config.datasets] == ["s3://bucket/prose", "az://c/x"]
    assert config.tokenizer == "s3://b/t.json"


def test_missing_bucket_names_the_bucket_and_the_fix(moto_s3):
    with pytest.raises(StorageNotFoundError) as caught:
        read_manifest("s3://zephon-no-such-bucket/ds")
    message = str(caught.value)
    assert "the bucket 'zephon-no-such-bucket' does not exist at endpoint " + moto_s3.endpoint in message
    assert "AWS_ENDPOINT_URL" in message
