"""The shape of the package: module and class sizes, no import circle, the kept import paths (issue 40).

These guards keep the house from decaying unseen: a module that grows past what a reader can hold, a class that
becomes a god class, or two modules that need each other fail here, in CI, on the commit that does it. The checker
is tested on small synthetic packages first (``tmp_path``), so that a guard that can no longer fail is noticed.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_mpx"

# Physical lines, docstrings and comments included (what a reader scrolls through). Issue 40 set "about 700" for a
# module and "about 400" for a class; no file has an exception, so a large one must be split along a real seam.
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 400

# The old flat public modules, now re-exports of the packages' modules (kept so that user code keeps importing).
SHIMS = (
    "amp", "cast_lists", "cast_table", "cast_policy", "loss_scaler", "unscale", "master_weights", "forensics",
    "telemetry", "promotion", "doctor", "plot", "lightning", "fabric", "accelerate", "fsdp",
)  # fmt: skip


# --------------------------------------------------------------------------------------------------- the checker
def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``) by dotted name; a package is named by its ``__init__``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _parse(path: Path) -> ast.Module | None:
    """The module's tree, or None where it does not parse (:func:`oversized` reports that; the graph skips it)."""
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SyntaxError:
        return None


def oversized(
    root: Path, package: str, max_module: int = MAX_MODULE_LINES, max_class: int = MAX_CLASS_LINES
) -> list[str]:
    """One line per module over ``max_module`` physical lines and per class (nested ones too) over ``max_class``."""
    found = []
    for name, path in module_files(root, package).items():
        lines = len(path.read_text().splitlines())
        if lines > max_module:
            found.append(f"module {name}: {lines} lines (limit {max_module})")
        tree = _parse(path)
        if tree is None:
            found.append(f"module {name}: does not parse, its classes are not measured")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                if length > max_class:
                    found.append(f"class {name}.{node.name} (line {node.lineno}): {length} lines (limit {max_class})")
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import statement anywhere in ``tree`` (in functions and classes too: a lazy import that dodges a
    circle at import time is still a circle of design), except those under ``if TYPE_CHECKING:`` (types only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports.

    ``from a.b import c`` is an import of the module ``a.b.c`` where that is a module, of ``a.b`` otherwise; relative
    imports are resolved; importing a package counts as importing its ``__init__``. The parents' ``__init__`` that
    Python runs on the way are not counted: every module would then import its package, a circle of no meaning.
    """
    files = module_files(root, package)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(_parse(path) or ast.Module(body=[], type_ignores=[])):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                # ``import a.b.c`` names a.b.c; a name past the last module (``import a.b.attr`` cannot be, but a
                # resolved ``from`` can) falls back to the longest module prefix.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """One shortest circle (``a -> b -> a``) per strongly connected group of modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    found = []
    for group in groups:
        start = min(group)
        # Breadth-first inside the group: the shortest way from ``start`` back to itself.
        parents: dict[str, str] = {}
        frontier = [start]
        while start not in parents:
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node] & group):
                    if nxt not in parents:
                        parents[nxt] = node
                        nxt_frontier.append(nxt)
            frontier = nxt_frontier
        path = [start]
        node = parents[start]
        while node != start:
            path.append(node)
            node = parents[node]
        path.append(start)
        others = sorted(group - set(path))  # modules of the same tangle off this shortest circle
        found.append(" -> ".join(reversed(path)) + (f"  (the same tangle holds {', '.join(others)})" if others else ""))
    return sorted(found)


