"""Dependencies point down: every import statement of the three packages (module level or
inside a function: a lazy import is a dependency too), read with `ast`, checked against
the layers entrypoints -> engine -> structured -> parallel -> runtime -> model ->
pallas_kernels, with the scheduler importing only the standard library, and no cycle
between modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("arcjax", "scheduler", "pallas_kernels")
# Higher layers may import lower ones (and their own package); never the reverse.
LAYERS = {
    "arcjax": 9,  # the package root re-exports the public API
    "arcjax.generate": 8, "arcjax.serve": 8,  # `python -m` shims
    "arcjax.bench": 7, "arcjax.train": 7,  # tools: nothing below imports them
    "arcjax.entrypoints": 6,
    "arcjax.engine": 5,
    "arcjax.structured": 4.5,  # grammars and tool calls: used by engine and entrypoints
    "arcjax.parallel": 4,
    "arcjax.runtime": 3,
    "arcjax.model": 2,
    "pallas_kernels": 1,
    "arcjax.errors": 0.5,  # the scheduler's errors, re-exported
    "scheduler": 0,
}


def _layer(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise KeyError(module)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def import_edges() -> set[tuple[str, str]]:
    """(importer, imported) for every import of one of our modules, anywhere in a file."""
    modules = _modules()
    edges = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            for t in targets:
                while t and t not in modules:  # `import a.b.c` of a package path
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add((name, t))
    return edges


def violations(edges: set[tuple[str, str]]) -> list[str]:
    """Imports that point up (or sideways between layers), and module cycles."""
    bad = []
    for src, dst in sorted(edges):
        a, b = _layer(src), _layer(dst)
        if a != b and LAYERS[a] <= LAYERS[b]:
            bad.append(f"{src} imports {dst} ({a} may not depend on {b})")
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                bad.append("cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return bad


def test_dependencies_point_down_and_have_no_cycles():
    edges = import_edges()
    assert len(edges) > 100  # the walk really saw the packages
    assert ("arcjax.engine.engine", "arcjax.engine.core") in edges
    assert violations(edges) == []


def test_the_check_sees_upward_imports_and_cycles():
    edges = {("arcjax.model.weights", "arcjax.parallel.layout"),
             ("arcjax.parallel.multihost", "arcjax.engine.build"),
             ("arcjax.engine.build", "arcjax.parallel.multihost"),
             ("arcjax.engine.core", "arcjax.entrypoints.serve")}
    found = violations(edges)
    assert any("model.weights imports arcjax.parallel" in v for v in found)
    assert any("engine.core imports arcjax.entrypoints" in v for v in found)
    assert any(v.startswith("cycle:") and "multihost" in v for v in found)


def test_scheduler_imports_only_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    for path in (ROOT / "scheduler").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or top == "scheduler", f"{path.name} imports {name}"
