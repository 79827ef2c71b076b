"""Zephon's online loader: deterministic, elastic global batches from lane-sharded data.

The names below are the stable surface (``import loader``; ``loader.ZephonLoader``, ...):

- :class:`ZephonLoader`: the iterator of micro-batches for one data-parallel rank;
- :class:`LoaderConfig`, :class:`SourceConfig`, :class:`ScheduleEntry`: what it produces;
- :class:`StorageOptions`: retries, timeouts and the cache for ``gs://`` lane files;
- the state helpers: ``ZephonLoader.state_dict`` / ``global_state_dict`` / ``load_state_dict``,
  and :func:`merge_rank_states`, :func:`state_to_json`, :func:`state_from_json` for the JSON
  checkpoint itself;
- the error types every user mistake raises: :class:`ZephonError` and its subclasses
  :class:`ConfigError`, :class:`StateError`;
- ``__version__``, from the installed distribution's metadata.

Trainer frameworks plug in through :mod:`loader.integrations` (``hf``, ``lightning``,
``titan``, ``torch_data``, ``stateful_dataloader``).

Importing this package is cheap: each name is imported on first use (PEP 562), so
``import loader`` alone loads neither torch nor pyarrow. Modules that moved keep their old
import path for one release with a ``DeprecationWarning`` (:mod:`loader.moved`).
"""

from __future__ import annotations

import importlib

from loader import moved

# The distribution's name on the package index and in the wheel (pip install zephon-loader);
# the import packages stay ``loader`` and ``beam_jobs``, the command ``zephon``.
DISTRIBUTION = "zephon-loader"


# Public name -> (module, attribute), imported on first use.
PUBLIC_API = {
    "ZephonLoader": ("loader.pipeline", "ZephonLoader"),
    "LoaderConfig": ("loader.config", "LoaderConfig"),
    "SourceConfig": ("loader.config", "SourceConfig"),
    "ScheduleEntry": ("loader.config", "ScheduleEntry"),
    "StorageOptions": ("loader.io.storage", "StorageOptions"),
    "merge_rank_states": ("loader.checkpoint.state", "merge_rank_states"),
    "state_to_json": ("loader.checkpoint.state", "dumps"),
    "state_from_json": ("loader.checkpoint.state", "loads"),
    "ZephonError": ("loader.errors", "ZephonError"),
    "ConfigError": ("loader.config", "ConfigError"),
    "StateError": ("loader.checkpoint.state", "StateError"),
}
__all__ = sorted(PUBLIC_API) + ["__version__"]

moved.install()


def _version() -> str:
    from importlib import metadata  # ~30 ms of email parsing: only when the version is asked for

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name not in PUBLIC_API:
        raise AttributeError(f"module 'loader' has no attribute {name!r}")
    module, attribute = PUBLIC_API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC_API) | {"__version__"})
