"""The H200 check behind `scripts/gpu_check.sh`: one run, JSON and a markdown table.

  1. Environment: python, jax/jaxlib and plugin versions, the devices, warnings seen.
  2. `pytest -m gpu` (kernel GPU tests; `JAX_PLATFORMS` is set so tests/conftest.py
     does not force the CPU).
  3. Correctness (scripts/gpu_kernels.py): every GPU implementation against the oracle
     on fresh random inputs (bf16, plus f32 for the precision rule), NaN-poisoned
     unowned pages, padding rows
     that must be exact zeros: the Pallas kernel for the default tiling and both
     alternatives, the Triton kernel (jax_triton), the Mosaic GPU kernel (decode cases).
     An implementation whose every case passed on the GPU is recorded as verified
     (`pallas_kernels.verified`): "auto" uses the Mosaic GPU kernel only after that.
  4. Kernel table: prefill chunks of 2,048 and 8,192 tokens (TFLOP/s), decode 256 x 2k
     and 64 x 8k (TB/s, and as a fraction of the 4.8 TB/s datasheet), a mixed batch;
     Llama-8B heads (32:8, D=128), block 16; every implementation, the Pallas kernel
     also with two alternative tilings.
  5. End to end (scripts/gpu_e2e.py): a random-weight Llama-3-8B-shaped model, offline
     throughput and the seed's K=128 burst per arm.

Every section is written to `--out` as soon as it finishes, so a run cut short by the
time limit still leaves what it measured. `--cpu_smoke` runs the same code with tiny
shapes on the CPU (kernels in interpret mode: Pallas', Triton's interpreter; the Mosaic
GPU kernel has none and is skipped) to catch mistakes before a GPU run.

  scripts/gpu_check.sh --out /tmp/gpu_check          # on the H200
  scripts/gpu_check.sh --out /tmp/smoke --cpu-smoke  # anywhere, < 1 minute
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels import correctness, kernel_table  # noqa: E402  (a script beside this one)

_OUT = flags.DEFINE_string("out", None, "directory for gpu_check.json and gpu_check.md")
_CPU_SMOKE = flags.DEFINE_boolean("cpu_smoke", False,
                                  "tiny shapes on the CPU, kernels in interpret mode")
_BUDGET_S = flags.DEFINE_float("budget_s", 450.0,
                               "stop starting new measurements after this many seconds")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 790.0, "measured bf16 matmul peak, TFLOP/s")
_PEAK_TBPS = flags.DEFINE_float("peak_tbps", 4.3, "measured HBM bandwidth, TB/s")
_IMPLS = flags.DEFINE_list("impls", ["pallas_gpu", "triton", "mosaic_gpu"],
                           "GPU attention implementations to check and time")
_RECORD = flags.DEFINE_string("record", None, "verified-kernel record file (default: "
                              "pallas_kernels.verified.local_path())")



@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig:
    out: str
    cpu_smoke: bool
    budget_s: float
    peak_tflops: float
    peak_tbps: float
    impls: tuple[str, ...] = ("pallas_gpu", "triton", "mosaic_gpu")
    record: str | None = None



class Report:
    """Sections as they finish, rewritten to JSON and markdown after each one."""

    def __init__(self, cfg: CheckConfig):
        self.cfg, self.start = cfg, time.monotonic()
        self.sections: dict[str, dict] = {}
        os.makedirs(cfg.out, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def add(self, name: str, section: dict) -> None:
        section["seconds"] = round(self.elapsed(), 1)
        self.sections[name] = section
        self.write()

    def write(self) -> None:
        with open(os.path.join(self.cfg.out, "gpu_check.json"), "w") as f:
            json.dump(dict(config=dataclasses.asdict(self.cfg), sections=self.sections), f,
                      indent=2, default=str)
        with open(os.path.join(self.cfg.out, "gpu_check.md"), "w") as f:
            f.write(to_markdown(self.sections))

    @property
    def ok(self) -> bool:
        return all(s.get("ok", True) for s in self.sections.values())


def run_section(report: Report, name: str, fn, *args) -> None:
    """Runs one section; an exception becomes a failed section, not a lost run."""
    try:
        section = fn(*args)
    except Exception as e:  # noqa: BLE001 - report it and go on to the next section
        section = dict(ok=False, error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc(limit=8))
    report.add(name, section)
    print(f"[{report.elapsed():6.1f}s] {name}: {'ok' if section.get('ok', True) else 'FAILED'}",
          flush=True)


def environment(cfg: CheckConfig, seen: list[warnings.WarningMessage]) -> dict:
    import jax
    import jaxlib

    devices = jax.devices()
    env = dict(python=platform.python_version(), jax=jax.__version__,
               jaxlib=jaxlib.__version__, backend=jax.default_backend(),
               devices=[f"{d.platform}:{d.device_kind}" for d in devices],
               jax_platforms=os.environ.get("JAX_PLATFORMS", ""))
    try:
        from importlib import metadata
        env["packages"] = {d.metadata["Name"]: d.version for d in metadata.distributions()
                           if re.match(r"jax|triton|nvidia-cu|numpy$", d.metadata["Name"] or "")}
    except Exception as e:  # noqa: BLE001 - versions are a nicety
        env["packages"] = f"unavailable: {e}"
    env["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
    from pallas_kernels import backends, resolve_impl

    env["attention"] = dict(
        pallas_triton=backends.pallas_triton_state(),
        triton=backends.triton_unavailable() or "available",
        mosaic_gpu=backends.mosaic_gpu_unavailable() or "available",
        auto_mixed=resolve_impl("auto", head_dim=128, block_size=16, max_q_len=None),
        auto_decode=resolve_impl("auto", head_dim=128, block_size=16, max_q_len=1))
    on_gpu = jax.default_backend() == "gpu"
    env["ok"] = cfg.cpu_smoke or on_gpu
    if not env["ok"]:
        env["error"] = f"expected a GPU backend, got {jax.default_backend()}"
    return env


def gpu_tests(cfg: CheckConfig) -> dict:
    """`pytest -m gpu` in a subprocess; on the GPU every selected test must run."""
    paths = ["tests/test_kernels_pallas_gpu.py"] if cfg.cpu_smoke else ["tests"]
    env = dict(os.environ, JAX_PLATFORMS="cpu" if cfg.cpu_smoke else "cuda,cpu")
    junit = os.path.join(cfg.out, "pytest_gpu.xml")
    # A module that fails to import (say, a serving test without fastapi) is counted as an
    # error, but must not stop the GPU tests of the other modules from running.
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={junit}", *paths]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240,
                         check=False)
    tail = (res.stdout + res.stderr)[-3000:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|deselected)",
                                               tail)}
    ok = res.returncode == 0 and counts.get("failed", 0) == 0 and counts.get("error", 0) == 0
    if not cfg.cpu_smoke:  # on the H200 a skipped GPU test is a failure to check
        ok = ok and counts.get("passed", 0) > 0 and counts.get("skipped", 0) == 0
    return dict(ok=ok, command=" ".join(cmd), returncode=res.returncode, counts=counts,
                output_tail=tail)



def end_to_end(cfg: CheckConfig, report: Report) -> dict:
    """The engine on a random-weight Llama-3-8B-shaped model: offline throughput and the
    seed's K=128 burst per arm, while the budget lasts (scripts/gpu_e2e.py)."""
    import gpu_e2e

    return gpu_e2e.run(cfg.cpu_smoke, lambda: cfg.budget_s - report.elapsed())


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def to_markdown(sections: dict[str, dict]) -> str:
    out = ["# gpu_check", ""]
    for name, s in sections.items():
        out += [f"## {name}: {'ok' if s.get('ok', True) else 'FAILED'} "
                f"(at {s.get('seconds', 0)} s)", ""]
        if "error" in s:
            out += ["```", s["error"], "```", ""]
        if name == "environment" and "jax" in s:
            out += [_table([s], ["python", "jax", "jaxlib", "backend", "devices"]), ""]
            out += [f"- attention: {s['attention']}"] if "attention" in s else []
            out += [f"- warning: {w}" for w in s.get("warnings", [])] + [""]
        elif name == "gpu_tests":
            out += [f"`{s.get('command', '')}`: {s.get('counts', {})}", ""]
        elif name == "correctness":
            out += [_table(s.get("rows", []), ["impl", "case", "tiling", "dtype", "num_splits",
                                               "max_rel_err", "tolerance", "nan",
                                               "padding_exact_zero", "ok", "error",
                                               "skipped"]), ""]
            out += [f"- recorded as verified: {r['impl']} on {r['device_kind']}"
                    for r in s.get("recorded", [])] + [""]
        elif name == "kernel_table":
            out += [_table(s.get("rows", []), ["impl", "case", "tiling", "ms", "tflops", "tbps",
                                               "of_datasheet_bw", "rows", "block_k",
                                               "num_splits", "num_stages", "target",
                                               "meets_target", "error", "skipped"]), ""]
        elif name == "end_to_end":
            out += [_table(s.get("rows", []), ["part", "arm", "requests", "users", "wall_s",
                                               "prefill_tok_s", "output_tok_s", "ttft_p50_s",
                                               "ttft_p90_s", "ttft_max_s",
                                               "users_first_token_within_2s", "max_stall_s",
                                               "skipped"]), ""]
    return "\n".join(out)


