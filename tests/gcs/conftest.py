"""Fixtures for the ``gs://`` tests: a local GCS emulator, a fault proxy, real lane files.

The emulator (``gcp-storage-emulator``, in-memory) runs in a subprocess on 127.0.0.1 and
a free port for the whole session: a separate process, so a test blocking the GIL cannot
stall it and a crash cannot take the test process down. ``STORAGE_EMULATOR_HOST`` points
at it while the session lasts. Every test runs under a SIGALRM guard (``timeout`` marker,
default 60 s) so a hung request fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from loader.io import gcs
from tests.gcs.faults import FaultProxy
from tests.gcs.gcs_testing import BUCKET, Emulator, LaneFile, make_lane_file, start_emulator, upload_lane_file



@pytest.fixture(scope="session")
def emulator():
    proc, endpoint = start_emulator()
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    try:
        gcs.client(endpoint).create_bucket(BUCKET, project="zephon-test")
        yield Emulator(endpoint, BUCKET)
    finally:
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def proxy(emulator):
    fault_proxy = FaultProxy(emulator.endpoint)
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture(scope="session")
def big_lane_file(emulator, tmp_path_factory) -> LaneFile:
    """~5 MB, 12 row groups: above the 4 MiB whole-file threshold, so reads are ranged."""
    data = make_lane_file(rows=24_000, seed=1, row_group_rows=2_000)
    assert len(data) > 4 * 1024**2, len(data)
    return upload_lane_file(emulator, str(tmp_path_factory.mktemp("big")), "big", data)


@pytest.fixture(scope="session")
def small_lane_file(emulator, tmp_path_factory) -> LaneFile:
    """~200 KB, 4 row groups: fetched whole and checked against the manifest's sha256."""
    data = make_lane_file(rows=400, seed=2, row_group_rows=100)
    return upload_lane_file(emulator, str(tmp_path_factory.mktemp("small")), "small", data)
