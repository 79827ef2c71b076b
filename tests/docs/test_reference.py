"""The generated reference covers the code: every config field, every command, every public name."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from typing import Optional

import pytest

import doc_blocks
import loader
from loader import cli, integrations, validation
from loader.config import LoaderConfig


def _hook():
    spec = importlib.util.spec_from_file_location("zephon_docs_reference", doc_blocks.ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return _hook()


def test_every_field_of_every_config_table_has_its_doc_and_row(reference):
    page = reference.config_reference()
    tables = reference.config_tables()
    assert {t.record.__name__ for t in tables} >= {"LoaderConfig", "SourceConfig", "ScheduleEntry", "TransformSpec",
                                                    "ImagesConfig", "StorageOptions"}
    for table in tables:
        names = {f.name for f in dataclasses.fields(table.record)}
        docs = getattr(table.record, "FIELD_DOCS", {})
        assert set(docs) == names, (f"{table.record.__name__}.FIELD_DOCS must document exactly its fields: "
                                    f"missing {sorted(names - set(docs))}, unknown {sorted(set(docs) - names)}")
        assert all(text.strip() for text in docs.values())
        for name in table.field_names:
            assert f"| `{name}` |" in page, f"{table.path or 'top level'}: field {name} not in the reference"


@dataclasses.dataclass(frozen=True)
class Balance:
    """A table another feature might add to the config."""

    window: int = 4
    FIELD_RULES = {"window": validation.Integer(minimum=1)}
    FIELD_DOCS = {"window": "steps per balancing window"}


@dataclasses.dataclass(frozen=True)
class ConfigWithBalance:
    seed: int
    balance: Optional[Balance] = None
    FIELD_RULES = {"seed": validation.Integer(minimum=0), "balance": validation.OrAbsent(validation.Record(Balance))}
    FIELD_DOCS = {"seed": "the seed", "balance": "balancing"}


def test_a_nested_table_added_to_the_config_appears_by_itself(reference):
    page = reference.config_reference(ConfigWithBalance)
    assert "## `balance` (`Balance`)" in page and "| `window` | an integer >= 1 | `4` | steps per balancing window |" in page
    assert "| `seed` | an integer >= 0 | required | the seed |" in page


def test_every_command_has_its_section_with_its_parser_help(reference):
    page = reference.cli_reference()
    for name in cli.SUBCOMMANDS:
        assert f"## zephon {name}\n" in page
        assert cli.parser_of(name).format_usage().split()[1] in page  # the usage line's program name
    assert "zephon --version" in page


def test_every_public_name_is_in_the_api_reference(reference):
    page = reference.api_reference()
    for name in loader.PUBLIC_API:
        assert f"### `loader.{name}`" in page
    for module, names in integrations.MODULES.items():
        imported = importlib.util.find_spec(f"loader.integrations.{module}")
        assert imported is not None, module
        for name in names:
            assert f"### `loader.integrations.{module}.{name}`" in page
    assert "loader.__version__" in page