def _is_logger(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "getLogger"


def public_names(module_path: Path) -> set[str]:
    """A module's ``__all__`` where it has one, else the public names it defines at top level (not the ones it
    imports, nor a ``logging.getLogger`` logger: logging finds it by its name, nobody imports it)."""
    tree = ast.parse(module_path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and not _is_logger(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == "__all__":
                    return set(ast.literal_eval(node.value))
                if isinstance(target, ast.Name):
                    names.add(target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return {name for name in names if not name.startswith("_")}


# ------------------------------------------------------------------------------------------ the checker, tested
def _write_package(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_a_circle_closed_by_a_lazy_import(tmp_path):
    _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import helper\n",
        # The import inside the function dodges the circle at import time; it is still a circle.
        "pkg/b.py": "def helper():\n    from pkg import a\n    return a\n",
        "pkg/c.py": "import pkg.a\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert circles(graph) == ["pkg.a -> pkg.b -> pkg.a"]


def test_checker_resolves_relative_and_package_imports_and_names_a_longer_circle(tmp_path):
    _write_package(tmp_path, {
        "pkg/__init__.py": "from .sub.x import X\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from . import y\nX = 1\n",
        "pkg/sub/y.py": "from ..z import Z\n",
        "pkg/z.py": "from pkg import sub\nimport pkg\nZ = 2\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.sub.x"}
    assert graph["pkg.sub.x"] == {"pkg.sub.y"} and graph["pkg.sub.y"] == {"pkg.z"}
    assert graph["pkg.z"] == {"pkg.sub", "pkg"}
    assert circles(graph) == ["pkg -> pkg.sub.x -> pkg.sub.y -> pkg.z -> pkg"]


def test_checker_leaves_type_only_imports_out(tmp_path):
    _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": (
            "import typing\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.a import A\nelse:\n    import pkg.c\n"
            "if typing.TYPE_CHECKING:\n    import pkg.a\n"
            "class B: ...\n"
        ),
        "pkg/c.py": "",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.c"}  # the ``else`` of a TYPE_CHECKING block runs, so it counts
    assert circles(graph) == []


def test_checker_finds_an_oversized_module_and_class_nested_ones_too(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(10))
    nested = "class Outer:\n    class Inner:\n" + "\n".join(f"        y{i} = {i}" for i in range(12)) + "\n"
    _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/small.py": f"class Fits:\n{body}\n",  # 11 lines
        "pkg/big.py": "\n" * 30 + f"class Long:\n{body}\n{body}\n",  # 51 lines, a class of 21
        "pkg/nest.py": nested,  # Outer 14 lines, Inner 13
    })  # fmt: skip
    found = oversized(tmp_path, "pkg", max_module=40, max_class=12)
    assert found == [
        "module pkg.big: 51 lines (limit 40)",
        "class pkg.big.Long (line 31): 21 lines (limit 12)",
        "class pkg.nest.Outer (line 1): 14 lines (limit 12)",
        "class pkg.nest.Inner (line 2): 13 lines (limit 12)",
    ]
    assert oversized(tmp_path, "pkg", max_module=51, max_class=21) == []  # the limits are inclusive


def test_public_names_reads_all_or_the_top_level_definitions(tmp_path):
    _write_package(tmp_path, {
        "with_all.py": "__all__ = ['a']\na = b = 1\n",
        "without.py": (
            "import logging\nfrom typing import Any\nA: int = 1\nB = 2\n_c = 3\ndef f(): ...\nclass K: ...\n"
            "log = logging.getLogger('pkg')\n"
        ),
    })  # fmt: skip
    assert public_names(tmp_path / "with_all.py") == {"a"}
    assert public_names(tmp_path / "without.py") == {"A", "B", "f", "K"}


# ------------------------------------------------------------------------------------------- the package itself
# benchmarks/ is held to the same limits: its scripts are read and changed as the package is (a large one puts a
# part behind a private module, ``benchmarks/_<name>.py``, and re-exports its names where callers look for them).
@pytest.mark.parametrize("package", [PACKAGE, "benchmarks"])
def test_no_module_or_class_over_the_size_limits(package):
    assert module_files(ROOT, package), f"no modules under {ROOT / package}: the guard would measure nothing"
    found = oversized(ROOT, package)
    assert not found, "split these along a real seam of concepts (issue 40):\n  " + "\n  ".join(found)


def test_no_import_circle_between_the_package_modules():
    found = circles(import_graph(ROOT, PACKAGE))
    assert not found, "import circles (lazy imports in functions count):\n  " + "\n  ".join(found)


@pytest.mark.parametrize("shim", SHIMS)
def test_the_old_import_paths_re_export_the_same_objects(shim):
    """``lightning_mpx.<shim>`` imports, and each name it exports is the very object of the module it points at,
    which it covers whole (a user's ``from lightning_mpx.cast_table import X`` keeps working)."""
    path = ROOT / PACKAGE / f"{shim}.py"
    tree = _parse(path)
    if tree is None:
        pytest.fail(f"{PACKAGE}.{shim} does not even parse (python -c 'import {PACKAGE}.{shim}' shows where)")
    sources = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{PACKAGE}.")
        for alias in node.names
    }
    targets = sorted(set(sources.values()))
    assert targets, f"{shim}.py re-exports nothing"
    module = importlib.import_module(f"{PACKAGE}.{shim}")
    exported = set(module.__all__)
    for name in sorted(exported):
        target = importlib.import_module(sources[name])
        assert getattr(module, name) is getattr(target, name), f"{shim}.{name} is not {target.__name__}.{name}"
    wanted = set().union(*(public_names(module_files(ROOT, PACKAGE)[target]) for target in targets))
    missing = sorted(wanted - exported)
    assert not missing, f"{PACKAGE}.{shim} does not re-export these public names of {targets}: {missing}"


def test_no_text_file_holds_a_merge_conflict_marker():
    """A conflict resolved by hand and committed half-done (stop 60's CHANGELOG once) fails here, not in a reader's
    eyes: no line of the package, tests, docs, benchmarks, README or CHANGELOG starts as git's markers do."""
    markers = ("<" * 7 + " ", ">" * 7 + " ", "=" * 7 + "\n")
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder, pattern in (("lightning_mpx", "*.py"), ("tests", "*.py"), ("docs", "*.md"), ("benchmarks", "*.py")):
        files += sorted((ROOT / folder).rglob(pattern))
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(keepends=True), 1)
        if line.startswith(markers)
    ]
    assert not found, found
