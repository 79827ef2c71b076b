"""Worker processes: failures reach the trainer within seconds, never a hang; no stray processes.

A worker that raises (here: a corrupt lane file) surfaces as the project exception it raised,
named ``loader worker N: ...``, its cause a ``WorkerError`` carrying the worker's traceback; a
worker killed with SIGKILL surfaces as ``WorkerError``, also when it died in the middle of writing a message to its queue; ``close()`` and garbage collection
end the worker processes, and a closed loader continues exactly where the trainer stopped.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import time

import pytest

from loader.io.integrity import LaneDataError
from loader.pipeline import WorkerError, ZephonLoader
from loader.io.storage import StorageError
from tests.loader.settings import pids_alive
from tests.resume_harness import LoaderRun

CORRUPT_FILE = "lane=00003/part-00000.parquet"  # lane 3 is read for global index 3, in step 0
SURFACE_WITHIN_S = 15.0  # spawn (~1-2 s on a busy 2-core machine) + detection


def corrupt(dataset: str, how: str) -> str:
    path = os.path.join(dataset, CORRUPT_FILE)
    data = bytearray(open(path, "rb").read())
    if how == "truncate":  # caught by the size check against the manifest
        data = data[: len(data) // 2]
    else:  # same size, garbage in every page: caught by the Parquet reader (page headers, checksums)
        footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        data[4:footer_start] = bytes((k * 151 + 7) % 256 for k in range(footer_start - 4))
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    return path


@pytest.fixture
def dataset_copy(tmp_path, corpus) -> str:
    path = str(tmp_path / "dataset")
    shutil.copytree(corpus.text_path, path)
    return path


def drain(loader, micro_batches: int = 200) -> None:
    for _ in range(micro_batches):
        next(loader)


EXPECTED_ERROR = {"truncate": (StorageError, "truncated"), "garble": (LaneDataError, "corrupt")}


@pytest.mark.parametrize("how", ["truncate", "garble"])
def test_corrupt_lane_file_raises_in_process(make_config, dataset_copy, how):
    path = corrupt(dataset_copy, how)
    error, words = EXPECTED_ERROR[how]
    with ZephonLoader(make_config(datasets=[{"path": dataset_copy}])) as loader:
        with pytest.raises(error) as info:
            drain(loader)
    assert path in str(info.value) and words in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["truncate", "garble"])
def test_worker_exception_surfaces_with_its_traceback(make_config, dataset_copy, how):
    path = corrupt(dataset_copy, how)
    error, words = EXPECTED_ERROR[how]
    loader = ZephonLoader(make_config(datasets=[{"path": dataset_copy}], num_workers=1))
    loader.wait_for_workers(30)  # the worker path, not the warm start
    started = time.monotonic()
    try:
        with pytest.raises(error) as info:  # the worker's own project exception (issue 28)
            drain(loader)
        elapsed = time.monotonic() - started
        pids = [p.pid for p in loader._run.processes]
    finally:
        loader.close()
    message, cause = str(info.value), str(info.value.__cause__)
    assert elapsed < SURFACE_WITHIN_S, f"the worker's error took {elapsed:.1f} s to reach the trainer"
    assert message.startswith("loader worker 0: ") and path in message and words in message
    assert isinstance(info.value.__cause__, WorkerError)
    assert "Traceback (most recent call last)" in cause, f"no worker traceback in: {cause}"
    assert f"{error.__module__}.{error.__name__}" in cause
    assert pids_alive(pids) == [], "close() left worker processes behind"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_killed_worker_surfaces_as_worker_error_not_a_hang(make_config, packing):
    """SIGKILL a worker whose queue is full: with seq_len 128 and 8 open bins a best_fit
    message (8 sequences + lane states with their bins) outgrows the 64 KiB pipe, so the
    worker is killed while blocked half-way through writing one."""
    config = make_config(packing, seq_len=128, best_fit_open_bins=8, num_workers=2, prefetch=4)
    loader = ZephonLoader(config)
    try:
        loader.wait_for_workers(30)
        next(loader)
        time.sleep(1.5)  # let the workers run ahead until their queues are full
        victim = loader._run.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerError) as info:
            drain(loader, 10_000)
        elapsed = time.monotonic() - killed
        pids = [p.pid for p in loader._run.processes]
    finally:
        loader.close()
    assert elapsed < SURFACE_WITHIN_S, f"a killed worker took {elapsed:.1f} s to be noticed"
    assert f"pid {victim.pid}" in str(info.value) and "-9" in str(info.value)
    assert pids_alive(pids) == []


@pytest.mark.timeout(90)
def test_close_ends_workers_and_the_loader_resumes_where_the_trainer_stopped(make_config, baseline):
    config = make_config("best_fit", num_workers=2, prefetch=2)
    run = LoaderRun(config)
    try:
        first = run.run(3)
        loader = run.loaders[0]
        pids = [p.pid for p in loader._run.processes]
        assert len(pids) == 2 and len(pids_alive(pids)) == 2
        loader.close()
        assert pids_alive(pids) == [], "close() returned with worker processes still alive"
        rest = run.run(5)  # new workers, started from the consumed position (prefetched items are not lost)
        assert first + rest == baseline("best_fit", 8)
    finally:
        run.close()


@pytest.mark.timeout(60)
def test_garbage_collection_ends_workers(make_config):
    loader = ZephonLoader(make_config("concat", num_workers=2))
    loader.wait_for_workers(30)
    next(loader)
    pids = [p.pid for p in loader._run.processes]
    assert len(pids_alive(pids)) == 2
    del loader
    gc.collect()
    deadline = time.monotonic() + 10
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_alive(pids) == [], "dropping the last reference to a loader left its workers running"

