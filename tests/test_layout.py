"""The layout stays legible (issue 16): no import cycle inside ``ds_hecate`` or ``benchmarks``, no source file over
600 lines, planning free of the runtime, and the public face small.

Imports are read from the source (ast), lazy ones inside functions included: a cycle through a function-level
import is still two modules that need each other. Imports under ``if TYPE_CHECKING:`` are annotations only and
are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_hecate", "benchmarks")
MAX_LINES = 600


def _modules(package: str) -> Dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """Modules of ``known`` that ``module`` imports (absolute or relative, at any depth, not TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: Set[str] = set()

    def resolve(name: str) -> None:
        while name and name not in known:   # "a.b.c" where c is a name inside module a.b
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:   # "from pkg import submodule" imports the submodule
                    full = f"{target}.{alias.name}"
                    resolve(full if full in known else target)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _graph() -> Dict[str, Set[str]]:
    known: Dict[str, Path] = {}
    for package in PACKAGES:
        known.update(_modules(package))
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_lazy_and_relative_imports(tmp_path):
    """The checker must see a cycle closed by a function-level relative import (the benchmarks once had one),
    and ignore one closed only under TYPE_CHECKING."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import helper\n")
    (tmp_path / "pkg" / "b.py").write_text("def helper():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    known = {"pkg": tmp_path / "pkg" / "__init__.py",
             **{f"pkg.{n}": tmp_path / "pkg" / f"{n}.py" for n in "abc"}}
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    assert graph["pkg.c"] == set()
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


#: what planning may import besides itself: the exception classes (standard library only), so that a config value
#: the group rule refuses (``planning.groups``) reaches the user as the same HecateConfigError on every rank
PLANNING_MAY_IMPORT = ("ds_hecate.planning", "ds_hecate.errors")


def test_planning_imports_nothing_outside_planning():
    """Pure planning: the runtime, the simulator and the tools read it, never the reverse."""
    graph = _graph()
    assert graph["ds_hecate.errors"] == set()   # the one exception stays a leaf
    outside = {m: sorted(d for d in deps if not d.startswith(PLANNING_MAY_IMPORT))
               for m, deps in graph.items() if m.startswith("ds_hecate.planning")}
    assert {m: d for m, d in outside.items() if d} == {}


@pytest.mark.parametrize("layer,forbidden", [
    ("ds_hecate.comm", ("ds_hecate.runtime", "ds_hecate.deepspeed_glue", "ds_hecate.tools", "ds_hecate.sim",
                        "ds_hecate.hf")),
    ("ds_hecate.runtime", ("ds_hecate.deepspeed_glue", "ds_hecate.tools", "ds_hecate.sim", "ds_hecate.hf")),
    ("ds_hecate.sim", ("ds_hecate.runtime", "ds_hecate.comm", "ds_hecate.deepspeed_glue", "ds_hecate.hf")),
])
def test_layers_import_downwards_only(layer, forbidden):
    """communication < runtime < DeepSpeed glue; the simulator models the machine without the runtime's code."""
    graph = _graph()
    offending = {m: sorted(d for d in deps if d.startswith(forbidden))
                 for m, deps in graph.items() if m.startswith(layer)}
    assert {m: d for m, d in offending.items() if d} == {}


def test_the_runtime_does_not_import_its_observers_or_the_tools():
    graph = _graph()
    runtime = {m: deps for m, deps in graph.items() if m.startswith("ds_hecate.runtime") and m != "ds_hecate.deepspeed_glue.monitor"}
    for module, deps in runtime.items():
        assert "ds_hecate.deepspeed_glue.monitor" not in deps, module
        assert not any(d.startswith("ds_hecate.tools") for d in deps), module


def test_library_does_not_import_benchmarks_or_test_helpers():
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("ds_hecate") and not module.startswith("ds_hecate.testing"):
            assert not any(d.startswith(("benchmarks", "ds_hecate.testing")) for d in deps), module


@pytest.mark.parametrize("folder", ["ds_hecate", "benchmarks", "tests", "examples"])
def test_no_source_file_over_600_lines(folder):
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / folder).rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_public_face():
    import ds_hecate
    assert {"MoE", "initialize"} <= set(ds_hecate.__all__)
    assert all(hasattr(ds_hecate, name) for name in ds_hecate.__all__)
    # the folders name the architecture; modules of the old flat layout are gone from the top level
    top = sorted(p.stem for p in (REPO / "ds_hecate").glob("*.py"))
    assert top == ["__init__", "config", "errors", "experts", "logging_utils", "moe_layer", "trace"]
