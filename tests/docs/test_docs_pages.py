"""The docs site builds with no broken link or reference, and every code block on it runs or says why not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import doc_blocks

# Pages whose runnable blocks the recipe test runs, in this order, in one sandbox.
RUN_PAGES = ("docs/getting-started.md", "README.md")


@pytest.mark.docs
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mkdocs_build_strict_passes(tmp_path):
    """A broken link, a missing anchor, page or API object fails the build (strict mode)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=doc_blocks.ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "An iterator of micro-batches" in api  # the docstrings were rendered, not just the headings


def test_every_code_block_runs_or_says_why_not():
    unmarked = [block.where for path in doc_blocks.pages() for block in doc_blocks.blocks(path)
                if block.runnable and str(path.relative_to(doc_blocks.ROOT)) not in RUN_PAGES]
    assert not unmarked, ("these bash/python blocks are run by no test: make them runnable in a page of "
                          f"RUN_PAGES or mark them <!-- docs-test: skip (reason) -->: {unmarked}")


def test_skip_marker_is_read_and_file_blocks_become_files(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip (needs a GPU) -->\n```python\nimport gpu\n```\n\n"
                    "```python\n# file: a.py\nprint(1)\n```\n\n```bash\npython a.py\n```\n\n```text\nno\n```\n")
    found = doc_blocks.blocks(page)
    assert [(b.lang, b.skip) for b in found] == [("python", "needs a GPU"), ("python", None), ("bash", None), ("text", None)]
    done = subprocess.run(["bash", "-c", doc_blocks.script(page)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "1\n", done.stderr
    assert (tmp_path / "a.py").read_text() == "# file: a.py\nprint(1)\n"
