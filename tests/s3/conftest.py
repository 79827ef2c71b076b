"""Fixtures for the ``s3://`` tests: a moto S3 server on loopback, a fault proxy, datasets.

The server (``moto.server.ThreadedMotoServer``) listens on 127.0.0.1 and a free port for the
whole session, and the standard variables point boto3 at it (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``): the way a user
configures an S3-compatible store, inherited by spawned loader workers. Every test runs
under the suite's SIGALRM guard, so a hung request fails instead of hanging the suite.
"""

from __future__ import annotations

import pytest

from loader.io.retries import RetryPolicy
from tests.s3.s3_testing import (
    BUCKET,
    MotoS3,
    S3FaultProxy,
    raw_client,
    restore_environment,
    set_test_environment,
    start_server,
)


@pytest.fixture(scope="session")
def moto_s3():
    server, endpoint = start_server()
    previous = set_test_environment(endpoint)
    try:
        raw_client(endpoint).create_bucket(Bucket=BUCKET)
        yield MotoS3(endpoint, BUCKET)
    finally:
        restore_environment(previous)
        server.stop()


@pytest.fixture
def s3_proxy(moto_s3):
    proxy = S3FaultProxy(moto_s3.endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def quick_backoff(monkeypatch):
    """Retries in this process wait ~1/50 of the default backoff (full jitter kept)."""
    original = RetryPolicy.backoff_s
    monkeypatch.setattr(RetryPolicy, "backoff_s", lambda self, index: original(self, index) / 50)
