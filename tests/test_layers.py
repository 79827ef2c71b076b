"""The layers of the code, checked from the source: no import cycle, a core that names no kind
of data, no class too big to hold in one's head, no project import hidden in a function.

Every module of ``loader/`` and ``beam_jobs/`` is parsed with :mod:`ast` (nothing is imported),
and every ``import`` statement counts, those inside functions and methods included: an
import moved into a function hides a cycle from the interpreter, not from the design.

``from package import name`` counts as an import of ``package.name`` when that is a module of
the tree, else of ``package`` (its ``__init__``). The allow-lists below name today's known
offenders with their current size; they may only shrink (a test fails on a new offender, on
growth, and on an entry that no longer offends, so that the list is kept honest).
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass
from typing import Iterable, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("loader", "beam_jobs")

# The core: ordering, I/O, stages, checkpoint, workers, transforms and the loader runtime. It
# knows kinds of data only through the registry, loader.kinds.base.
CORE = (
    "loader.order", "loader.io", "loader.stages", "loader.checkpoint", "loader.workers", "loader.transforms",
    "loader.pipeline", "loader.config", "loader.config_tables", "loader.metrics", "loader.validation", "loader.errors",
    "loader.registry", "loader.caches",
    "loader.kinds.base", "loader.runtime",
)
# The concrete kinds of lane data: what the core must never import.
KINDS = ("loader.chat", "loader.vision", "loader.kinds.text", "loader.kinds.chat", "loader.kinds.image")
KINDS_PACKAGE = "loader.kinds"  # its __init__ lists the built-in kinds: a kind too, for the core

# Core -> kind imports not yet moved behind loader.kinds: (importer, imported) -> count.
CORE_TO_KIND_ALLOWED: dict[tuple[str, str], int] = {}

# The sample corpus generator: only the commands that write a sample (and the tokenizer's
# training script) import it, so no trainer's process loads it.
SAMPLE_CORPUS = "loader.samples.corpus"
SAMPLE_CORPUS_IMPORTERS = ("loader.commands.quickstart", "beam_jobs.train_tokenizer")

# "Is this path remote?" has one answer, loader.io.backends.is_remote (or scheme_of): a check of a
# path's text for "://" or a scheme prefix elsewhere is a second rule. Endpoint URLs are not paths.
REMOTE_CHECK = re.compile(r"""["']://["']\s+(?:not\s+)?in\b|startswith\(\(?\s*f?["'][a-z0-9]+://""")
REMOTE_CHECKS_ALLOWED = {
    "loader.io.backends": "the rule itself",
    "loader.io.gcs": "resolve_endpoint: an endpoint URL without a scheme gets http://",
    "loader.io.s3": "resolve_endpoint: an endpoint URL without a scheme gets http://",
}

# Documents are tokenized by one function, loader.io.blocks.tokenize_documents, offline and online
# alike; a chat render's tokens need their byte ends as well (loader.chat.masks).
TOKENIZE_CALL = re.compile(r"\.encode_batch(?:_fast)?\(")
TOKENIZE_CALLS_ALLOWED = {
    "loader.io.blocks": "tokenize_documents itself",
    "loader.chat.masks": "chat renders: ids with their byte ends (offsets where a token's length is unsure)",
}

MAX_CLASS_LINES = 400
# Classes over MAX_CLASS_LINES today, with their current length in lines.
BIG_CLASSES_ALLOWED = {
}

