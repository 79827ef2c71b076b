"""Errors raised inside loader workers reach the trainer as the project exception they were
(issue 28, class 5): the same type, the message naming the worker, the worker's traceback
kept as the cause; nothing left in ``/dev/shm`` or the process table afterwards.

Many instances: out-of-range ids and a failing transform (``TransformError``), a lane with no
token (``EmptyLaneError``), in-process and on 1 and 2 workers. The trainer produces the first
items itself until the workers take over, so with workers each transform misbehaves only
outside the trainer's process (``outside_pid``): the error is raised inside a worker.
"""

from __future__ import annotations

import os
import time

import pytest

from loader.checkpoint.state import StateError
from loader.io.lane_reader import EmptyLaneError
from loader.pipeline import ZephonLoader
from loader.transforms.spec import TransformError
from loader.workers.pool import WorkerError

HAND_OVER_S = 60
HOSTILE = "tests.adversarial.hostile_transforms:"
CASES = {
    "negative_id": ({"function": HOSTILE + "set_id", "args": {"value": -1}}, TransformError, "input_id -1"),
    "id_past_int32": ({"function": HOSTILE + "set_id", "args": {"value": 2**40}}, TransformError, "input_id"),
    "raises": ({"function": HOSTILE + "set_id", "args": {"value": 1, "dtype": "no-such-dtype"}}, TransformError,
               "failed on document"),
    "empty_lane": ({"function": HOSTILE + "keep_only", "args": {"key": "none"}}, EmptyLaneError, "every block"),
}


