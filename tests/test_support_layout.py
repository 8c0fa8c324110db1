"""The test suite's own layout: test modules import shared helpers from tests/support/, never
from each other (so any module runs alone, in any order); no file name in tests/ repeats
another or a module of the packages; the caches that hold device state are registered, so
tests/conftest.py can drop them."""

from __future__ import annotations

import ast
from pathlib import Path

from support.device_caches import clear_device_caches, device_cache

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PACKAGES = ("arcjax", "scheduler", "pallas_kernels")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_test_module_imports_another():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                             if m.split(".")[0].startswith("test_")
                                             or m.split(".")[0] == "tests")
           for p in TESTS.rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_file_names_in_tests_are_unique_and_differ_from_the_packages():
    seen: dict[str, list[str]] = {}
    files = [*TESTS.rglob("*.py"), *(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))]
    for path in files:
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
    assert (TESTS / "support" / "hf_models.py").is_file()  # the walk saw tests/support


def test_device_caches_are_registered_and_cleared():
    built = []

    @device_cache
    def engine(key):
        built.append(key)
        return object()

    first = engine("a")
    assert engine("a") is first and built == ["a"]
    assert clear_device_caches() >= 1
    assert engine("a") is not first and built == ["a", "a"]


def test_the_run_shares_one_persistent_compilation_cache():
    # tests/conftest.py names the directory before JAX is imported (JAX reads it then):
    # every worker and subprocess of the run finds the programs another one compiled.
    import os

    import jax

    assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert os.path.isdir(jax.config.jax_compilation_cache_dir)
    assert jax.config.jax_compilation_cache_max_size == -1  # no eviction's directory scans
