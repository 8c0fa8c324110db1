"""Dependencies point down: every import statement of the three packages (module level or
inside a function: a lazy import is a dependency too), read with `ast`, checked against
the layers entrypoints -> engine -> structured -> parallel -> runtime -> model ->
pallas_kernels, with the scheduler importing only the standard library, and no cycle
between modules.

A feature that spans layers has one package (`arcjax/spec_decode/`, `arcjax/lora/`), and
each of its modules sits at the layer of the code it extends (`FEATURE_LAYERS`). Two more rules keep
the names honest: no two modules share a file name across packages, and a name is
imported from the module that defines it, never through one that only imports it (package
`__init__` files and the public error facade `arcjax.errors` are the exceptions)."""

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
    "arcjax.outputs": 0.7,  # public output types (vLLM's path)
    "arcjax.sampling_params": 0.6,  # public request types (vLLM's path)
    "arcjax.pooling_params": 0.6,
    "arcjax.errors": 0.5,  # the scheduler's errors, re-exported
    "scheduler": 0,
}
# Modules of feature packages, each at the layer of the code it extends.
FEATURE_LAYERS = {
    "arcjax.spec_decode.speculative_config": "arcjax.runtime",
    "arcjax.spec_decode.ngram_proposer": "arcjax.runtime",
    "arcjax.spec_decode.draft_model": "arcjax.runtime",
    "arcjax.spec_decode.speculator": "arcjax.engine",
    "arcjax.spec_decode": "arcjax.engine",  # the package itself
    # reasoning formats and the gate that starts a grammar after the reasoning: used by the
    # engine (outputs, grammars) and the server
    "arcjax.reasoning": "arcjax.structured",
    "arcjax.lora.lora_request": "arcjax.sampling_params",  # a public request type
    "arcjax.lora.peft_adapter": "arcjax.model",
    "arcjax.lora.lora_config": "arcjax.runtime",
    "arcjax.lora.slot_table": "arcjax.runtime",
    "arcjax.lora.adapter_cache": "arcjax.runtime",
    "arcjax.lora": "arcjax.engine",  # the package itself
}


