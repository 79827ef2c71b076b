"""The README's SFT recipe as written, at ``seq_len`` 256 (its own value) and 4096.

The whole README runs in ``test_readme_recipes.py`` (slow); this runs only the SFT section's
two blocks: the shell block once (it writes the conversations and shards them), the Python
block as written and with ``seq_len=256`` replaced by ``seq_len=4096`` (docs/guides/finite-epochs.md:
a dataset whose conversations fit loads at both, without re-sharding).
"""

from __future__ import annotations

import os
import subprocess

import pytest

import doc_blocks

SECTION = "### SFT with a chat template"


def _sft_blocks() -> tuple[doc_blocks.Block, doc_blocks.Block]:
    readme = doc_blocks.ROOT / "README.md"
    start = readme.read_text(encoding="utf-8").split("\n").index(SECTION) + 1
    runnable = [b for b in doc_blocks.blocks(readme) if b.runnable and b.line > start]
    shell, python = runnable[:2]
    assert shell.lang == "bash" and "zephon shard" in shell.text and python.lang == "python"
    return shell, python


@pytest.mark.docs
@pytest.mark.slow  # `zephon shard` in a process and two loaders: ~25 s on 2 busy cores
@pytest.mark.timeout(300)
def test_the_readme_sft_recipe_runs_at_seq_len_256_and_4096(tmp_path, monkeypatch, capsys):
    shell, python = _sft_blocks()
    assert "seq_len=256" in python.text
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + shell.as_shell()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    monkeypatch.chdir(tmp_path)
    for seq_len in (256, 4096):
        exec(compile(python.text.replace("seq_len=256", f"seq_len={seq_len}"), python.where, "exec"), {})
        shape, supervised, *_ = capsys.readouterr().out.strip().splitlines()[-1].rsplit(" ", 3)
        assert shape == f"(4, {seq_len})" and int(supervised) > 0, (seq_len, shape, supervised)
