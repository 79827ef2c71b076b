"""bench/loader_throughput.py's cost accounting patches the checks where the loader calls them."""

import subprocess
import sys
import textwrap

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_every_integrity_check_is_patched_in_the_modules_that_call_it():
    # In a fresh interpreter: the patches are process-wide.
    proc = run("""
        import bench.loader_throughput as lt
        from loader.io import integrity
        bindings = lt._integrity_bindings(lt.INTEGRITY_CHECKS)
        lt._disable_integrity_checks()
        left = [(m.__name__, n) for m, n in bindings if getattr(m, n) is getattr(integrity, n)]
        assert not left, left
        modules = {m.__name__ for m, _ in bindings}
        assert {"loader.io.lane_files", "loader.io.lane_decode"} <= modules, modules
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_check_bound_nowhere_is_an_error_not_a_silent_no_op():
    proc = run("""
        import bench.loader_throughput as lt
        from loader.io import integrity
        integrity.check_gone = lambda *a: None
        try:
            lt._integrity_bindings(("check_gone",))
        except RuntimeError as exc:
            print(exc)
    """)
    assert "no loader.io module calls ['check_gone']" in proc.stdout, proc.stderr
