"""The docs site's reference pages, generated from the code at build time (a MkDocs hook).

Nothing here is written by hand, so the pages cannot drift from the code:

- ``reference/config.md``: every field of the loader config and of every table nested in it,
  found by walking ``LoaderConfig.FIELD_RULES`` (a new nested table appears by itself): the
  type and valid values from the field's rule, the default from the dataclass, the meaning
  from the record's ``FIELD_DOCS``;
- ``reference/cli.md``: every ``zephon`` command (``loader.cli.SUBCOMMANDS``) with the help
  its own argparse parser prints;
- ``reference/api.md``: the public names (``loader.PUBLIC_API``) and the integrations
  (``loader.integrations.MODULES``), rendered by mkdocstrings from their docstrings.

``tests/docs/test_reference.py`` checks that every config field, command and public name is
in these pages, and that every field has its ``FIELD_DOCS`` entry.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `mkdocs build` from the checkout: document this checkout's code
    sys.path.insert(0, ROOT)

import loader  # noqa: E402
from loader import cli, integrations, validation  # noqa: E402
from loader.config import LoaderConfig  # noqa: E402
from loader.config_tables import KindTable  # noqa: E402

# Page (under docs/) -> generator; mkdocs.yml's nav names these paths.
PAGES = {
    "reference/config.md": "config_reference",
    "reference/cli.md": "cli_reference",
    "reference/api.md": "api_reference",
}

# Further modules whose documented names users call directly (beyond loader.PUBLIC_API).
EXTRA_API = {
    "loader.metrics": ("LoaderMetrics", "StepCounters"),
    "loader.transforms": ("Document", "transform"),
    "loader.chat": ("encode_conversation", "load_chat_template", "ConversationRejected"),
}


# -- config ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Table:
    """One record of the config: where it sits (``datasets[]``), its class, the fields shown."""

    path: str
    record: type
    field_names: tuple[str, ...]


def _nested(rule: Any) -> Iterator[tuple[str, type, frozenset]]:
    """The records a field's rule builds: (suffix of the path, class, excluded fields)."""
    if isinstance(rule, validation.OrAbsent):
        yield from _nested(rule.inner)
    elif isinstance(rule, validation.ListOf):
        for suffix, record, excluded in _nested(rule.item):
            yield "[]" + suffix, record, excluded
    elif isinstance(rule, validation.SubTable):
        yield "", rule.record(), frozenset(rule.exclude())
    elif isinstance(rule, validation.Record):
        yield "", rule.record, frozenset()
    elif isinstance(rule, KindTable):  # a kind's table: the rule it registered
        yield from _nested(rule.table)


def config_tables(root: type = LoaderConfig) -> list[Table]:
    """The loader config, then the tables nested in it, breadth first (each record once, under
    the shortest path that reaches it: ``transforms[]`` rather than ``datasets[].transforms[]``)."""
    tables, seen = [], {root}
    queue = [("", root, frozenset())]
    while queue:
        path, record, excluded = queue.pop(0)
        names = tuple(f.name for f in dataclasses.fields(record) if f.name not in excluded)
        tables.append(Table(path, record, names))
        for name in names:
            for suffix, inner, inner_excluded in _nested(validation.field_rules(record)[name]):
                if inner not in seen:
                    seen.add(inner)
                    queue.append((f"{path}.{name}{suffix}" if path else f"{name}{suffix}", inner, inner_excluded))
    return tables


