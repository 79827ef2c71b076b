"""Fault injection between the loader and the emulator: retries, budgets, clear errors."""

from __future__ import annotations

import io
import time

import pyarrow.parquet as pq
import pytest

from loader.io import gcs, storage
from loader.io.storage import StorageError, StorageNotFoundError, StorageOptions
from tests.gcs.gcs_testing import make_lane_file, upload_lane_file
from tests.gcs.faults import Fault

pytestmark = [pytest.mark.gcs, pytest.mark.timeout(30)]


def fast_retries(endpoint: str, **overrides) -> StorageOptions:
    """Tiny backoff so retry tests take milliseconds; a 1 s timeout for stalled requests."""
    fields = dict(endpoint=endpoint, retry_initial_backoff_s=0.01, retry_max_backoff_s=0.05,
                  retry_deadline_s=20.0, request_timeout_s=1.0)
    fields.update(overrides)
    return StorageOptions(**fields)


def object_requests(proxy) -> list:
    return [r for r in proxy.log if "/o/" in r.path]


def read_tables(handle) -> list:
    parquet = pq.ParquetFile(handle, page_checksum_verification=True)
    return [parquet.read_row_group(i) for i in range(parquet.num_row_groups)]


@pytest.mark.parametrize("fault", [
    Fault("status", count=3, status=503),
    Fault("status", count=3, status=429),
    Fault("status", count=2, status=500),
    Fault("reset", count=3),
    Fault("truncate", count=3),
    Fault("stall", count=1, stall_s=2.0),
], ids=["503", "429", "500", "reset", "truncate", "stall"])
def test_transient_faults_on_ranged_reads_are_retried(big_lane_file, proxy, fault):
    options = fast_retries(proxy.endpoint, readahead_bytes=512 * 1024)  # many requests to hit
    expected = read_tables(io.BytesIO(big_lane_file.data))
    proxy.inject(Fault(fault.kind, count=1, match="metadata", status=fault.status, stall_s=fault.stall_s), fault)
    handle = storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options)
    assert isinstance(handle, gcs.RangedReader)
    assert all(a.equals(b) for a, b in zip(read_tables(handle), expected))
    assert proxy.pending() == 0  # every injected fault was hit (and survived)


@pytest.mark.parametrize("kind", ["status", "reset", "truncate", "corrupt"])
def test_transient_faults_on_whole_downloads_are_retried(small_lane_file, proxy, kind):
    """A corrupted body fails the manifest sha256 and is fetched once more."""
    options = fast_retries(proxy.endpoint)
    proxy.inject(Fault(kind, count=1))
    handle = storage.open_lane_file(small_lane_file.dataset, small_lane_file.entry, options)
    assert handle.read() == small_lane_file.data
    assert proxy.pending() == 0
    assert len(proxy.media_gets()) == 2


def test_manifest_reads_are_retried(emulator, proxy):
    gcs.write_bytes(emulator.url("notes/notes.json"), b'{"a": 1}')
    proxy.inject(Fault("status", count=2, status=503), Fault("truncate", count=1))
    data = gcs.read_bytes(emulator.url("notes/notes.json"), fast_retries(proxy.endpoint))
    assert data == b'{"a": 1}' and proxy.pending() == 0


def test_deleted_object_fails_promptly_with_its_name(emulator, proxy, tmp_path):
    lane = upload_lane_file(emulator, str(tmp_path), "deleted", make_lane_file(24_000, 3, 2_000))
    options = fast_retries(proxy.endpoint, readahead_bytes=256 * 1024)
    parquet = pq.ParquetFile(storage.open_lane_file(lane.dataset, lane.entry, options))
    gcs.client().bucket(emulator.bucket).blob(f"deleted/{lane.entry.path}").delete()
    start = time.monotonic()
    with pytest.raises(StorageNotFoundError, match="gs://zephon-test/deleted/lane=00000/part-00000.parquet"):
        parquet.read_row_group(5)
    with pytest.raises(StorageNotFoundError, match="re-run the Beam job or restore"):
        storage.open_lane_file(lane.dataset, lane.entry, options)
    assert time.monotonic() - start < 2  # a 404 is permanent: no retries, no backoff


