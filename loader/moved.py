"""Old import paths of modules that moved, kept for one release with a ``DeprecationWarning``.

``import loader.state`` (or ``from loader.state import merge_rank_states``) still works and
gives the module at its new path, :mod:`loader.checkpoint.state`, after a warning that names
the new path. One finder on ``sys.meta_path`` serves every entry of :data:`MOVED`; it answers
only for those names, so nothing else is imported through it. Remove an entry a release
after its move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from typing import Optional

# Old module path -> new module path.
MOVED = {
    "loader.cache": "loader.io.cache",
    "loader.checkpoint_schema": "loader.checkpoint.schema",
    "loader.collate": "loader.stages.collate",
    "loader.data_parallel": "loader.order.data_parallel",
    "loader.diff": "loader.commands.diff",
    "loader.features": "loader.stages.features",
    "loader.fingerprints": "loader.commands.fingerprints",
    "loader.gcs": "loader.io.gcs",
    "loader.hashing": "loader.order.hashing",
    "loader.lane": "loader.stages.lane",
    "loader.lane_reader": "loader.io.lane_reader",
    "loader.manifest": "loader.io.manifest",
    "loader.mixing": "loader.order.mixing",
    "loader.ordering": "loader.order.ordering",
    "loader.packing": "loader.stages.packing",
    "loader.plot_mix": "loader.commands.plot_mix",
    "loader.plotting": "loader.commands.plotting",
    "loader.producer": "loader.stages.producer",
    "loader.quickstart": "loader.commands.quickstart",
    "loader.state": "loader.checkpoint.state",
    "loader.step_states": "loader.checkpoint.step_states",
    "loader.storage": "loader.io.storage",
    "loader.token_mixing": "loader.stages.token_mixing",
    "loader.tokenizer": "loader.stages.tokenizer",
    "loader.torch_data": "loader.integrations.torch_data",
    # One name per concept: torch_data is PyTorch's DataLoader and DCP, this one torchdata's.
    "loader.integrations.torchdata": "loader.integrations.stateful_dataloader",
    # The sample corpus generator: out of the Beam package, which the trainer's workers may import.
    "beam_jobs.sample_data": "loader.samples.corpus",
}

_IMPORT_MACHINERY = ("<frozen importlib", os.path.dirname(importlib.__file__))


def _skipped_by_warnings(filename: str) -> bool:
    """Frames ``warnings.warn`` itself leaves out of ``stacklevel`` (the import system's bootstrap)."""
    return "importlib" in filename and "_bootstrap" in filename


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points the warning at the user's import statement, past the
    import system's frames and this module's own."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_IMPORT_MACHINERY)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
        if frame is not None and not _skipped_by_warnings(frame.f_code.co_filename):
            level += 1
    return level


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec):
        return None  # a placeholder module; exec_module puts the real one in its place

    def exec_module(self, module) -> None:
        old_name = module.__spec__.name
        warnings.warn(f"{old_name} moved to {self.new_name}: import {self.new_name} instead "
                      f"(the old path goes away in the next release)", DeprecationWarning,
                      stacklevel=_caller_stacklevel())
        # The import system returns whatever sys.modules holds under the old name after
        # exec_module, so the real module (its own __spec__ intact) is what the caller gets.
        sys.modules[old_name] = importlib.import_module(self.new_name)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED`, and nothing else."""

    def find_spec(self, fullname: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(MOVED[fullname]))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import loader`` does it)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
