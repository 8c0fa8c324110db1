"""The package layout's promises: the engine core pulls in no tool dependencies."""

import subprocess
import sys


def test_import_arcjax_loads_no_bench_or_train_dependencies():
    code = ("import sys, arcjax, arcjax.entrypoints.generate_cli; "
            "heavy = {'scipy', 'matplotlib', 'optax', 'torch', 'transformers'} & set(sys.modules); "
            "assert not heavy, heavy; "
            "assert not any(m.startswith(('arcjax.bench', 'arcjax.train')) for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_core_does_not_import_bench_or_train():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "arcjax"
    for sub in ("engine", "model", "runtime", "entrypoints"):
        for path in (root / sub).glob("*.py"):
            text = path.read_text()
            assert "arcjax.bench" not in text and "arcjax.train" not in text, path
