"""The H200 check behind `scripts/gpu_check.sh`: one run, JSON and a markdown table.

  1. Environment: python, jax/jaxlib and plugin versions, the devices, warnings seen.
  2. `pytest -m gpu` (kernel GPU tests; `JAX_PLATFORMS` is set so tests/conftest.py
     does not force the CPU).
  3. Correctness: every GPU implementation against the oracle on fresh random inputs
     (bf16, plus f32 for the precision rule), NaN-poisoned unowned pages, padding rows
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

DATASHEET_TBPS = 4.8  # H200 HBM3e

LLAMA8B_HEADS = (32, 8, 128)  # Hq, Hkv, D
TARGETS = dict(prefill_tflops=430.0, decode_tbps_fraction=0.8)  # issue 16, H200


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig:
    out: str
    cpu_smoke: bool
    budget_s: float
    peak_tflops: float
    peak_tbps: float
    impls: tuple[str, ...] = ("pallas_gpu", "triton", "mosaic_gpu")
    record: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelCase:
    name: str
    kind: str  # "prefill" | "decode" | "mixed"
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len)
    heads: tuple[int, int, int] = LLAMA8B_HEADS
    block_size: int = 16

    @property
    def max_q_len(self) -> int | None:
        return 1 if self.kind == "decode" else None


def kernel_cases(smoke: bool) -> list[KernelCase]:
    if smoke:
        heads = (4, 2, 64)
        return [KernelCase(name="prefill_c64", kind="prefill", seqs=((64, 64),), heads=heads),
                KernelCase(name="decode_4x96", kind="decode", seqs=((1, 96),) * 4, heads=heads),
                KernelCase(name="mixed_c40_plus3", kind="mixed",
                           seqs=((40, 72),) + ((1, 50),) * 2 + ((1, 4100),), heads=heads)]
    return [KernelCase(name="prefill_c2048", kind="prefill", seqs=((2048, 2048),)),
            KernelCase(name="prefill_c8192", kind="prefill", seqs=((8192, 8192),)),
            KernelCase(name="decode_256x2k", kind="decode", seqs=((1, 2048),) * 256),
            KernelCase(name="decode_64x8k", kind="decode", seqs=((1, 8192),) * 64),
            # A later 2k chunk, 62 decodes at 2k and one long (32k) decode row.
            KernelCase(name="mixed_c2048_plus63", kind="mixed",
                       seqs=((2048, 6144),) + ((1, 2048),) * 62 + ((1, 32768),))]


def tilings(kind: str) -> dict[str, dict[str, int]]:
    """make_gpu_plan overrides: the default and two alternatives per kind.

    `m64_stages2` / `stages2` is the tiling before issue 16 (64-row tiles, 2 stages)
    on today's kernel, so every table shows what the new defaults buy.
    """
    if kind == "decode":
        return {"default": {}, "stages2": {"num_stages": 2}, "k128": {"block_k": 128}}
    # nosplit: what the decode rows' split-K costs a prefill (its extra programs exit at
    # once) and buys a mixed batch with a long decode row.
    return {"default": {}, "m64_stages2": {"block_m": 64, "num_stages": 2},
            "nosplit": {"num_splits": 1}}


def correctness_cases(smoke: bool) -> list[tuple[str, list[tuple[int, int]], str]]:
    """(name, seqs, dtype): ragged mixes with decode rows, later chunks and an idle row.

    Each mixed batch has a decode row long enough (> 2 * MIXED_SPLIT_STEPS key steps)
    for the default plan to split it.
    """
    if smoke:
        mixed = [(9, 30), (1, 70), (0, 5), (1, 3), (1, 4100)]
        return [("mixed_bf16", mixed, "bfloat16"), ("mixed_f32", mixed, "float32")]
    mixed = [(300, 700), (1, 513), (37, 37), (0, 9), (1, 9000), (129, 1000)]
    return [("mixed_bf16", mixed, "bfloat16"), ("mixed_f32", mixed, "float32"),
            ("decode_bf16", [(1, 900), (1, 17), (1, 3000), (1, 1)], "bfloat16")]


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


def _plan(*, heads, block_size, tuning, max_q_len, batch):
    """The default plan of `batch` with `tuning` applied (make_gpu_plan overrides)."""
    from pallas_kernels import gpu_plan

    hq, hkv, d = heads
    return gpu_plan.make_gpu_plan(
        num_tokens=batch.q.shape[0], num_seqs=batch.block_tables.shape[0], num_heads=hq,
        num_kv_heads=hkv, head_dim=d, page_size=block_size,
        max_blocks=batch.block_tables.shape[1], max_q_len=max_q_len or batch.q.shape[0],
        itemsize=batch.q.dtype.itemsize, **tuning)


def _kernel(plan, head_dim: int, interpret: bool):
    import functools

    import jax

    from pallas_kernels import pallas_gpu

    return jax.jit(functools.partial(pallas_gpu.ragged_paged_attention_pallas_gpu,
                                     sm_scale=head_dim**-0.5, plan=plan, interpret=interpret))


def _runs(cfg: CheckConfig, tiling: str) -> bool:
    """The CPU smoke runs only the default tiling (interpret mode compiles slowly);
    the alternatives' plans are still built, so a bad override fails there too."""
    return not cfg.cpu_smoke or tiling == "default"


