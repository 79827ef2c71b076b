"""bench/image_throughput.py's steady-state cases: the CPU of live worker processes is counted,
and the two image goals are judged on within-round ratios."""

import subprocess
import sys
import time

from bench import image_throughput
from bench.peers.run import tree_cpu_s


def test_the_cpu_of_a_live_child_counts_before_it_exits():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        before = tree_cpu_s()["workers_cpu_s"]
        deadline = time.monotonic() + 20
        while tree_cpu_s()["workers_cpu_s"] - before < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_s()["workers_cpu_s"] - before >= 0.3
        assert child.poll() is None  # still running: RUSAGE_CHILDREN would not have seen it
    finally:
        child.kill()
        child.wait()


def _run(images_per_s: float, cpu_ms_per_image: float) -> dict:
    return {"seconds": 1.0, "images": images_per_s, "cpu_s": images_per_s * cpu_ms_per_image / 1e3, "tokens": 0}


def test_the_image_goals_are_within_round_ratios():
    # round 1: 2 workers 1.2x as fast at 1.1x the CPU; round 2: 0.9x at 1.5x; round 3: 1.0x at 1.2x
    results = {"settled_k0": [_run(100, 2.0), _run(200, 2.0), _run(150, 2.0)],
               "settled_k2": [_run(120, 2.2), _run(180, 3.0), _run(150, 2.4)]}
    lines = image_throughput.report(results)
    assert "GOAL 2 workers >= 0.95 x in-process images/s (steady state): 1.00 PASS" in lines
    assert "GOAL 2 workers CPU per image <= 1.3 x in-process (steady state): 1.20 PASS" in lines
    results["settled_k2"][2] = _run(100, 3.0)  # round 3: 0.67x at 1.5x
    lines = image_throughput.report(results)
    assert "GOAL 2 workers >= 0.95 x in-process images/s (steady state): 0.90 FAIL" in lines
    assert "GOAL 2 workers CPU per image <= 1.3 x in-process (steady state): 1.50 FAIL" in lines