def test_object_with_other_content_is_refused(emulator, proxy, tmp_path):
    original = make_lane_file(400, 4, 100)
    lane = upload_lane_file(emulator, str(tmp_path), "swapped", original)
    forged = bytearray(original)
    forged[len(forged) // 2] ^= 0xFF  # same size, different bytes
    gcs.write_bytes(lane.url, bytes(forged))
    with pytest.raises(StorageError, match=r"swapped/lane=00000/part-00000.parquet: content does not match"):
        storage.open_lane_file(lane.dataset, lane.entry, fast_retries(proxy.endpoint))
    assert len(proxy.media_gets()) == 2  # fetched twice (a transit error is retried), then refused
    gcs.write_bytes(lane.url, original[:-10])
    with pytest.raises(StorageError, match=r"has \d+ bytes but the manifest says"):
        storage.open_lane_file(lane.dataset, lane.entry, fast_retries(proxy.endpoint))
    # Without checksums the swap goes unnoticed here; Parquet page checksums remain.
    gcs.write_bytes(lane.url, bytes(forged))
    handle = storage.open_lane_file(lane.dataset, lane.entry, fast_retries(proxy.endpoint, verify_checksums=False))
    assert handle.read() == bytes(forged)


def test_corrupt_ranged_bytes_are_caught_by_page_checksums(big_lane_file, proxy):
    """In-transit damage on a ranged read (no TLS here) surfaces as an error, never as data."""
    options = fast_retries(proxy.endpoint, readahead_bytes=8 * 1024**2)
    handle = storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, options)
    parquet = pq.ParquetFile(handle, page_checksum_verification=True)
    proxy.inject(Fault("corrupt", count=1))
    with pytest.raises(OSError, match="(?i)checksum|corrupt|invalid"):
        for group in range(parquet.num_row_groups):  # the flipped byte is mid-window
            parquet.read_row_group(group)


def test_spent_retry_budget_is_a_clear_error(big_lane_file, proxy):
    proxy.inject(Fault("status", count=1000, status=503, match="any"))
    start = time.monotonic()
    with pytest.raises(StorageError, match=r"still failing after 3 attempts.*retry_max_attempts=3"):
        storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry,
                               fast_retries(proxy.endpoint, retry_max_attempts=3))
    # (google-cloud-storage 3.x also fetches bucket metadata once per client, in a background
    # thread, for its tracing attributes; only object requests are counted.)
    assert len(object_requests(proxy)) == 3
    with pytest.raises(StorageError, match=r"retry_deadline_s=0.5"):
        storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry,
                               fast_retries(proxy.endpoint, retry_max_attempts=1000, retry_deadline_s=0.5,
                                            retry_initial_backoff_s=0.1, retry_max_backoff_s=0.2))
    assert time.monotonic() - start < 3


def test_permanent_errors_are_not_retried(big_lane_file, proxy):
    proxy.inject(Fault("status", count=1000, status=403, match="any"))
    with pytest.raises(StorageError, match=r"zephon-test/big/lane=00000/part-00000.parquet: access denied \(HTTP 403\)"):
        storage.open_lane_file(big_lane_file.dataset, big_lane_file.entry, fast_retries(proxy.endpoint))
    assert len(object_requests(proxy)) == 1


def test_backoff_is_full_jitter_within_the_cap():
    policy = gcs.RetryPolicy.from_options(StorageOptions(retry_initial_backoff_s=0.5, retry_max_backoff_s=4.0))
    for retry_index, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        samples = [policy.backoff_s(retry_index) for _ in range(200)]
        assert all(0.0 <= s <= cap for s in samples)
        assert max(samples) > cap / 2  # spread over the whole interval, not a fixed delay
