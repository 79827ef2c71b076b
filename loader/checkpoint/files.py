"""Finding a run's saved loader states in a directory: the newest one at or before a step.

A training run saves merged loader states as JSON (``loader.checkpoint.state.dumps``): the
Hugging Face integration writes ``OUTPUT_DIR/checkpoint-N/zephon_state.json``,
``zephon fingerprints --save-state STEP FILE`` any file name, and trainers that keep their own
checkpoints can write ``loader.global_state_dict()`` beside them. :func:`newest_state_at_or_before`
looks at every ``*.json`` file of a directory and of its immediate subdirectories, and reads
only the top-level ``format`` and ``next_global_index`` of each (a text search of the file: a
best-fit state can be tens of MB, and a directory can hold hundreds); the one it returns is
then loaded and checked in full by the caller.

Files that are not merged loader states are skipped (``trainer_state.json``, a model's
``config.json``, rank-local states, which hold only one rank's lanes). Pickled checkpoints
(``.ckpt``, ``.pt``) are never opened.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Optional

from loader.errors import StateError
from loader.checkpoint.state import STATE_FORMAT

_FORMAT = re.compile(rb'"format"\s*:\s*"' + re.escape(STATE_FORMAT.encode()) + rb'"')
_NEXT_INDEX = re.compile(rb'"next_global_index"\s*:\s*(\d+)')
_RANK_LOCAL = re.compile(rb'"rank_position"\s*:')
PICKLED = (".ckpt", ".pt", ".pth", ".bin", ".distcp")


@dataclass(frozen=True)
class SavedState:
    path: str
    step: int  # the step the state resumes at (next_global_index / global_batch_size)


def saved_states(directory: str, global_batch_size: int) -> list[SavedState]:
    """The merged loader states of ``directory`` (and its subdirectories, one level), by step."""
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json")) + glob.glob(os.path.join(directory, "*", "*.json"))):
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        index = _NEXT_INDEX.search(raw)
        if not _FORMAT.search(raw) or index is None or _RANK_LOCAL.search(raw):
            continue
        next_index = int(index.group(1))
        if next_index % global_batch_size == 0:  # else not a state of this config's batches
            found.append(SavedState(path, next_index // global_batch_size))
    return sorted(found, key=lambda s: (s.step, s.path))


def newest_state_at_or_before(directory: str, global_batch_size: int, step: int) -> Optional[SavedState]:
    """The saved state with the largest step ``<= step`` (ties: the last path), or None.

    Raises :class:`StateError` when the directory holds no loader state at all, naming what
    it does hold, so a wrong directory is not mistaken for "no checkpoint early enough"."""
    if not os.path.isdir(directory):
        raise StateError(f"{directory}: not a directory")
    states = saved_states(directory, global_batch_size)
    if not states:
        pickled = [p for p in glob.glob(os.path.join(directory, "**", "*"), recursive=True) if p.endswith(PICKLED)][:3]
        raise StateError(
            f"{directory}: holds no Zephon loader state (a JSON file with \"format\": {STATE_FORMAT!r} and a "
            "next_global_index, looked for in *.json and */*.json)"
            + (f"; pickled checkpoints such as {pickled} are never opened" if pickled else "")
            + ". The Hugging Face integration writes checkpoint-N/zephon_state.json; with other trainers save "
            "loader.checkpoint.state.dumps(loader.global_state_dict()) as JSON next to each checkpoint")
    usable = [s for s in states if s.step <= step]
    return usable[-1] if usable else None