def _impl_fn(impl: str, cfg: CheckConfig, max_q_len: int | None):
    """The public entry point for `impl`, jitted (its default plan)."""
    import functools

    import jax

    from pallas_kernels import ragged_paged_attention

    return jax.jit(functools.partial(ragged_paged_attention, impl=impl,
                                     interpret=cfg.cpu_smoke, max_q_len=max_q_len))


def _impl_skip(impl: str, cfg: CheckConfig, kind: str) -> str | None:
    """Why `impl` does not run a `kind` case here, or None."""
    if impl == "mosaic_gpu" and kind != "decode":
        return "mosaic_gpu serves decode-only batches"
    if impl == "mosaic_gpu" and cfg.cpu_smoke:
        return "mosaic_gpu has no interpret mode (GPU only)"
    from pallas_kernels import backends

    if impl == "triton" and not cfg.cpu_smoke and backends.triton_unavailable():
        return backends.triton_unavailable()
    if impl == "mosaic_gpu" and backends.mosaic_gpu_unavailable():
        return backends.mosaic_gpu_unavailable()
    return None


def _compare(out, ref, real: int) -> dict:
    import numpy as np

    err = np.abs(out[:real] - ref[:real]) / (1 + np.abs(ref[:real]))
    return dict(nan=bool(np.isnan(out).any()), padding_exact_zero=bool((out[real:] == 0).all()),
                max_rel_err=float(np.nanmax(err)) if err.size else 0.0)


