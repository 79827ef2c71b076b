"""Tables a kind adds to the loader config (the image kind's ``images``), registered by the kind.

:class:`~loader.config.LoaderConfig` declares such a field by its name alone: default ``None``,
its line in ``FIELD_DOCS`` and the rule :class:`KindTable`. What the table is belongs to the
kind: its record (a frozen dataclass with ``FIELD_RULES`` and ``FIELD_DOCS``, whose
``stream_entry()`` is the config fingerprint's entry) and the rule that checks a table into it,
registered at import with :func:`register_config_table`. The core never imports the kind: a
built-in table's module is named in :data:`BUILTIN_TABLES` (as :mod:`loader.io.backends` names
the modules of the built-in storage backends) and imported the first time a table of that name
is checked or its record is asked for, so ``import loader.config`` loads no kind, and a config
without the table never does. A table's module must be light (no pyarrow, no Pillow): reading a
config is what every process does first.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from loader.registry import Registry
from loader.validation import Problems, Rule

# Table name -> the module that registers it on import (a kind's light module).
BUILTIN_TABLES = {"images": "loader.vision.options"}

_TABLES: Registry[Rule] = Registry("config table", "import the kind that adds it (its module registers the table)")


def register_config_table(name: str, rule: Rule) -> Rule:
    """Add the rule of the config's ``name`` table (a :class:`loader.validation.Record` of the
    kind's record, whose ``None`` is an absent table); each name once."""
    return _TABLES.register(name, rule)


def config_table(name: str) -> Rule:
    """The rule registered for the ``name`` table, importing a built-in table's module first."""
    rule = _TABLES.get(name)
    if rule is None and name in BUILTIN_TABLES:
        importlib.import_module(BUILTIN_TABLES[name])  # registers the table
        rule = _TABLES.get(name)
    return rule if rule is not None else _TABLES.lookup(name)


@dataclass(frozen=True)
class KindTable(Rule):
    """A config field holding a kind's table: absent (``None``), or checked by the rule the
    kind registered under ``name`` (its record, each problem named by its path)."""

    name: str

    @property
    def table(self) -> Rule:
        return config_table(self.name)

    @property
    def record(self) -> type:
        return self.table.record

    @property
    def expected(self) -> str:  # type: ignore[override]
        return self.table.expected

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        return None if value is None else self.table.check(value, path, problems)
