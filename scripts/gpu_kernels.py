"""Kernel sections of `scripts/gpu_check.py`: every GPU attention implementation against
the oracle, then timed.

  - correctness: fresh random ragged batches (NaN-poisoned unowned pages, padding rows
    that must come out as exact zeros) through the Pallas kernel (default tiling and two
    alternatives), the Triton kernel and the Mosaic GPU kernel (decode cases); an
    implementation whose every case passed on the GPU is recorded as verified.
  - kernel_table: prefill TFLOP/s, decode TB/s (and the fraction of the 4.8 TB/s
    datasheet), a mixed batch; Llama-8B heads.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_check import CheckConfig, Report

DATASHEET_TBPS = 4.8  # H200 HBM3e

LLAMA8B_HEADS = (32, 8, 128)  # Hq, Hkv, D
TARGETS = dict(prefill_tflops=430.0, decode_tbps_fraction=0.8)  # issue 16, H200


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



def _kernel(plan, interpret: bool):
    """The Pallas kernel with `plan`, jitted; it takes the batch's `AttentionInputs`."""
    import functools

    import jax

    from pallas_kernels import pallas_gpu

    return jax.jit(functools.partial(pallas_gpu.ragged_paged_attention_pallas_gpu, plan=plan,
                                     interpret=interpret))


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

    from pallas_kernels import api, ragged_paged_attention
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
        inputs = batch.inputs(max_q_len=1 if name.startswith("decode") else None)
        for tiling, tuning in tilings("mixed" if name.startswith("mixed") else "decode").items():
            plan = api.gpu_plan_for(inputs, **tuning)
            if not _runs(cfg, tiling):
                continue
            if "pallas_gpu" not in cfg.impls:
                break
            out = np.asarray(_kernel(plan, cfg.cpu_smoke)(inputs), np.float32)
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

    from pallas_kernels import api, testing

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
                inputs = batch.inputs(max_q_len=case.max_q_len)
                plan = api.gpu_plan_for(inputs, **tuning)
                if not _runs(cfg, tiling):
                    rows.append(row | dict(skipped="cpu smoke: plan built, not run"))
                    continue
                warmup, iters = (0, 1) if cfg.cpu_smoke else (2, 10)
                if impl == "pallas_gpu":
                    fn, args = _kernel(plan, cfg.cpu_smoke), (inputs,)
                else:
                    fn, args = _impl_fn(impl, cfg, case.max_q_len), batch.args()
                ms = testing.time_ms(fn, args, warmup=warmup, iters=iters)
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
