"""The layout stays legible (issues 16 and 42): each top-level part of ``ds_hecate`` imports only the parts
:data:`MAY_IMPORT` allows (the direction is written down here, once; docs/design.md draws it), no two files need each
other (no circle of files), no source file over 600 lines and no function over 80, the benchmarks use public names
only, and the public face is small.

Imports are read from the source (ast), lazy ones inside functions included: a cycle through a function-level
import is still two modules that need each other. Imports under ``if TYPE_CHECKING:`` count too: a file that names
another's types depends on it as much as one that calls it (relay.py once took the Communicator's type that way
while collectives.py took relay.py's functions).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple, cast

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_hecate", "benchmarks")
MAX_LINES = 600
MAX_FUNCTION = 80


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


def _imports(module: str, path: Path, known: Dict[str, Path], type_checking: bool = True) -> Set[str]:
    """Modules of ``known`` that ``module`` imports (absolute or relative, at any depth; under TYPE_CHECKING too
    unless ``type_checking`` is False)."""
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
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
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


def test_no_circle_of_files():
    """No two files of ds_hecate or benchmarks need each other, directly or round a longer circle. (runtime/ had one,
    hecate.py <-> edp.py, layer.py and resharding.py, until the parts typed the runtime that owns them as
    ``runtime/interfaces.RuntimeView``: put one of those imports back and this fails.)"""
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_lazy_relative_and_type_checking_imports(tmp_path):
    """The checker must see a cycle closed by a function-level relative import (the benchmarks once had one), and
    one closed only under TYPE_CHECKING (comm/relay.py and comm/collectives.py once were)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import helper\n")
    (tmp_path / "pkg" / "b.py").write_text("def helper():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    known = {"pkg": tmp_path / "pkg" / "__init__.py",
             **{f"pkg.{n}": tmp_path / "pkg" / f"{n}.py" for n in "abc"}}
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    assert graph["pkg.c"] == {"pkg.a"}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]
    (tmp_path / "pkg" / "b.py").write_text("def helper():\n    pass\n")
    (tmp_path / "pkg" / "a.py").write_text("from .b import helper\nfrom .c import y\n")
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    assert _cycles(graph) == [["pkg.a", "pkg.c"]]
    assert {m: _imports(m, p, known, type_checking=False) for m, p in known.items()}["pkg.c"] == set()


#: The allowed direction, written once (docs/design.md draws it): what each top-level part of ds_hecate (a folder, or
#: a module beside them; ``__init__`` is the package itself) may import besides itself. Bottom up: the exceptions and
#: the logger; pure planning (numpy, every rank alike) and the trace format; the torch pieces of a layer (experts,
#: ops, the MoE module) and communication; the config, which names what planning and comm define; the runtime and,
#: beside it without its code, the simulator; the Hugging Face adapters; the DeepSpeed glue; the test gates and the
#: user tools; the public face. ``benchmarks`` sits above all of it.
MAY_IMPORT: Dict[str, Tuple[str, ...]] = {
    "errors": (),
    "logging_utils": (),
    "planning": ("errors",),
    "trace": ("errors",),
    "cli_args": ("errors",),
    "experts": (),
    "ops": ("experts",),
    "moe_layer": ("errors", "experts", "ops"),
    "comm": ("errors", "logging_utils", "planning"),
    "config": ("comm", "errors", "planning"),
    "runtime": ("comm", "config", "errors", "experts", "logging_utils", "ops", "planning"),
    "sim": ("cli_args", "config", "errors", "planning", "trace"),
    "hf": ("errors", "experts", "moe_layer", "planning", "runtime"),
    "deepspeed_glue": ("comm", "config", "errors", "experts", "hf", "logging_utils", "moe_layer", "planning",
                       "runtime", "trace"),
    "testing": ("errors", "planning", "sim", "trace"),
    "tools": ("cli_args", "config", "deepspeed_glue", "errors", "hf", "planning", "runtime", "sim", "trace"),
    "__init__": ("config", "deepspeed_glue", "errors", "experts", "moe_layer"),
}

def _part(module: str) -> str:
    """The top-level part of ds_hecate a module belongs to (``__init__`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _climbing(graph: Dict[str, Set[str]]) -> Set[Tuple[str, str]]:
    """(importer, imported) pairs of ds_hecate modules whose parts :data:`MAY_IMPORT` does not allow."""
    return {(m, d) for m, deps in graph.items() if m.startswith("ds_hecate") for d in deps
            if d.startswith("ds_hecate") and _part(d) != _part(m) and _part(d) not in MAY_IMPORT[_part(m)]}


def test_parts_import_downhill_only():
    """Every import between the top-level parts of ds_hecate goes the way :data:`MAY_IMPORT` allows."""
    assert _climbing(_graph()) == set()


def test_the_allowed_direction_is_one_direction():
    """:data:`MAY_IMPORT` names every part there is and no other, and allows no circle of parts."""
    graph = _graph()
    assert {_part(m) for m in graph if m.startswith("ds_hecate")} == set(MAY_IMPORT)
    assert all(set(deps) <= set(MAY_IMPORT) for deps in MAY_IMPORT.values())
    parts = {part: set(deps) for part, deps in MAY_IMPORT.items()}
    assert _cycles(parts) == []


def test_the_direction_check_sees_a_climbing_import():
    """A module of the simulator that imports the tools climbs (sim/core.py once read the trace format there)."""
    graph = {"ds_hecate.sim.core": {"ds_hecate.tools.trace", "ds_hecate.planning.plan"}, "ds_hecate.tools.trace": set(),
             "ds_hecate.planning.plan": set()}
    assert _climbing(graph) == {("ds_hecate.sim.core", "ds_hecate.tools.trace")}


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


def test_no_function_over_80_lines():
    functions = [(path, node) for path in sorted((REPO / "ds_hecate").rglob("*.py"))
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = {f"{path.relative_to(REPO)}:{node.name}": n for path, node in functions
            if (n := cast(int, node.end_lineno) - node.lineno + 1) > MAX_FUNCTION}
    assert long == {}


def _private_names_imported(path: Path) -> List[str]:
    """``module:name`` of each private name (or a name from a private module) the file imports from ds_hecate."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("ds_hecate"):
            private_module = any(part.startswith("_") for part in (node.module or "").split("."))
            out += [f"{node.module}:{a.name}" for a in node.names if private_module or a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("ds_hecate")
                    and any(part.startswith("_") for part in a.name.split("."))]
    return out


