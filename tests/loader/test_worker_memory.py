"""Shared-memory transfer from workers: identical batches, and no segment outlives its run.

Peers are known to leave stale ``/dev/shm`` segments after ``kill -9``. Zephon's names are
unlinked as soon as a worker has mapped its segment, so a killed worker, a killed trainer
or both leave nothing; a segment whose creator died before that is removed by the next
loader.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from loader.pipeline import WorkerError, ZephonLoader
from loader.workers import shm
from tests.loader.settings import pids_alive
from tests.resume_harness import LoaderRun


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(shm._shm_dir()) if n.startswith(f"{shm.PREFIX}{pid}-")]


def _wait_gone(pids, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids_alive(pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_workers_deliver_the_in_process_stream(make_config, baseline, packing):
    """Views of shared memory, slot reuse and the lease: any slip changes a fingerprint."""
    for prefetch in (1, 3):
        config = make_config(packing, num_workers=2, prefetch=prefetch, micro_batch_size=1)
        run = LoaderRun(config)
        try:
            assert run.run(14) == baseline(packing, 14), f"workers, prefetch={prefetch}"
        finally:
            run.close()


@pytest.mark.timeout(60)
def test_segment_names_are_gone_once_workers_run_and_memory_after_close(make_config):
    loader = ZephonLoader(make_config("concat", num_workers=2))
    try:
        loader.wait_for_workers(30)
        next(loader)
        assert _segments_of(os.getpid()) == [], "segment names still exist after the workers mapped them"
        pids = [p.pid for p in loader._run.processes]
    finally:
        loader.close()
    assert pids_alive(pids) == []
    assert _segments_of(os.getpid()) == []


@pytest.mark.timeout(60)
def test_killed_worker_leaves_no_segment(make_config):
    loader = ZephonLoader(make_config("concat", num_workers=2))
    try:
        loader.wait_for_workers(30)
        next(loader)
        victim = loader._run.processes[0]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=f"pid {victim.pid}"):
            for _ in range(10_000):
                next(loader)
    finally:
        loader.close()
    assert _segments_of(os.getpid()) == []


@pytest.mark.timeout(60)
def test_a_stale_segment_of_a_dead_trainer_is_removed(make_config):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(shm._shm_dir(), f"{shm.PREFIX}{dead.pid}-abcdef-w0")
    with open(stale, "wb") as fh:
        fh.write(b"\0" * 4096)
    mine = os.path.join(shm._shm_dir(), f"{shm.PREFIX}{os.getpid()}-abcdef-w9")  # a live pid: kept
    with open(mine, "wb") as fh:
        fh.write(b"\0")
    try:
        with ZephonLoader(make_config("concat", num_workers=1)):
            pass
        assert not os.path.exists(stale)
        assert os.path.exists(mine)
    finally:
        for path in (stale, mine):
            if os.path.exists(path):
                os.unlink(path)


TRAINER = textwrap.dedent('''
    import json, sys
    from loader.config import LoaderConfig
    from loader.pipeline import ZephonLoader

    if __name__ == "__main__":
        loader = ZephonLoader(LoaderConfig(**json.loads(sys.argv[1])))
        loader.wait_for_workers(60)
        while True:
            next(loader)
            print(json.dumps([p.pid for p in loader._run.processes]), flush=True)
''')


@pytest.mark.timeout(120)
def test_trainer_killed_with_sigkill_leaves_no_worker_and_no_segment(make_config, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(make_config("concat", num_workers=2).to_dict())],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = json.loads(proc.stdout.readline())
        for _ in range(5):
            proc.stdout.readline()  # a few batches in: workers are busy, slots in use
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(pids) == [], "workers outlived a trainer killed with SIGKILL"
    assert _segments_of(proc.pid) == [], "a trainer killed with SIGKILL left shared memory behind"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("finite", [False, True])
def test_warm_start_hands_over_to_the_workers_without_changing_the_stream(make_config, baseline, monkeypatch, finite):
    """The trainer produces until the workers are ready, then the workers take over at an
    item (finite data: step) boundary. The hand-over is forced at several points."""
    from loader.workers.pool import WorkerPool

    overrides = dict(datasets=[{"path": make_config().datasets[0].path, "max_epochs": 2}]) if finite else {}
    from loader.commands.fingerprints import collect_fingerprints

    expected = [r.line() for r in collect_fingerprints(make_config("concat", **overrides), world_size=1, end_step=10)[0]]
    real_all_ready = WorkerPool.all_ready
    for checks_before_ready in (0, 3, 7):
        calls = {"n": 0}

        def all_ready(self):
            calls["n"] += 1
            return calls["n"] > checks_before_ready and real_all_ready(self)

        monkeypatch.setattr(WorkerPool, "all_ready", all_ready)
        config = make_config("concat", num_workers=2, micro_batch_size=1, **overrides)
        run = LoaderRun(config)
        try:
            for loader in run.loaders:
                real = loader._pool
                deadline = time.monotonic() + 30
                while not all(real.ready) and time.monotonic() < deadline:  # started, not yet let in
                    real_all_ready(real)
                    time.sleep(0.01)
            got = run.run(10)
            used_workers = not run.loaders[0]._run.warm_start
        finally:
            run.close()
        assert got == expected, f"hand-over after {checks_before_ready} checks changed the stream"
        assert used_workers, "the workers never took over"