def _default(record: type, name: str) -> str:
    found = {f.name: f for f in dataclasses.fields(record)}[name]
    if found.default is not dataclasses.MISSING:
        value = found.default
    elif found.default_factory is not dataclasses.MISSING:
        value = found.default_factory()
    else:
        return "required"
    if value is None:
        return "absent"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (tuple, list)):
        return "`[]`" if not value else "`[" + ", ".join(f'"{v}"' for v in value) + "]`"
    if isinstance(value, dict) and not value:
        return "`{}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, int) and value >= 1024**2 and value % 1024**2 == 0:
        unit, size = ("GiB", value // 1024**3) if value % 1024**3 == 0 else ("MiB", value // 1024**2)
        return f"`{value}` ({size} {unit})"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference(root: type = LoaderConfig) -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the code by docs/hooks/reference.py: each record's FIELD_RULES (type and",
        "     valid values), dataclass defaults and FIELD_DOCS (meaning). Edit those, not this page. -->",
        "",
        "A loader config is a TOML or JSON file (relative paths are relative to the file), or the same",
        "names as keyword arguments of `LoaderConfig`. Every field is checked for type and range when",
        "the config is built; unknown keys are errors at every level; one `ConfigError` lists every bad",
        "field by its path. See [The loader](../guides/loader.md) for a worked example.",
        "",
    ]
    for table in config_tables(root):
        title = f"Top level (`{root.__name__}`)" if not table.path else f"`{table.path}` (`{table.record.__name__}`)"
        lines += [f"## {title}", ""]
        docstring = (table.record.__doc__ or "").strip().split("\n\n")[0]
        if docstring:
            lines += [" ".join(docstring.split()), ""]
        rules = validation.field_rules(table.record)
        docs = getattr(table.record, "FIELD_DOCS", {})
        lines += ["| field | type and valid values | default | meaning |", "|---|---|---|---|"]
        for name in table.field_names:
            lines.append(f"| `{name}` | {_cell(rules[name].expected)} | {_default(table.record, name)} | "
                         f"{_cell(docs.get(name, ''))} |")
        lines.append("")
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------
def cli_reference() -> str:
    lines = [
        "# Command-line reference",
        "",
        "<!-- Generated by docs/hooks/reference.py from each command's argparse parser. -->",
        "",
        "One command, `zephon`, with a subcommand per task. `zephon --version` prints the installed",
        "version; `zephon --debug <command> ...` (or `ZEPHON_DEBUG=1`) shows the traceback of an error",
        "above its one-line message. Every command reports a mistake as one line",
        "`zephon <command>: error: ...` and exits 2 for a usage error, 1 for data or a job that failed",
        "(`zephon diff` exits 1 when the runs differ, 2 on any error).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`zephon {name}`](#zephon-{name}) | {_cell(help_text)} |"
              for name, (_, help_text) in cli.SUBCOMMANDS.items()]
    lines.append("")
    for name in cli.SUBCOMMANDS:
        help_text = cli.parser_of(name).format_help()
        lines += [f"## zephon {name}", "", "```text", help_text.rstrip(), "```", ""]
    return "\n".join(lines)


# -- API ------------------------------------------------------------------------------------
def api_entries() -> list[tuple[str, str]]:
    """(name as users write it, dotted path where it is defined) of every documented name."""
    entries = [(f"loader.{name}", f"{module}.{attribute}")
               for name, (module, attribute) in sorted(loader.PUBLIC_API.items())]
    for module, names in integrations.MODULES.items():
        entries += [(f"loader.integrations.{module}.{name}", f"loader.integrations.{module}.{name}")
                    for name in names]
    for module, names in EXTRA_API.items():
        entries += [(f"{module}.{name}", _defined_in(module, name)) for name in names]
    return entries


def _defined_in(module: str, name: str) -> str:
    """The dotted path of ``module.name``'s definition (packages that re-export lazily)."""
    exports = getattr(sys.modules.get(module) or __import__(module, fromlist=["_"]), "_EXPORTS", {})
    return f"{module}.{exports[name]}.{name}" if name in exports else f"{module}.{name}"


def api_reference() -> str:
    lines = [
        "# Python API reference",
        "",
        "<!-- Generated by docs/hooks/reference.py from loader.PUBLIC_API and",
        "     loader.integrations.MODULES; the text is each object's docstring. -->",
        "",
        "`import loader` gives the stable surface below; the names load on first use, so",
        "`import loader` alone imports neither torch nor pyarrow. Trainer integrations live in",
        "`loader.integrations` (each needs its framework: the `integrations` extra). Modules that",
        "moved keep their old import path for one release with a `DeprecationWarning`.",
        "",
        "```python",
        "import loader",
        "",
        "loader.__version__                      # the installed version",
        "loader.ZephonLoader, loader.LoaderConfig  # the loader and its config",
        "```",
        "",
    ]
    section = None
    for public, defined in api_entries():
        module = public.rsplit(".", 1)[0]
        if module != section:
            section = module
            lines += [f"## `{module}`", ""]
        lines += [f"### `{public}`", "", f"::: {defined}", "    options:", "      show_root_heading: false",
                  "      heading_level: 4", ""]
    return "\n".join(lines)


def generated_pages() -> dict[str, str]:
    """Page path (under docs/) -> its Markdown."""
    return {page: globals()[function]() for page, function in PAGES.items()}


# Files from outside docs/ that the site shows as they are, at the same relative place, so
# their links work both on the site and in the repository: the benchmark pages and charts.
SHOWN_AS_IS = ("bench/RESULTS.md", "bench/HISTORY.md", "bench/*.png")


def shown_as_is() -> list[str]:
    import glob

    return sorted({os.path.relpath(path, ROOT) for pattern in SHOWN_AS_IS
                   for path in glob.glob(os.path.join(ROOT, pattern))})


# -- the MkDocs hook ------------------------------------------------------------------------
def on_files(files, config):
    from mkdocs.structure.files import File

    for page, text in generated_pages().items():
        files.append(File.generated(config, page, content=text))
    for path in shown_as_is():
        files.append(File.generated(config, path, abs_src_path=os.path.join(ROOT, path)))
    return files
