"""scripts/gpu_check.sh --cpu-smoke: the H200 check's code paths, on the CPU.

The first real GPU run must not fail on a typo: this runs the same script end to
end with tiny shapes (kernels in interpret mode) and checks what it wrote.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--out",
                          str(out), "--cpu-smoke"], capture_output=True, text=True, env=env,
                         timeout=180, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["environment", "gpu_tests", "correctness", "kernel_table",
                              "end_to_end"]
    assert all(s["ok"] for s in sections.values()), sections
    assert sections["environment"]["jax"] and sections["environment"]["devices"]
    assert sections["gpu_tests"]["counts"].get("failed", 0) == 0
    checked = [r for r in sections["correctness"]["rows"] if "skipped" not in r]
    assert {r["dtype"] for r in checked} == {"bfloat16", "float32"}
    assert any(r.get("num_splits", 0) > 1 for r in checked)  # the mixed split-K path ran
    assert all(r["padding_exact_zero"] and not r["nan"] for r in checked)
    # Every implementation is in the report: Triton's kernel ran in its interpreter, the
    # Mosaic GPU kernel (no interpret mode) says why it did not run.
    assert {r["impl"] for r in checked} == {"pallas_gpu", "triton"}
    assert any(r["impl"] == "mosaic_gpu" for r in sections["correctness"]["rows"])
    table = sections["kernel_table"]["rows"]
    assert {r["kind"] for r in table} == {"prefill", "decode", "mixed"}
    assert {r["impl"] for r in table} == {"pallas_gpu", "triton", "mosaic_gpu"}
    timed = [r for r in table if "skipped" not in r]
    assert {r["impl"] for r in timed} == {"pallas_gpu", "triton"}
    assert all(r["ms"] > 0 for r in timed if r["tiling"] == "default")
    assert sum(r["tiling"] != "default" for r in table) == 2 * 3  # two alternatives each
    e2e = sections["end_to_end"]["rows"]
    assert [r["part"] for r in e2e] == ["throughput", "burst", "burst", "burst"]
    assert e2e[0]["output_tok_s"] > 0
    assert all(r["users_with_first_token"] == r["users"] for r in e2e[1:])
    markdown = (out / "gpu_check.md").read_text()
    assert "## kernel_table: ok" in markdown and "end_to_end" in markdown
