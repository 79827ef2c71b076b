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

    expected = [r.line() for r in collect_fingerprints(make_config("concat", **overrides), world_size=1, end_step=16)[0]]
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
            got = run.run(8)  # the trainer's lanes lead while the workers catch up
            loader = run.loaders[0]
            used_workers = not loader._run.warm_start
            deadline = time.monotonic() + 30
            while loader._run.lead is not None and time.monotonic() < deadline:
                loader._run._workers_caught_up(loader.next_global_index)  # drops what the lead made
                time.sleep(0.01)
            caught_up = loader._run.lead is None
            got += run.run(8)  # from the workers alone
        finally:
            run.close()
        assert got == expected, f"hand-over after {checks_before_ready} checks changed the stream"
        assert used_workers, "the workers never took over"
        assert caught_up, "the workers never caught up with the trainer's lanes"


@pytest.mark.timeout(120)
def test_hand_over_does_not_wait_for_the_workers_first_messages(make_config, baseline, monkeypatch):
    """At the hand-over the workers open their lanes and read their first row groups; the
    trainer's lanes go on producing meanwhile, and what the workers made for indices already
    handed out is dropped (its slots given back): same stream, no wait, no slot left held."""
    from loader.workers.pool import WorkerPool

    real_all_ready, real_try_receive = WorkerPool.all_ready, WorkerPool.try_receive
    held_back = {"on": True}
    monkeypatch.setattr(WorkerPool, "all_ready", lambda self: not held_back["on"] and real_all_ready(self))
    # The workers' first messages are withheld for a while: the lead must carry on.
    monkeypatch.setattr(WorkerPool, "try_receive",
                        lambda self, k: None if held_back["slow"] else real_try_receive(self, k))
    held_back["slow"] = True
    # Pre-tokenized: a loader whose sources tokenize online hands over without a lead (below).
    config = make_config("concat", pretokenized=True, num_workers=2, micro_batch_size=1, prefetch=1)
    run = LoaderRun(config)
    try:
        loader = run.loaders[0]
        got = run.run(2)  # in-process: the workers are not let in yet
        held_back["on"] = False
        loader.wait_for_workers(30)
        got += run.run(8)  # handed over; the lead produces every item, the workers' wait unread
        lead_carried_on = loader._run.lead is not None and not loader._run.warm_start
        time.sleep(0.5)  # the workers fill their slots with items the lead already made
        held_back["slow"] = False
        deadline = time.monotonic() + 30
        while loader._run.lead is not None and len(got) < 36 and time.monotonic() < deadline:
            got += run.run(1)  # a trainer's pace: the workers catch up between steps
            time.sleep(0.05)
        caught_up = loader._run.lead is None
        got += run.run(2)
    finally:
        run.close()
    assert got == baseline("concat", 38, pretokenized=True)[:len(got)], "the hand-over changed the stream"
    assert lead_carried_on, "the trainer waited for the workers instead of producing"
    # 64 items per worker made by the lead, 4 slots of 8 items per worker (prefetch 1): the
    # workers catch up only if the dropped items' slots went back
    assert caught_up, "the workers never caught up (slots of dropped items not given back?)"


@pytest.mark.timeout(120)
def test_a_text_loader_hands_over_at_once_without_a_lead(make_config, baseline, monkeypatch):
    """Sources that tokenize online: the trainer's lanes would take the cores the workers
    tokenize on, so the workers take over at the hand-over (the trainer waits for their first
    messages once) and the trainer's lanes are closed. The stream is unchanged."""
    from loader.stages.lane import Lane
    from loader.workers.pool import WorkerPool

    real_all_ready = WorkerPool.all_ready
    gate = {"open": False}
    monkeypatch.setattr(WorkerPool, "all_ready", lambda self: gate["open"] and real_all_ready(self))
    closed = []
    real_close = Lane.close
    monkeypatch.setattr(Lane, "close", lambda self: (closed.append(self.lane_id), real_close(self)))
    run = LoaderRun(make_config("concat", num_workers=2, micro_batch_size=1))
    try:
        loader = run.loaders[0]
        got = run.run(3)  # in-process: the workers are not let in yet
        warm_lanes = sorted(loader._run.in_process_lanes)
        gate["open"] = True
        loader.wait_for_workers(30)
        got += run.run(1)  # hands over
        handed_over = not loader._run.warm_start and loader._run.lead is None
        closed_at_hand_over = sorted(closed)
        got += run.run(12)
    finally:
        run.close()
    assert handed_over, "a text loader kept the trainer's lanes producing after the hand-over"
    assert closed_at_hand_over == warm_lanes, "the trainer's lanes were not closed at the hand-over"
    assert got == baseline("concat", len(got)), "the hand-over changed the stream"


@pytest.mark.timeout(120)
def test_a_trainer_faster_than_its_workers_gives_the_lead_up(make_config, baseline, monkeypatch):
    """Workers that cannot catch up (here: their messages reach the trainer at half its pace)
    must not leave the trainer producing forever: once every worker is producing, the lead
    ends after a bounded number of items and the trainer waits for the workers, dropping
    what they made before that point. The stream is unchanged."""
    from loader.workers.pool import WorkerPool

    real_all_ready, real_try_receive = WorkerPool.all_ready, WorkerPool.try_receive
    gate = {"open": False, "calls": 0}
    monkeypatch.setattr(WorkerPool, "all_ready", lambda self: gate["open"] and real_all_ready(self))

    def slow_try_receive(self, worker_id):
        gate["calls"] += 1
        return real_try_receive(self, worker_id) if gate["calls"] % 32 == 0 else None

    monkeypatch.setattr(WorkerPool, "try_receive", slow_try_receive)
    config = make_config("concat", pretokenized=True, num_workers=2, micro_batch_size=1, prefetch=1)
    run = LoaderRun(config)
    try:
        loader = run.loaders[0]
        got = run.run(1)
        gate["open"] = True
        loader.wait_for_workers(30)
        got += run.run(1)  # hands over; the lead produces
        handed_over = loader._run.lead is not None
        # the lead may run up to 5x as far as it had when every worker first delivered
        while loader._run.lead is not None and len(got) < 1000:
            got += run.run(1)
        gave_up = loader._run.lead is None and loader._run._lead_until is not None
        got += run.run(2)
    finally:
        run.close()
    assert handed_over, "the hand-over did not start with the lead"
    assert gave_up, "the lead never ended although the workers could not catch up"
    assert got == baseline("concat", len(got), pretokenized=True), "giving the lead up changed the stream"
