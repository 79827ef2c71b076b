"""Beam's import-time notices that read like a broken install, silenced where they come from.

Without the ``gcp`` extra, importing Apache Beam logs ``WARNING:root:apitools not found, and
bigquery client libraries are not available ...`` on the root logger (from
``apache_beam.io.gcp.internal.clients.bigquery``), before every ``zephon shard``, even
``--help``. Zephon never uses BigQuery, so the notice says nothing about the job; and
``logging.warning`` on an unconfigured root logger configures it, so the command's own log
format would be lost too.

:func:`install` (run by ``import beam_jobs``, without importing Beam) puts a finder on
``sys.meta_path`` that answers only for the modules of :data:`NOISY_IMPORTS`: each is loaded
by its own loader, with a stderr handler of its own in place (so no logging configuration
outlives the import) and a filter that drops exactly the listed messages. Anything else those
imports log is printed as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Optional

# Module that logs a notice when imported -> the start of each message of it that is noise.
NOISY_IMPORTS = {
    "apache_beam.io.gcp.internal.clients.bigquery": ("apitools not found",),
}


class _DropNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, prefixes: tuple[str, ...]) -> None:
        self.loader = loader
        self.prefixes = prefixes

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        root = logging.getLogger()
        notices, placeholder = _DropNotices(self.prefixes), logging.StreamHandler()
        # A handler of the import's own, so that logging.warning does not configure the root
        # logger for good; other records print as that configuration would print them.
        placeholder.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        root.addFilter(notices)
        root.addHandler(placeholder)
        try:
            self.loader.exec_module(module)
        finally:
            root.removeHandler(placeholder)
            root.removeFilter(notices)


class QuietImportFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`NOISY_IMPORTS` (as the path finder would) and nothing else."""

    def find_spec(self, fullname: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in NOISY_IMPORTS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _QuietLoader(spec.loader, NOISY_IMPORTS[fullname])
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once per process."""
    if not any(isinstance(finder, QuietImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, QuietImportFinder())