def main(argv):
    del argv
    if not _OUT.value:
        raise app.UsageError("--out DIR is required")
    cfg = CheckConfig(out=_OUT.value, cpu_smoke=_CPU_SMOKE.value, budget_s=_BUDGET_S.value,
                      peak_tflops=_PEAK_TFLOPS.value, peak_tbps=_PEAK_TBPS.value,
                      impls=tuple(_IMPLS.value), record=_RECORD.value)
    if cfg.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    report = Report(cfg)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_section(report, "environment", environment, cfg, seen)
        if not report.ok:  # no GPU (and no --cpu_smoke): nothing below would mean anything
            sys.exit(f"gpu_check: {report.sections['environment'].get('error')}; "
                     f"see {cfg.out}/gpu_check.md (use --cpu-smoke off the GPU)")
        run_section(report, "gpu_tests", gpu_tests, cfg)
        run_section(report, "correctness", correctness, cfg)
        run_section(report, "kernel_table", kernel_table, cfg, report)
        run_section(report, "end_to_end", end_to_end, cfg, report)
        # Warnings raised while the kernels lowered and compiled (e.g. deprecations).
        if "warnings" in report.sections["environment"]:
            report.sections["environment"]["warnings"] = sorted(
                {f"{w.category.__name__}: {w.message}" for w in seen})
            report.write()
    print(f"wrote {cfg.out}/gpu_check.json and gpu_check.md; "
          f"{'all sections ok' if report.ok else 'SOME SECTIONS FAILED'}")
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    app.run(main)
