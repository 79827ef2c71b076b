"""S3 faults, each exact or loud within the retry budget: throttling, resets, cut bodies, a
server that stops, a missing bucket, wrong or missing credentials.

Transient faults come from the proxy in front of moto (:class:`tests.s3.s3_testing.S3FaultProxy`,
S3's XML errors); the server faults from stopping a dedicated moto server; the credential
faults from moto's own signature checks (switched on for the test) or an empty environment.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from loader.io import storage
from loader.io.storage import StorageError, StorageOptions
from tests.s3.s3_testing import S3Fault, restart_on, start_server

pytestmark = [pytest.mark.s3, pytest.mark.timeout(60)]

DATA = bytes(range(256)) * 400  # 100 KiB


def put(moto_s3, name: str) -> str:
    url = moto_s3.url(f"faults/{name}")
    storage.write_atomically(url, DATA)
    return url


def via(proxy, **fields) -> StorageOptions:
    return StorageOptions(s3_endpoint_url=proxy.endpoint, readahead_bytes=16 * 1024, **fields)


TRANSIENT = [
    S3Fault("status", status=503, code="SlowDown", match="head"),
    S3Fault("status", status=503, code="SlowDown"),
    S3Fault("status", status=500, code="InternalError"),
    S3Fault("reset"),
    S3Fault("truncate"),  # full Content-Length, half the body, then a reset
    S3Fault("reset", match="head"),
]


def test_transient_faults_give_identical_bytes(moto_s3, s3_proxy, quick_backoff):
    url = put(moto_s3, "transient.bin")
    s3_proxy.inject(*TRANSIENT)
    handle = storage.open_input(url, via(s3_proxy))
    got = b"".join(iter(lambda: handle.read(10_000), b""))
    assert got == DATA
    assert s3_proxy.pending() == 0  # every fault was hit, and survived
    assert storage.read_bytes(url, via(s3_proxy)) == DATA


def test_bytes_damaged_in_transit_are_fetched_again(moto_s3, s3_proxy, quick_backoff):
    """A whole-object GET is checked against S3's SHA-256 of the object (boto3, ChecksumMode)."""
    url = put(moto_s3, "damaged.bin")
    s3_proxy.inject(S3Fault("corrupt"))
    assert storage.read_bytes(url, via(s3_proxy)) == DATA
    assert s3_proxy.pending() == 0 and len(s3_proxy.object_gets("damaged")) == 2


def test_throttling_past_the_budget_is_loud_and_bounded(moto_s3, s3_proxy, quick_backoff):
    url = put(moto_s3, "throttled.bin")
    s3_proxy.inject(S3Fault("status", status=503, code="SlowDown", match="any", count=1000))
    start = time.monotonic()
    with pytest.raises(StorageError) as caught:
        storage.read_bytes(url, via(s3_proxy, retry_max_attempts=4))
    message = str(caught.value)
    assert message.startswith(f"{url}: cannot download: still failing after 4 attempts")
    assert "SlowDown" in message and "retry budget" in message
    assert len(s3_proxy.log) == 4 and time.monotonic() - start < 10


def test_server_stopped_mid_read_is_loud_within_the_deadline(moto_s3):
    server, endpoint = start_server()
    url = put(moto_s3, "stopped.bin")  # moto's state is per process: this server serves it too
    options = StorageOptions(s3_endpoint_url=endpoint, readahead_bytes=16 * 1024, retry_deadline_s=2.0,
                             retry_initial_backoff_s=0.2, request_timeout_s=2.0)
    handle = storage.open_input(url, options)
    assert handle.read(1000) == DATA[:1000]
    server.stop()
    handle.seek(50_000)
    start = time.monotonic()
    with pytest.raises(StorageError) as caught:
        handle.read(1000)
    elapsed = time.monotonic() - start
    assert re.match(re.escape(f"{url}: cannot read bytes 50000-") + r"\d+: still failing after \d+ attempts",
                    str(caught.value))
    assert "check the network" in str(caught.value)
    assert elapsed < 2.0 + 2.0 + 1.0  # the deadline, plus one request in flight, plus slack


def test_server_back_within_the_budget_gives_identical_bytes(moto_s3):
    server, endpoint = start_server()
    url = put(moto_s3, "restarted.bin")
    options = StorageOptions(s3_endpoint_url=endpoint, readahead_bytes=16 * 1024, retry_deadline_s=20.0,
                             retry_initial_backoff_s=0.2, retry_max_backoff_s=1.0)
    handle = storage.open_input(url, options)
    first = handle.read(30_000)
    server.stop()
    restarted: list = []
    timer = threading.Timer(1.0, lambda: restarted.append(restart_on(endpoint)))
    timer.start()
    try:
        rest = handle.read()
    finally:
        timer.join()
        for again in restarted:
            again.stop()
    assert restarted and first + rest == DATA


def test_missing_object_is_not_retried(moto_s3, s3_proxy):
    url = moto_s3.url("faults/never-written.bin")
    start = time.monotonic()
    with pytest.raises(storage.StorageNotFoundError, match=re.escape(f"{url} does not exist")):
        storage.open_input(url, via(s3_proxy))
    assert time.monotonic() - start < 2  # a 404 is permanent: no budget spent
    assert len([r for r in s3_proxy.log if r.method == "HEAD"]) == 1


def test_wrong_credentials_name_the_object_and_the_fix(moto_s3, tmp_path, monkeypatch):
    """moto checks signatures and access keys for the test; a profile supplies a wrong key."""
    url = put(moto_s3, "guarded.bin")
    config = tmp_path / "aws-config"
    config.write_text("[profile wrong]\naws_access_key_id = AKIAWRONGWRONGWRONG1\n"
                      "aws_secret_access_key = not-the-secret\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    moto_s3.require_auth(True)
    try:
        start = time.monotonic()
        with pytest.raises(StorageError) as caught:
            storage.read_bytes(url, StorageOptions(s3_profile="wrong"))
    finally:
        moto_s3.require_auth(False)
    message = str(caught.value)
    assert message.startswith(f"{url}: the AWS credentials were refused (InvalidAccessKeyId")
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message
    assert time.monotonic() - start < 2  # permanent: not retried


def test_unknown_profile_is_named(moto_s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent"))
    with pytest.raises(StorageError, match=re.escape("the AWS profile 'nobody' is not in ~/.aws/config")):
        storage.read_bytes(moto_s3.url("faults/x"), StorageOptions(s3_profile="nobody"))


def test_no_credentials_at_all_says_where_to_put_them(moto_s3, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find here
    url = moto_s3.url("faults/x")
    # A new client (another timeout) looks the credentials up again.
    with pytest.raises(StorageError, match=re.escape(f"{url}: no usable AWS credentials found")) as caught:
        storage.read_bytes(url, StorageOptions(request_timeout_s=7.0))
    assert "AWS_ACCESS_KEY_ID" in str(caught.value)
