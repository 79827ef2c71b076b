"""Reading lane files and manifests from gs:// (emulator): same tables as local, ranged reads."""

from __future__ import annotations

import io
import json
import os

import pyarrow.parquet as pq
import pytest

from loader.io import gcs, storage
from loader.io.manifest import Manifest, read_manifest
from loader.io.storage import StorageNotFoundError, StorageOptions

pytestmark = pytest.mark.gcs


def _read_all_row_groups(handle, columns=("key", "order_key", "text")):
    parquet = pq.ParquetFile(handle, page_checksum_verification=True)
    return [parquet.read_row_group(i, columns=list(columns)) for i in range(parquet.num_row_groups)]


def test_ranged_reads_give_the_local_tables(big_lane_file, proxy):
    options = StorageOptions(endpoint=proxy.endpoint)
    handle = storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options)
    assert isinstance(handle, gcs.RangedReader)
    remote = _read_all_row_groups(handle)
    local = _read_all_row_groups(storage.open_lane_file(big_lane_file.local_dataset, big_lane_file.entry))
    assert len(remote) == big_lane_file.entry.row_groups == 12
    assert all(r.equals(l) for r, l in zip(remote, local))
    gets = proxy.media_gets("part-00000.parquet")
    assert gets and all(g.range and g.range.startswith("bytes=") for g in gets), gets
    fetched = sum(int(g.range.split("-")[1]) - int(g.range[6:].split("-")[0]) + 1 for g in gets)
    # The 8 MiB window clips at the object's end: the whole file moves about once, never twice.
    assert fetched < 2 * big_lane_file.entry.bytes


def test_one_row_group_moves_about_its_own_bytes(big_lane_file, proxy):
    """Seeking to a row group (resume) fetches the footer and that group, not the object."""
    options = StorageOptions(endpoint=proxy.endpoint, readahead_bytes=256 * 1024)
    parquet = pq.ParquetFile(storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options),
                             page_checksum_verification=True)
    proxy.reset_log()
    table = parquet.read_row_group(7, columns=["text"])
    expected = pq.ParquetFile(io.BytesIO(big_lane_file.data)).read_row_group(7, columns=["text"])
    assert table.equals(expected)
    group_bytes = parquet.metadata.row_group(7).column(2).total_compressed_size
    fetched = sum(int(g.range.split("-")[1]) - int(g.range[6:].split("-")[0]) + 1 for g in proxy.media_gets())
    assert fetched <= group_bytes + 256 * 1024, (fetched, group_bytes)
    assert fetched < big_lane_file.entry.bytes / 4


def test_small_files_are_fetched_whole_and_checked(small_lane_file, proxy):
    options = StorageOptions(endpoint=proxy.endpoint)
    handle = storage.open_lane_file(small_lane_file.dataset, small_lane_file.entry, options)
    assert isinstance(handle, io.BytesIO) and handle.getvalue() == small_lane_file.data
    assert len(proxy.media_gets()) == 1
    local = _read_all_row_groups(storage.open_lane_file(small_lane_file.local_dataset, small_lane_file.entry))
    assert all(r.equals(l) for r, l in zip(_read_all_row_groups(handle), local))


def test_manifest_through_storage(emulator, small_lane_file):
    manifest = Manifest(seed=1, num_lanes=1, source_name="small",
                        schema=[{"name": "key", "type": "string"}], files=[small_lane_file.entry],
                        documents=small_lane_file.entry.rows).with_fingerprint()
    gcs.write_bytes(f"{small_lane_file.dataset}/manifest.json", manifest.to_json().encode(), content_type="application/json")
    assert storage.exists(small_lane_file.dataset)  # a "directory": objects lie under it
    assert storage.exists(storage.join(small_lane_file.dataset, "manifest.json"))
    assert not storage.exists(storage.join(small_lane_file.dataset, "nope.json"))
    assert json.loads(storage.read_bytes(storage.join(small_lane_file.dataset, "manifest.json")))["seed"] == 1
    assert read_manifest(small_lane_file.dataset) == manifest
    assert gcs.list_prefix(small_lane_file.dataset + "/") == sorted(
        [small_lane_file.url, f"{small_lane_file.dataset}/manifest.json"])


def test_open_input_is_a_seekable_file(big_lane_file):
    with storage.open_input(big_lane_file.url) as handle:
        assert handle.seekable() and handle.readable()
        assert handle.seek(0, os.SEEK_END) == len(big_lane_file.data)
        handle.seek(-10, os.SEEK_END)
        assert handle.read() == big_lane_file.data[-10:]
        handle.seek(123)
        assert handle.read(1000) == big_lane_file.data[123:1123]
        assert handle.read(5) == big_lane_file.data[1123:1128]  # served by the window
        buffer = bytearray(7)
        assert handle.readinto(buffer) == 7 and bytes(buffer) == big_lane_file.data[1128:1135]
    with pytest.raises(ValueError):
        handle.read(1)


def test_missing_objects_are_named(emulator):
    url = emulator.url("no/such/object.parquet")
    with pytest.raises(StorageNotFoundError, match="gs://zephon-test/no/such/object.parquet"):
        storage.open_input(url)
    with pytest.raises(FileNotFoundError):
        gcs.read_bytes(url)
    assert not storage.exists(url)
    assert not storage.exists("gs://no-such-bucket-zephon/x")


def test_client_is_per_process_and_recreated_after_fork(emulator):
    import multiprocessing

    parent = gcs.client()
    assert gcs.client() is parent
    with multiprocessing.get_context("fork").Pool(1) as pool:
        fresh, listed = pool.apply(_child_uses_a_fresh_client, (emulator.url("small/"),))
    assert fresh and listed  # the child started without the parent's client, and made its own
    assert gcs.client() is parent


def _child_uses_a_fresh_client(prefix: str) -> tuple[bool, bool]:
    fresh = not gcs._clients
    return fresh, bool(gcs.list_prefix(prefix))