def correctness(cfg: CheckConfig) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import ragged_paged_attention
    from pallas_kernels.testing import make_batch

    tolerances = {"bfloat16": 3e-2, "float32": 2e-5}  # tests/test_kernels_attention.py
    heads = (4, 2, 64) if cfg.cpu_smoke else LLAMA8B_HEADS
    seed = int(time.time()) % 2**16  # fresh inputs every run; recorded to replay
    rows = []
    for name, seqs, dtype in correctness_cases(cfg.cpu_smoke):
        batch = make_batch(seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                           block_size=16, num_tokens=sum(q for q, _ in seqs) + 7,
                           seq_bucket=len(seqs) + 2, dtype=jnp.dtype(dtype), nan_fill=True,
                           seed=seed)
        ref = np.asarray(ragged_paged_attention(*batch.args(), impl="reference"), np.float32)
        real = int(batch.cu_seqlens_q[batch.num_seqs])
        for tiling, tuning in tilings("mixed" if name.startswith("mixed") else "decode").items():
            plan = _plan(heads=heads, block_size=16, tuning=tuning, batch=batch,
                         max_q_len=1 if name.startswith("decode") else None)
            if not _runs(cfg, tiling):
                continue
            if "pallas_gpu" not in cfg.impls:
                break
            out = np.asarray(_kernel(plan, heads[2], cfg.cpu_smoke)(*batch.args()), np.float32)
            row = dict(impl="pallas_gpu", case=name, tiling=tiling, dtype=dtype, seed=seed,
                       num_splits=plan.num_splits, rows=plan.rows,
                       tolerance=tolerances[dtype], **_compare(out, ref, real))
            row["ok"] = (not row["nan"] and row["padding_exact_zero"]
                         and row["max_rel_err"] <= row["tolerance"])
            rows.append(row)
        kind = "decode" if name.startswith("decode") else "mixed"
        for impl in (i for i in cfg.impls if i != "pallas_gpu"):
            row = dict(impl=impl, case=name, tiling="default", dtype=dtype, seed=seed,
                       tolerance=tolerances[dtype])
            skip = _impl_skip(impl, cfg, kind)
            if cfg.cpu_smoke and dtype == "float32":  # Triton's interpreter is slow: one case
                skip = skip or "cpu smoke: the bfloat16 case only"
            if skip:
                rows.append(row | dict(skipped=skip))
                continue
            try:
                fn = _impl_fn(impl, cfg, 1 if kind == "decode" else None)
                out = np.asarray(fn(*batch.args()), np.float32)
            except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
                rows.append(row | dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            row.update(_compare(out, ref, real))
            row["ok"] = (not row["nan"] and row["padding_exact_zero"]
                         and row["max_rel_err"] <= row["tolerance"])
            rows.append(row)
    ran = [r for r in rows if "skipped" not in r]
    section = dict(ok=all(r["ok"] for r in ran), rows=rows)
    if not cfg.cpu_smoke:
        section["recorded"] = record_verified(cfg, ran)
    return section


def record_verified(cfg: CheckConfig, rows: list[dict]) -> list[dict]:
    """Records every implementation whose cases all passed on this GPU (`verified`)."""
    from pallas_kernels import backends, verified

    done = []
    for impl in sorted({r["impl"] for r in rows}):
        mine = [r for r in rows if r["impl"] == impl]
        if mine and all(r["ok"] for r in mine):
            done.append(verified.record_pass(impl, backends.device_kind(), cases=len(mine),
                                             path=cfg.record))
    return done


def kernel_table(cfg: CheckConfig, report: Report) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels import testing

    dtype = jnp.bfloat16
    rows = []
    for i, case in enumerate(kernel_cases(cfg.cpu_smoke)):
        hq, hkv, d = case.heads
        batch = testing.make_device_batch(list(case.seqs), num_heads=hq, num_kv_heads=hkv,
                                          head_dim=d, block_size=case.block_size, dtype=dtype,
                                          key=jax.random.key(i))
        flops, kv_bytes = testing.attention_work(list(case.seqs), num_heads=hq,
                                                 num_kv_heads=hkv, head_dim=d, itemsize=2)
        runs = [("pallas_gpu", t, tuning) for t, tuning in tilings(case.kind).items()
                if "pallas_gpu" in cfg.impls]
        runs += [(impl, "default", {}) for impl in cfg.impls if impl != "pallas_gpu"]
        for impl, tiling, tuning in runs:
            row = dict(impl=impl, case=case.name, kind=case.kind, tiling=tiling, tuning=tuning)
            skip = "time budget spent" if report.elapsed() > cfg.budget_s else None
            skip = skip or (None if impl == "pallas_gpu" else _impl_skip(impl, cfg, case.kind))
            if cfg.cpu_smoke and impl != "pallas_gpu" and case.kind != "decode":
                skip = skip or "cpu smoke: the decode case only"  # the interpreter is slow
            if skip:
                rows.append(row | dict(skipped=skip))
                continue
            try:
                plan = _plan(heads=case.heads, block_size=case.block_size, tuning=tuning,
                             max_q_len=case.max_q_len, batch=batch)
                if not _runs(cfg, tiling):
                    rows.append(row | dict(skipped="cpu smoke: plan built, not run"))
                    continue
                warmup, iters = (0, 1) if cfg.cpu_smoke else (2, 10)
                fn = (_kernel(plan, d, cfg.cpu_smoke) if impl == "pallas_gpu"
                      else _impl_fn(impl, cfg, case.max_q_len))
                ms = testing.time_ms(fn, batch.args(), warmup=warmup, iters=iters)
            except Exception as e:  # noqa: BLE001 - a tiling that fails is a result
                rows.append(row | dict(error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            row.update(ms=ms, tflops=flops / ms / 1e9, tbps=kv_bytes / ms / 1e9,
                       of_datasheet_bw=kv_bytes / ms / 1e9 / DATASHEET_TBPS,
                       rows=plan.rows, block_k=plan.tiles.block_k, num_splits=plan.num_splits,
                       num_warps=plan.num_warps, num_stages=plan.num_stages)
            if case.kind == "prefill":
                row["target"] = f">= {TARGETS['prefill_tflops']:.0f} TFLOP/s"
                row["meets_target"] = row["tflops"] >= TARGETS["prefill_tflops"]
            elif case.kind == "decode":
                goal = TARGETS["decode_tbps_fraction"] * cfg.peak_tbps
                row["target"] = f">= {goal:.2f} TB/s"
                row["meets_target"] = row["tbps"] >= goal
            rows.append(row)
            print(f"  {case.name:22s} {impl:11s} {tiling:12s} {ms:9.3f} ms", flush=True)
            # Written row by row: a run cut short by the time limit keeps what it measured.
            report.add("kernel_table", dict(ok=True, partial=True, rows=rows))
        del batch
    errors = [r for r in rows if "error" in r]
    # Targets are recorded, not enforced: missing one is a finding, not a broken run.
    return dict(ok=not errors, dtype="bfloat16", rows=rows)


def end_to_end(cfg: CheckConfig, report: Report) -> dict:
    """The engine on a random-weight Llama-3-8B-shaped model: offline throughput and the
    seed's K=128 burst per arm, while the budget lasts (scripts/gpu_e2e.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
