"""The shell and Python code blocks of the README and the docs pages, as the docs tests run them.

A fenced block whose language is ``bash`` or ``python`` runs, unless the line right above its
fence says why not: ``<!-- docs-test: skip (reason) -->`` (invisible on the site and on
GitHub). A Python block whose first line is ``# file: NAME`` is written to ``NAME`` instead of
being run (a script the next shell block launches).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = ("bash", "python")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>.+)\)\s*-->")
FILE = re.compile(r"#\s*file:\s*(?P<name>\S+)")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: Optional[str]  # the reason, for a block marked not to run

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE and self.skip is None

    @property
    def where(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line}"

    def as_shell(self) -> str:
        """This block as lines of a bash script."""
        if self.lang == "bash":
            return self.text
        first = self.text.split("\n", 1)[0]
        target = FILE.match(first)
        if target:
            return f"cat > {target['name']} <<'ZEPHON_DOCS_PY'\n{self.text}\nZEPHON_DOCS_PY"
        return f"python - <<'ZEPHON_DOCS_PY'\n{self.text}\nZEPHON_DOCS_PY"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found, k = [], 0
    while k < len(lines):
        opening = FENCE.match(lines[k])
        if not opening:
            k += 1
            continue
        end = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
        marker = SKIP.search(lines[k - 1]) if k else None
        found.append(Block(path, k + 1, opening["lang"], "\n".join(lines[k + 1:end]),
                           marker["reason"] if marker else None))
        k = end + 1
    return found


def pages() -> list[Path]:
    """The README and every Markdown page of the site's sources."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def script(path: Path) -> str:
    """The runnable blocks of ``path`` as one bash script (stops at the first failure)."""
    parts = ["set -euo pipefail"]
    for block in blocks(path):
        if block.runnable:
            parts += [f"echo '== {block.where}' >&2", block.as_shell()]
    return "\n".join(parts) + "\n"
