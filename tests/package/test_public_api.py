"""The stable surface: ``import loader`` names, its lightness, ``--version``, the old import paths."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from importlib import metadata

import pytest

import loader
from loader import cli, moved


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_public_names_are_the_objects_they_document():
    from loader.checkpoint import state
    from loader.config import LoaderConfig, SourceConfig
    from loader.pipeline import ZephonLoader

    assert loader.ZephonLoader is ZephonLoader and loader.LoaderConfig is LoaderConfig
    assert loader.SourceConfig is SourceConfig
    assert loader.merge_rank_states is state.merge_rank_states
    assert loader.state_to_json is state.dumps and loader.state_from_json is state.loads
    assert issubclass(loader.ConfigError, loader.ZephonError) and issubclass(loader.StateError, loader.ZephonError)
    assert set(loader.__all__) == set(loader.PUBLIC_API) | {"__version__"}
    with pytest.raises(AttributeError, match="no attribute 'Loader'"):
        loader.Loader  # noqa: B018


def test_version_is_the_installed_distributions():
    assert loader.__version__ == metadata.version(loader.DISTRIBUTION)
    assert loader.DISTRIBUTION != "zephon"  # the index's "zephon" is another project


def test_zephon_version_prints_it(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"zephon {loader.__version__} ({loader.DISTRIBUTION})"


def test_import_loader_loads_neither_torch_nor_pyarrow():
    out = _run("import sys, loader; loader.LoaderConfig; loader.__version__; "
               "print(sorted(m for m in ('torch', 'pyarrow', 'apache_beam') if m in sys.modules))")
    assert out.strip() == "[]"


@pytest.mark.parametrize("old, new", sorted(moved.MOVED.items()))
def test_old_import_paths_work_with_a_deprecation_warning(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pyproject's filterwarnings ignores DeprecationWarning
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # the real module, untouched
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    assert len(deprecations) == 1 and f"import {new} instead" in str(deprecations[0].message)


def test_from_import_of_an_old_path_warns_at_the_callers_line():
    out = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c",
                          "import loader\nfrom loader.state import merge_rank_states\nprint(merge_rank_states.__module__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "loader.checkpoint.state"
    assert "<string>:2: DeprecationWarning: loader.state moved to loader.checkpoint.state" in out.stderr


def test_names_that_never_existed_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("loader.no_such_module")
