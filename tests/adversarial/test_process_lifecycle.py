"""No loader worker outlives its loader: close(), garbage collection, an exception, Ctrl-C.

A worker that ignores the stop event and SIGTERM (here: stopped with SIGSTOP, which holds
SIGTERM pending as a frozen cgroup does) must still be gone within seconds, and must not
make the trainer hang at exit (multiprocessing's exit handler joins daemon children after
SIGTERM, forever if they do not die).
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

from loader.pipeline import ZephonLoader
from tests.loader.settings import pids_alive

GONE_WITHIN_S = 10.0

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, time
    from loader.config import LoaderConfig
    from loader.pipeline import ZephonLoader

    def main():
        config = LoaderConfig(**json.loads(sys.argv[1]))
        how = sys.argv[2]
        loader = ZephonLoader(config)
        loader.wait_for_workers(60)
        next(loader)
        pids = [p.pid for p in loader._run.processes]
        if how != "ctrl-c":
            os.kill(pids[0], signal.SIGSTOP)  # deaf to the stop event and to SIGTERM
        print(json.dumps(pids), flush=True)
        if how == "exit":
            return  # no close(): the loader's finalizer runs at interpreter exit
        if how == "raise":
            raise RuntimeError("the training loop failed")
        while True:  # "ctrl-c": keep training until interrupted
            next(loader)
            time.sleep(0.01)

    if __name__ == "__main__":
        main()
''')


def _config_json(config) -> str:
    return json.dumps(config.to_dict())


@pytest.mark.timeout(60)
def test_close_kills_a_worker_that_ignores_sigterm(make_config):
    loader = ZephonLoader(make_config("concat", num_workers=2))
    try:
        loader.wait_for_workers(30)
        next(loader)
        pids = [p.pid for p in loader._run.processes]
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
    finally:
        loader.close()
    elapsed = time.monotonic() - started
    assert pids_alive(pids) == [], "close() left a stopped worker behind"
    assert elapsed < GONE_WITHIN_S, f"close() took {elapsed:.1f} s"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["exit", "raise", "ctrl-c"])
def test_trainer_process_ends_and_takes_its_workers_along(make_config, tmp_path, how):
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    config = make_config("concat", num_workers=2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(script), _config_json(config), how], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2
        if how == "ctrl-c":
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole group
        started = time.monotonic()
        proc.wait(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = proc.stderr.read()
    deadline = time.monotonic() + GONE_WITHIN_S
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_alive(pids) == [], f"the trainer exited ({how}) but left workers {pids_alive(pids)}"
    assert elapsed < GONE_WITHIN_S, f"the trainer took {elapsed:.1f} s to exit ({how}); stderr:\n{stderr}"
    expected_rc = {"exit": 0, "raise": 1}.get(how)
    if expected_rc is not None:
        assert proc.returncode == expected_rc, stderr
    else:
        assert "KeyboardInterrupt" in stderr and proc.returncode != 0