def _children(pid: int) -> set[int]:
    """Live (not zombie) descendants of ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _shm() -> set:
    """This process's segment names in /dev/shm (other sessions on the machine have their own)."""
    prefix = f"zephon-{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_worker_error_is_the_original_project_exception(make_config, corpus, case, workers):
    transform, error, text = CASES[case]
    if workers:
        transform = dict(transform, args=dict(transform["args"], outside_pid=os.getpid()))
        if error is EmptyLaneError:  # the worker also finds the trainer's hand-over cursor past its (empty) block
            error, text = (EmptyLaneError, StateError), r"every block|holds 0 (tokens|documents)"
    path = corpus.text_path if case == "empty_lane" else corpus.pretokenized_path
    config = make_config("concat", pretokenized=case != "empty_lane", num_workers=workers).replace(
        datasets=[{"path": path, "transforms": [transform]}])
    before_shm, before_children = _shm(), _children(os.getpid())
    with pytest.raises(error, match=text) as caught:
        with ZephonLoader(config) as loader:
            deadline = time.monotonic() + HAND_OVER_S
            while time.monotonic() < deadline:  # past the hand-over to the workers (their start-up)
                next(loader)
    if workers:
        assert str(caught.value).startswith("loader worker "), caught.value
        assert isinstance(caught.value.__cause__, WorkerError) and "Traceback" in str(caught.value.__cause__)
    assert not isinstance(caught.value, WorkerError) or error is WorkerError
    assert _shm() <= before_shm
    assert _children(os.getpid()) <= before_children


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_stopped_before_the_hand_over_is_reported_within_worker_timeout_s(make_config, corpus, workers):
    """The trainer produces in-process until every worker has started; a worker that never
    starts (SIGSTOP) used to leave it producing forever. Now: WorkerError after worker_timeout_s."""
    import signal

    timeout_s = 3.0
    config = make_config("concat", pretokenized=True, num_workers=workers, worker_timeout_s=timeout_s)
    loader = ZephonLoader(config)
    try:
        next(loader)  # starts the pool: the workers are still importing
        victims = list(loader._pool.processes)
        os.kill(victims[-1].pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"did not start within 3 s \(worker_timeout_s\)"):
            while time.monotonic() - started < 60:
                next(loader)
        assert time.monotonic() - started < timeout_s + 10
    finally:
        for process in loader._pool.processes if loader._pool is not None else ():
            try:
                os.kill(process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        loader.close()
    assert not any(_running(p.pid) for p in victims)


@pytest.mark.parametrize("free_bytes", [0, 512, 4096])
def test_too_little_shared_memory_is_an_error_that_says_so(make_config, corpus, monkeypatch, free_bytes):
    """A tmpfs too small for the segments (docker's 64 MB /dev/shm) is refused before a worker
    maps it: a segment of a full tmpfs maps fine and dies of SIGBUS on its first write."""
    from loader.errors import SharedMemoryError
    from loader.workers import shm

    real = os.statvfs

    class Small:
        def __init__(self, path):
            stat = real(path)
            self.f_frsize, self.f_bavail = 1, free_bytes

    monkeypatch.setattr(shm.os, "statvfs", Small)
    before_shm, before_children = _shm(), _children(os.getpid())
    config = make_config("concat", pretokenized=True, num_workers=2, prefetch=4)
    with pytest.raises(SharedMemoryError, match=r"shared memory /dev/shm has .* MiB free.*--shm-size"):
        with ZephonLoader(config) as loader:
            next(loader)
    assert _shm() <= before_shm
    assert _children(os.getpid()) <= before_children


def test_a_segment_holds_its_memory_from_the_start():
    """Reserved, not sparse: every page is allocated when the trainer creates the segment, so a
    /dev/shm that someone else fills later cannot make a worker's first write fault."""
    from loader.workers.shm import Segment

    segment = Segment.create(num_slots=4, slot_size=1 << 20, worker_id=0)
    try:
        size = Segment.size_of(4, 1 << 20)
        assert os.stat(segment.path).st_blocks * 512 >= size
    finally:
        segment.unlink()
        segment.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_full_shared_memory_at_reservation_is_an_error_that_says_so(make_config, corpus, monkeypatch, workers):
    """The free-space check passed, then the tmpfs filled up (another process): the reservation
    fails in the trainer, before a worker starts, naming /dev/shm and the fix."""
    import errno

    from loader.errors import SharedMemoryError
    from loader.workers import shm

    calls = []

    def full(fd, offset, length):
        calls.append(length)
        if len(calls) == workers:  # the last worker's segment: the earlier ones were created
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    real = os.posix_fallocate
    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    before_shm, before_children = _shm(), _children(os.getpid())
    config = make_config("concat", pretokenized=True, num_workers=workers, prefetch=4)
    with pytest.raises(SharedMemoryError, match=r"shared memory /dev/shm: loader worker \d's segment of .* MiB could "
                                                r"not be reserved \(No space left on device\).*--shm-size"):
        with ZephonLoader(config) as loader:
            next(loader)
    assert len(calls) == workers
    assert _shm() <= before_shm
    assert _children(os.getpid()) <= before_children


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_killed_by_sigbus_is_reported_as_full_shared_memory(make_config, corpus):
    import signal

    loader = ZephonLoader(make_config("concat", pretokenized=True, num_workers=1))
    try:
        loader.wait_for_workers(60)
        os.kill(loader._pool.processes[0].pid, signal.SIGBUS)
        with pytest.raises(WorkerError, match=r"SIGBUS: shared memory \(/dev/shm\) is full"):
            for _ in range(10_000):
                next(loader)
    finally:
        loader.close()


TRAINER = """
import sys, time
from loader.pipeline import ZephonLoader
from loader.config import LoaderConfig
config = LoaderConfig.from_dict(__import__("json").loads(sys.argv[1]))
loader = ZephonLoader(config)
next(loader)  # the pool is started; the workers may still be importing (warm start)
print("started", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait_s", [0.0, 3.0], ids=["before-hand-over", "after"])
def test_kill_9_of_the_trainer_leaves_nothing_in_dev_shm(make_config, corpus, wait_s):
    import json
    import signal
    import subprocess
    import sys

    config = make_config("concat", pretokenized=True, num_workers=2)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(config.to_dict())],
                               stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert trainer.stdout.readline().strip() == "started"
        time.sleep(wait_s)
        workers = sorted(_children(trainer.pid))
        names = [n for n in os.listdir("/dev/shm") if n.startswith(f"zephon-{trainer.pid}-")]
        assert len(workers) == 2 and names == []  # the names went when the workers were spawned
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 20
        while any(_running(p) for p in workers):
            assert time.monotonic() < deadline, "workers outlived the killed trainer"
            time.sleep(0.1)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"zephon-{trainer.pid}-")] == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
