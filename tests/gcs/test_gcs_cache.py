"""The local lane-file cache: cold/warm, corruption, size bound, concurrent processes."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os

import pyarrow.parquet as pq
import pytest

from loader.io import gcs, storage
from loader.io.cache import LaneFileCache
from loader.io.storage import StorageError, StorageOptions
from tests.gcs.gcs_testing import make_lane_file, upload_lane_file
from tests.gcs.faults import Fault

pytestmark = [pytest.mark.gcs, pytest.mark.timeout(60)]


def cached(proxy, cache_dir, **overrides) -> StorageOptions:
    fields = dict(endpoint=proxy.endpoint, cache_dir=str(cache_dir), retry_initial_backoff_s=0.01,
                  retry_max_backoff_s=0.05, request_timeout_s=5.0)
    fields.update(overrides)
    return StorageOptions(**fields)


def tables(handle) -> list:
    parquet = pq.ParquetFile(handle, page_checksum_verification=True)
    return [parquet.read_row_group(i) for i in range(parquet.num_row_groups)]


def test_cold_then_warm(big_lane_file, proxy, tmp_path):
    options = cached(proxy, tmp_path)
    expected = tables(io.BytesIO(big_lane_file.data))
    with storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options) as cold:
        assert all(a.equals(b) for a, b in zip(tables(cold), expected))
    assert len(proxy.media_gets("part-00000")) == 1  # one streamed download (16 MiB chunks)
    entry_path = LaneFileCache(str(tmp_path), options.cache_max_bytes).entry_path(big_lane_file.entry)
    assert open(entry_path, "rb").read() == big_lane_file.data
    proxy.reset_log()
    with storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options) as warm:
        assert os.path.samefile(warm.name, entry_path)
        assert all(a.equals(b) for a, b in zip(tables(warm), expected))
    assert [r for r in proxy.log if "/o/" in r.path] == []  # a warm open makes no request at all


def test_corrupt_entry_is_deleted_and_fetched_again(small_lane_file, proxy, tmp_path, caplog):
    options = cached(proxy, tmp_path)
    storage.open_lane_file(small_lane_file.dataset, small_lane_file.entry, options).close()
    path = LaneFileCache(str(tmp_path), options.cache_max_bytes).entry_path(small_lane_file.entry)
    with open(path, "r+b") as fh:  # bit rot in place, same size
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 1]))
    proxy.reset_log()
    with storage.open_lane_file(small_lane_file.dataset, small_lane_file.entry, options) as handle:
        assert handle.read() == small_lane_file.data
    assert "is corrupt" in caplog.text and len(proxy.media_gets()) == 1
    with open(path, "r+b") as fh:  # truncated
        fh.truncate(100)
    with storage.open_lane_file(small_lane_file.dataset, small_lane_file.entry, options) as handle:
        assert handle.read() == small_lane_file.data
    assert open(path, "rb").read() == small_lane_file.data


def test_failed_download_leaves_nothing_behind(small_lane_file, proxy, tmp_path):
    options = cached(proxy, tmp_path, retry_max_attempts=2)
    proxy.inject(Fault("reset", count=10))
    with pytest.raises(StorageError, match="retry budget"):
        storage.open_lane_file(small_lane_file.dataset, small_lane_file.entry, options)
    root = LaneFileCache(str(tmp_path), options.cache_max_bytes).root
    assert os.listdir(os.path.join(root, "tmp")) == []
    assert not os.path.exists(LaneFileCache(str(tmp_path), 1).entry_path(small_lane_file.entry))


def test_size_bound_evicts_least_recently_used(emulator, proxy, tmp_path):
    files = [upload_lane_file(emulator, str(tmp_path / "src"), f"lru{k}", make_lane_file(300, 10 + k, 100))
             for k in range(3)]
    sizes = [f.entry.bytes for f in files]
    options = cached(proxy, tmp_path / "cache", cache_max_bytes=sum(sizes) - 1)  # room for two
    cache = LaneFileCache(options.cache_dir, options.cache_max_bytes)

    def use(k: int) -> None:
        storage.open_lane_file(files[k].dataset, files[k].entry, options).close()

    use(0)
    use(1)
    os.utime(cache.entry_path(files[0].entry), (1, 1))  # make 0 clearly the oldest...
    os.utime(cache.entry_path(files[1].entry), (2, 2))
    use(0)  # ...then a hit makes it the most recently used
    use(2)  # needs room: 1 is evicted, not 0
    present = [os.path.exists(cache.entry_path(f.entry)) for f in files]
    assert present == [True, False, True]
    assert cache.usage_bytes() == sizes[0] + sizes[2] <= options.cache_max_bytes


def test_file_larger_than_the_cache_is_read_uncached(big_lane_file, proxy, tmp_path, caplog):
    options = cached(proxy, tmp_path, cache_max_bytes=1024**2)
    handle = storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options)
    assert isinstance(handle, gcs.RangedReader) and "larger than cache_max_bytes" in caplog.text
    assert LaneFileCache(str(tmp_path), 1024**2).usage_bytes() == 0


def _fill_in_child(dataset, entry, options, barrier, results) -> None:
    try:
        barrier.wait(timeout=20)
        with storage.open_lane_file(dataset, entry, options) as handle:
            data = handle.read()
        pq.ParquetFile(io.BytesIO(data), page_checksum_verification=True).read()
        results.put(hashlib.sha256(data).hexdigest())
    except BaseException as exc:  # report, never hang the parent
        results.put(repr(exc))


def test_two_processes_filling_one_entry(big_lane_file, proxy, tmp_path):
    """Both get verified bytes; one downloads while the other waits on the entry's lock."""
    options = cached(proxy, tmp_path)
    proxy.inject(Fault("stall", count=1, stall_s=1.0))  # hold the first download open a while
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    children = [ctx.Process(target=_fill_in_child,
                            args=(big_lane_file.dataset, big_lane_file.entry, options, barrier, results))
                for _ in range(2)]
    for child in children:
        child.start()
    try:
        digests = [results.get(timeout=40) for _ in children]
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    assert digests == [big_lane_file.entry.sha256] * 2
    assert len(proxy.media_gets("part-00000")) == 1  # not one download per process
    assert os.listdir(os.path.join(LaneFileCache(str(tmp_path), 1).root, "tmp")) == []