def test_benchmarks_use_public_names_only():
    """What the benchmarks need of ds_hecate is public: no ``_name`` imported (they took ``_greedy`` and
    ``_affordable`` once; those are :func:`~ds_hecate.planning.search.greedy_pass` and
    :func:`~ds_hecate.planning.search.calibration_affordable` now)."""
    private = {str(p.relative_to(REPO)): names for p in sorted((REPO / "benchmarks").rglob("*.py"))
               if (names := _private_names_imported(p))}
    assert private == {}


def test_the_public_name_check_sees_a_private_import(tmp_path):
    source = tmp_path / "bench.py"
    source.write_text("from ds_hecate.planning.search.greedy import _greedy, schedule_materialization\n"
                      "from .local import _fine\n")
    assert _private_names_imported(source) == ["ds_hecate.planning.search.greedy:_greedy"]


#: ``ds_hecate``'s public face, listed once in its ``__init__`` (``__all__``): what users call
PUBLIC = {"HecateConfig", "HecateConfigError", "HecateError", "HecateModelError", "HecateUnsupportedError", "MoE",
          "SwiGLUExpert", "initialize", "num_parameters", "__version__"}


def test_public_face():
    """``import ds_hecate`` exposes what users call and nothing else public (the subpackages aside): everything
    else is internal, reached by its module path."""
    import inspect

    import ds_hecate
    assert set(ds_hecate.__all__) == PUBLIC
    assert all(hasattr(ds_hecate, name) for name in ds_hecate.__all__)
    exposed = {name for name, value in vars(ds_hecate).items()
               if not name.startswith("_") and not inspect.ismodule(value)}
    assert exposed == PUBLIC - {"__version__"}
    # the folders name the architecture; beside them only the modules every part may read
    top = sorted(p.stem for p in (REPO / "ds_hecate").glob("*.py"))
    assert top == ["__init__", "cli_args", "config", "errors", "experts", "logging_utils", "moe_layer", "trace"]


#: One layer call, downhill (docs/design.md): the layer plans and gathers, the dispatcher moves tokens, the experts'
#: node computes and hands its gradients to the reduction queue. Each file may import only files after it here; the
#: layer reads the runtime through ``runtime/host.py`` and never imports ``runtime/hecate.py``.
LAYER_CALL = ("ds_hecate.runtime.layer", "ds_hecate.runtime.call_plan", "ds_hecate.runtime.gathers",
              "ds_hecate.runtime.dispatcher", "ds_hecate.runtime.sharded_experts", "ds_hecate.runtime.reductions")


def _uphill(graph: Dict[str, Set[str]], order: Tuple[str, ...]) -> Set[Tuple[str, str]]:
    """(importer, imported) pairs of ``order``'s files where the imported one comes first, and any of them importing
    the runtime that owns the layers."""
    position = {m: i for i, m in enumerate(order)}
    return {(m, d) for m in order for d in graph[m]
            if (d in position and position[d] <= position[m]) or d == "ds_hecate.runtime.hecate"}


def test_the_layer_call_goes_downhill():
    assert _uphill(_graph(), LAYER_CALL) == set()


def test_the_downhill_check_sees_the_experts_calling_back_into_the_layer():
    graph: Dict[str, Set[str]] = {m: set() for m in LAYER_CALL}
    graph["ds_hecate.runtime.sharded_experts"] = {"ds_hecate.runtime.layer"}
    assert _uphill(graph, LAYER_CALL) == {("ds_hecate.runtime.sharded_experts", "ds_hecate.runtime.layer")}


def test_the_layer_reads_a_handful_of_the_runtime():
    """What ``runtime/layer.py`` reads of the runtime is :class:`~ds_hecate.runtime.host.LayerHost`: at most six
    members, and the layer reaches nothing else of ``self.host``."""
    from ds_hecate.runtime.host import LayerHost
    members = set(LayerHost.__annotations__) | {n for n in vars(LayerHost) if not n.startswith("_")}
    assert len(members) <= 6, sorted(members)
    tree = ast.parse((REPO / "ds_hecate" / "runtime" / "layer.py").read_text(encoding="utf-8"))
    def is_host(value: ast.AST) -> bool:   # ``self.host``, or a local ``host = self.host``
        return (isinstance(value, ast.Attribute) and value.attr == "host" and isinstance(value.value, ast.Name)
                and value.value.id == "self") or (isinstance(value, ast.Name) and value.id == "host")
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_host(node.value)}
    assert read <= members, sorted(read - members)