# Project modules imported inside a function, allowed because the import is deferred on
# purpose (each names why): importer -> {imported module: why}.
DEFERRED_IMPORTS_ALLOWED = {
    "beam_jobs.inputs": {"beam_jobs.job_files": "apache_beam: only when the job lists its inputs"},
    "loader.commands.audit": {"loader.pipeline": "torch: only when a step is replayed"},
    "loader.commands.fingerprints": {"loader.pipeline": "torch: after the arguments are checked"},
    "loader.io.storage": {"loader.io.gcs": "google-cloud-storage: only for gs:// paths"},
    "loader.kinds.chat": {"loader.chat.block": "jinja2: only for chat sources"},
    "loader.kinds.image": {"loader.vision.chat": "jinja2: only for image-chat lanes",
                           "loader.vision.images": "Pillow: only for image lanes"},
    "loader.vision.policies": {"loader.vision.images": "Pillow: only where pixels are decoded"},
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            found[_module_name(path, root)] = path
    return found


def _resolve(name: str, modules: dict) -> Optional[str]:
    """The module of the tree that ``name`` (a module, or a module's attribute) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, modules: dict, is_package: bool) -> list[Import]:
    """Every import of a tree module by ``module``, at any depth of its source."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                candidates = [f"{base}.{alias.name}" for alias in child.names]
                names = [c if c in modules else base for c in candidates]
            for name in dict.fromkeys(names):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    found.append(Import(module, target, child.lineno, in_function))
            visit(child, inside)

    visit(ast.parse(source), False)
    return found


def import_graph(root: pathlib.Path = ROOT, sources: Optional[dict[str, str]] = None) -> list[Import]:
    """All imports between modules of the tree; ``sources`` overrides a module's text (tests)."""
    modules = _modules(root)
    edges = []
    for module, path in modules.items():
        text = (sources or {}).get(module) or path.read_text()
        edges += imports_of(module, text, modules, path.name == "__init__.py")
    return edges


def cycles(edges: Iterable[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(start: str) -> None:
        # Iterative, so that a long chain of modules cannot hit the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def core_to_kind_imports(edges: Iterable[Import]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for edge in edges:
        if _within(edge.importer, CORE) and (_within(edge.imported, KINDS) or edge.imported == KINDS_PACKAGE):
            counts[edge.importer, edge.imported] = counts.get((edge.importer, edge.imported), 0) + 1
    return counts


def big_classes(root: pathlib.Path = ROOT, limit: int = MAX_CLASS_LINES) -> dict[tuple[str, str], int]:
    """Classes of more than ``limit`` lines (decorators and docstring included), by module and name."""
    found = {}
    for module, path in _modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                size = node.end_lineno - start + 1
                if size > limit:
                    found[module, node.name] = size
    return found


def _described(edges: list[Import], members: list[str]) -> str:
    inside = set(members)
    ties = [f"  {e.importer}:{e.line} -> {e.imported}{' (inside a function)' if e.in_function else ''}"
            for e in edges if e.importer in inside and e.imported in inside]
    return "\n".join(sorted(set(ties)))


def check_no_cycles(edges: list[Import]) -> None:
    found = cycles(edges)
    assert not found, "import cycles (imports inside functions count too):\n" + "\n".join(
        f"{', '.join(c)}:\n{_described(edges, c)}" for c in found)


def check_core_names_no_kind(edges: list[Import]) -> None:
    counts = core_to_kind_imports(edges)
    new = {k: v for k, v in counts.items() if v > CORE_TO_KIND_ALLOWED.get(k, 0)}
    assert not new, ("the core imports a concrete kind; reach it through loader.kinds.base (a LaneKind "
                     f"method) instead: {sorted(new)}")
    gone = sorted(k for k in CORE_TO_KIND_ALLOWED if counts.get(k, 0) < CORE_TO_KIND_ALLOWED[k])
    assert not gone, f"no longer imported: remove from CORE_TO_KIND_ALLOWED (or lower the count): {gone}"


def check_sample_corpus_out_of_the_runtime(edges: list[Import]) -> None:
    importers = sorted({e.importer for e in edges if e.imported == SAMPLE_CORPUS}
                       - set(SAMPLE_CORPUS_IMPORTERS))
    assert not importers, (f"{SAMPLE_CORPUS} (a test-corpus generator) is imported by {importers}; the "
                           "loader and the Beam job use loader.samples.default_tokenizer_path at most")


def test_the_sample_corpus_is_imported_by_its_commands_only():
    check_sample_corpus_out_of_the_runtime(import_graph())


def hand_made(pattern: re.Pattern, allowed: dict[str, str],
              sources: Optional[dict[str, str]] = None) -> dict[str, list[int]]:
    """Modules outside ``allowed`` with a line matching ``pattern``: module -> line numbers."""
    texts = sources or {module: path.read_text() for module, path in _modules().items()}
    found = {}
    for module, text in texts.items():
        lines = [n for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
        if lines and module not in allowed:
            found[module] = lines
    return found


def remote_checks(sources: Optional[dict[str, str]] = None) -> dict[str, list[int]]:
    """Modules that test a path for a scheme by hand: module -> line numbers."""
    return hand_made(REMOTE_CHECK, REMOTE_CHECKS_ALLOWED, sources)


def tokenize_calls(sources: Optional[dict[str, str]] = None) -> dict[str, list[int]]:
    """Modules that tokenize documents with a call of their own: module -> line numbers."""
    return hand_made(TOKENIZE_CALL, TOKENIZE_CALLS_ALLOWED, sources)


def test_one_tokenization_of_documents():
    assert tokenize_calls() == {}, "tokenize documents with loader.io.blocks.tokenize_documents"


def test_a_tokenization_of_its_own_is_found():
    assert tokenize_calls({"beam_jobs.x": "ids = [e.ids for e in tok.encode_batch_fast(texts)]\n"}) == {"beam_jobs.x": [1]}


def test_one_rule_for_remote_paths():
    assert remote_checks() == {}, "use loader.io.backends.is_remote / scheme_of instead of these checks"


def test_a_hand_made_remote_check_is_found():
    found = remote_checks({"beam_jobs.x": 'if "://" in path:\n    pass\nok = p.startswith(("gs://", "s3://"))\n'})
    assert found == {"beam_jobs.x": [1, 3]}


def test_no_import_cycles():
    check_no_cycles(import_graph())


def test_the_core_imports_no_concrete_kind():
    check_core_names_no_kind(import_graph())


def test_no_class_over_the_limit():
    found = big_classes()
    over = {k: v for k, v in found.items() if v > BIG_CLASSES_ALLOWED.get(k, MAX_CLASS_LINES)}
    assert not over, (f"classes over {MAX_CLASS_LINES} lines (or grown past their allowance): {over}; "
                      "split the class by its jobs")
    shrunk = {k: (v, found.get(k)) for k, v in BIG_CLASSES_ALLOWED.items() if found.get(k, 0) < v}
    assert not shrunk, f"lower (or drop) these allowances of BIG_CLASSES_ALLOWED to their size now: {shrunk}"


def test_project_imports_inside_functions_are_deferred_on_purpose():
    deferred = sorted({(e.importer, e.imported) for e in import_graph() if e.in_function})
    unexpected = [pair for pair in deferred if pair[1] not in DEFERRED_IMPORTS_ALLOWED.get(pair[0], {})]
    assert not unexpected, ("project imports inside functions (move them to the top of the file; only an "
                            f"optional heavy dependency may wait, named in DEFERRED_IMPORTS_ALLOWED): {unexpected}")


# -- each check can fail -------------------------------------------------------------------
def _with(module: str, extra: str) -> dict[str, str]:
    path = _modules()[module]
    return {module: path.read_text() + "\n" + extra}


@pytest.mark.parametrize("in_function", [False, True])
def test_a_cycle_is_found_also_through_an_import_inside_a_function(in_function):
    # loader.errors is at the bottom: an import of the loader runtime from it closes a circle.
    line = ("def _late():\n    from loader.pipeline import ZephonLoader\n" if in_function
            else "from loader.pipeline import ZephonLoader\n")
    edges = import_graph(sources=_with("loader.errors", line))
    with pytest.raises(AssertionError, match="loader.errors"):
        check_no_cycles(edges)


def test_a_core_import_of_a_kind_is_found():
    edges = import_graph(sources=_with("loader.io.manifest", "from loader.vision.record import ImagesRecord\n"))
    with pytest.raises(AssertionError, match="loader.vision.record"):
        check_core_names_no_kind(edges)


def test_an_import_of_the_sample_corpus_is_found():
    edges = import_graph(sources=_with("loader.stages.tokenizer", "from loader.samples import corpus\n"))
    with pytest.raises(AssertionError, match="loader.stages.tokenizer"):
        check_sample_corpus_out_of_the_runtime(edges)


def test_a_big_class_is_found(tmp_path):
    package = tmp_path / "loader"
    package.mkdir()
    (tmp_path / "beam_jobs").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (package / "big.py").write_text(f"class Big:\n{body}\n")
    assert big_classes(tmp_path) == {("loader.big", "Big"): MAX_CLASS_LINES + 1}


# Test folders that are not named after a package of the project: what they test instead.
TEST_AREAS = {
    "adversarial": "bad input at every door", "audit": "zephon audit", "bench": "the benchmarks' plumbing",
    "docs": "the docs site and README recipes", "elastic": "the elastic matrix over every kind",
    "examples": "examples/", "finite": "finite epochs", "gcs": "gs:// storage", "golden": "the golden pins",
    "mixing": "source mixing", "package": "the wheel", "s3": "s3:// storage",
}


def folders_mismatching_packages(root: pathlib.Path = ROOT) -> list[str]:
    """Test folders named after no package or module of ``loader`` (or ``beam_jobs``) and no area of
    TEST_AREAS; under ``tests/loader``, folders named after no sub-package of ``loader``."""
    def folders(path: pathlib.Path) -> list[str]:
        return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))

    packages = set(folders(root / "loader")) | {p.stem for p in (root / "loader").glob("*.py")} | {"beam_jobs", "loader"}
    wrong = [f"tests/{name}" for name in folders(root / "tests") if name not in packages and name not in TEST_AREAS]
    wrong += [f"tests/loader/{name}" for name in folders(root / "tests" / "loader")
              if not (root / "loader" / name / "__init__.py").exists()]
    return wrong


def test_tests_mirror_the_packages():
    wrong = folders_mismatching_packages()
    assert not wrong, (f"test folders named after no package: {wrong}; name a folder after the package it "
                       "tests (tests/loader/<sub-package>, tests/<package>), or add its area to TEST_AREAS")


def test_a_test_folder_named_after_nothing_is_found(tmp_path):
    for path in ("loader/io", "tests/loader/io", "tests/loader/iox", "tests/golden", "tests/misc"):
        (tmp_path / path).mkdir(parents=True)
    (tmp_path / "loader" / "io" / "__init__.py").write_text("")
    assert folders_mismatching_packages(tmp_path) == ["tests/misc", "tests/loader/iox"]
