"""Beam's import-time apitools notice is dropped, and the root logger left unconfigured."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_noisy_import_is_silenced_and_other_records_pass(tmp_path):
    (tmp_path / "noisy_demo.py").write_text(textwrap.dedent("""
        import logging
        logging.warning("apitools not found, and bigquery client libraries are not available")
        logging.warning("a real problem")
    """))
    code = textwrap.dedent("""
        import logging, sys
        from beam_jobs import quiet
        quiet.NOISY_IMPORTS["noisy_demo"] = ("apitools not found",)
        quiet.install()
        import noisy_demo
        print(len(logging.getLogger().handlers), len(logging.getLogger().filters))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "apitools" not in done.stderr
    assert "a real problem" in done.stderr  # logged through logging's last-resort handler, not hidden
    assert done.stdout.split() == ["0", "0"]  # no handler installed, no filter left behind


def test_shard_help_prints_no_dependency_warning():
    done = subprocess.run([sys.executable, "-m", "loader.cli", "shard", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "usage: zephon shard" in done.stdout
    assert done.stderr == ""