def _layer(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FEATURE_LAYERS:
            return FEATURE_LAYERS[".".join(parts[:n])]
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
    return bad + cycles(edges)


def cycles(edges: set[tuple[str, str]]) -> list[str]:
    """Every cycle a depth-first walk of the graph meets, as "cycle: a -> b -> a"."""
    bad = []
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


def _package(module: str) -> str:
    """The top package or arcjax subpackage a module belongs to (arcjax.model.formats.hub ->
    arcjax.model; a module directly under arcjax is its own)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "arcjax" else parts[0]


def package_edges(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(_package(a), _package(b)) for a, b in edges if _package(a) != _package(b)}


def test_dependencies_point_down_and_have_no_cycles():
    edges = import_edges()
    assert len(edges) > 100  # the walk really saw the packages
    assert ("arcjax.engine.engine", "arcjax.engine.core") in edges
    assert violations(edges) == []


def test_packages_import_each_other_one_way():
    # Feature packages (spec_decode, lora) sit at one place in the order, not above and
    # below another package at once: a function-level import counts too.
    pkgs = package_edges(import_edges())
    assert ("arcjax.spec_decode", "arcjax.runtime") in pkgs
    assert cycles(pkgs) == []
    assert cycles(pkgs | {("arcjax.runtime", "arcjax.spec_decode")})  # the check sees one


def test_the_check_sees_upward_imports_and_cycles():
    edges = {("arcjax.model.formats.hf_checkpoint", "arcjax.parallel.layout"),
             ("arcjax.parallel.multihost", "arcjax.engine.build"),
             ("arcjax.engine.build", "arcjax.parallel.multihost"),
             ("arcjax.engine.core", "arcjax.entrypoints.openai.api_server")}
    found = violations(edges)
    assert any("formats.hf_checkpoint imports arcjax.parallel" in v for v in found)
    assert any("engine.core imports arcjax.entrypoints" in v for v in found)
    assert any(v.startswith("cycle:") and "multihost" in v for v in found)


FORMATS = "arcjax.model.formats"
# The modules that each read one format's files completely, for the loader to place.
FORMAT_READERS = (f"{FORMATS}.hf_checkpoint", f"{FORMATS}.quantized_checkpoint",
                  f"{FORMATS}.gguf_file")


def format_violations(edges: set[tuple[str, str]]) -> list[str]:
    """Imports against loading's one way down: loader -> a format's reader -> hf_layout.
    The architectures (arcjax.model outside formats/) import no format, hf_layout imports
    no format, and a reader imports neither the loader nor another format's reader."""
    bad = []
    for src, dst in sorted(edges):
        if not dst.startswith(FORMATS + "."):
            continue
        if src.startswith("arcjax.model.") and not src.startswith(FORMATS):
            bad.append(f"{src} imports {dst} (the architectures import no format)")
        elif src == f"{FORMATS}.hf_layout":
            bad.append(f"{src} imports {dst} (the shared layout imports no format)")
        elif src in FORMAT_READERS and (dst in FORMAT_READERS or dst == f"{FORMATS}.loader"):
            bad.append(f"{src} imports {dst} (a format reads its own files, for the loader)")
    return bad


def test_loading_is_one_way_down():
    edges = import_edges()
    for reader in FORMAT_READERS:
        assert (f"{FORMATS}.loader", reader) in edges
        assert (reader, f"{FORMATS}.hf_layout") in edges
    assert format_violations(edges) == []


def test_the_format_check_sees_a_bounce():
    edges = {(f"{FORMATS}.gguf_file", f"{FORMATS}.hf_checkpoint"),
             (f"{FORMATS}.quantized_checkpoint", f"{FORMATS}.loader"),
             (f"{FORMATS}.hf_layout", f"{FORMATS}.hub"),
             ("arcjax.model.specs", f"{FORMATS}.hf_layout"),
             (f"{FORMATS}.loader", f"{FORMATS}.gguf_file")}
    found = format_violations(edges)
    assert len(found) == 4 and not any("imports arcjax.model.formats.gguf_file" in v
                                       for v in found), found


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


def test_no_two_modules_share_a_name():
    """One name per module: `config.py`, `errors.py`, `request.py` ... once each, so a file
    name says which module it is (package `__init__` files aside)."""
    seen: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


FACADES = {"arcjax.errors"}  # the public error module: the scheduler's classes, re-exported


def _top_level_names(tree: ast.Module) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """(names a module defines, {name: (module, original name)} it imports absolutely)."""
    defined, imported = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.update({a.asname or a.name: (node.module, a.name) for a in node.names})
    return defined, {k: v for k, v in imported.items() if k not in defined}


def reexports(sources: dict[Path, str]) -> list[str]:
    """`from M import N` in `sources` ({path: text}) where M (not a package or a facade)
    only imports N."""
    modules = _modules()
    names = {m: _top_level_names(ast.parse(p.read_text())) for m, p in modules.items()}
    bad = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.ImportFrom) and node.module in modules
                    and not node.level and node.module not in FACADES
                    and modules[node.module].name != "__init__.py"):
                continue
            for alias in node.names:
                defined, imported = names[node.module]
                if alias.name in imported and alias.name not in defined:
                    home = imported[alias.name][0]
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports "
                               f"{alias.name} from {node.module}, which takes it from {home}")
    return bad


def test_names_are_imported_from_their_home():
    files = [p for d in (*PACKAGES, "tests", "scripts") for p in (ROOT / d).rglob("*.py")]
    assert reexports({p: p.read_text() for p in files}) == []


def test_the_reexport_check_sees_one():
    probe = ROOT / "tests" / "probe.py"  # MAX_LOGPROBS lives in arcjax.sampling_params
    found = reexports({probe: "from arcjax.runtime.sampling import MAX_LOGPROBS\n"})
    assert len(found) == 1 and "arcjax.sampling_params" in found[0]


RETIRED = ("arcjax.runtime.sampling_params", "arcjax.runtime.structured_params",
           "arcjax.engine.outputs", "arcjax.engine.input", "arcjax.engine.output",
           "arcjax.runtime.outputs", "arcjax.runtime.speculative", "arcjax.runtime.ngram",
           "arcjax.runtime.draft_model", "arcjax.runtime.spec_decode", "arcjax.engine.spec",
           "arcjax.model.gguf", "arcjax.model.weights", "arcjax.model.loader",
           "arcjax.model.hub", "arcjax.entrypoints.serve", "arcjax.entrypoints.metrics",
           "arcjax.entrypoints.openai_protocol", "arcjax.structured.tools",
           "pallas_kernels.options")


def test_the_old_paths_are_gone():
    """Moved modules left no shim behind: one home per type, one path per module."""
    assert sorted(set(RETIRED) & set(_modules())) == []
