"""scripts/bench_gemm.py: one layer's products timed under XLA and, in another Python, torch;
the compiled CPU kernel's beside XLA's (`--impls`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels import cpu_build

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gemm.py"


def test_bench_gemm_times_every_product_in_both_engines(tmp_path):
    import arcjax
    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import model_config

    out = tmp_path / "gemm.json"
    # This suite's Python has torch (the reference implementation): it serves as the peer.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows=1,8", "--iters=2",
                           f"--torch_python={sys.executable}", f"--out={out}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cfg = model_config(resolve_model(str(arcjax.default_model_path())))
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    assert res["groups"]["mlp"] == [[h, i], [h, i], [i, h]]
    assert res["groups"]["qkv"][1] == [h, kv]
    keys = {f"{g}@{m}" for g in ("qkv", "o", "mlp") for m in (1, 8)}
    assert set(res["xla_ms"]) == keys and set(res["torch"]["ms"]) == keys
    assert all(ms > 0 for ms in res["xla_ms"].values())
    assert all(ms > 0 for ms in res["torch"]["ms"].values())
    assert "XLA / torch time" in proc.stdout


def test_bench_gemm_says_when_the_torch_peer_cannot_run(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows=1", "--iters=1",
                           f"--torch_python={tmp_path / 'missing-python'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch: skipped" in proc.stdout and "XLA" in proc.stdout


@pytest.mark.skipif(cpu_build.kernels_unavailable() is not None,
                    reason=str(cpu_build.kernels_unavailable()))
def test_bench_gemm_times_the_cpu_kernel_beside_xla(tmp_path):
    out = tmp_path / "gemm.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows=1,3", "--iters=2",
                           "--impls=xla,cpu", "--layers=2", f"--out={out}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    keys = {f"{g}@{m}" for g in ("qkv", "o", "mlp") for m in (1, 3)}
    assert set(res["xla_ms"]) == keys and set(res["cpu_kernel_ms"]) == keys
    assert res["layers"] == 2
    assert all(ms > 0 for ms in res["cpu_kernel_ms"].values())
    assert "kernel / XLA time" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--impls=xla,gpu"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--impls" in bad.stderr
