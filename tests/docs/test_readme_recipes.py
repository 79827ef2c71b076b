"""The getting-started page and the README's four recipes, run as written in a fresh directory.

Getting started runs the quick start (which leaves ``quickstart/``), then the README's recipes
run on it: shard JSONL, the Hugging Face Trainer, a torchrun loop stopped on 2 processes and
resumed on 1, and SFT with the shipped chat template.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import doc_blocks
from test_docs_pages import RUN_PAGES


@pytest.mark.docs
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_getting_started_and_readme_recipes_run_as_written(tmp_path):
    script = "\n".join(doc_blocks.script(doc_blocks.ROOT / page) for page in RUN_PAGES)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-6000:]}"
    # What the recipes promise, checked on what they left behind:
    assert (tmp_path / "datasets" / "prose" / "manifest.json").is_file()
    assert (tmp_path / "hf-out" / "checkpoint-4" / "zephon_state.json").is_file()
    stopped = json.loads((tmp_path / "state-3.json").read_text())
    resumed = json.loads((tmp_path / "state-6.json").read_text())
    assert stopped["next_global_index"] == 3 * 16 and resumed["next_global_index"] == 6 * 16
    assert "rank" not in stopped  # the merged, topology-free state that the 1-process run loaded
    assert " supervised tokens" in done.stdout
    assert "0 supervised tokens" not in done.stdout
