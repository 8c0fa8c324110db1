"""Kernel tasks of `scripts/gpu_check.py` (each runs in its own process, gpu_child.py).

  - `correctness` (one implementation per task): fresh random ragged batches against the
    oracle: ragged prefill, mixed prefill+decode (a decode row long enough to split),
    decode-only, sliding windows, soft-caps, float8 pages with k/v scales, GQA 4 and 8,
    pages of 16 and 32 tokens; bf16, and f32 for the precision rule. Unowned pages and
    slots past kv_len are NaN, padding rows must come out as exact zeros. Each case
    belongs to a shape class (`pallas_kernels.verified.ShapeClass`): what a passing run
    records.
  - `table` (one implementation per task): the kernel table on Llama-8B heads (32:8,
    D=128, 16-token pages): prefill chunks of 2,048 and 8,192 tokens (TFLOP/s), decode
    256 x 2k, 64 x 8k and 128 x 450 (one layer of the burst: 128 users, 450 tokens
    each), a mixed batch (bytes/s); `params["tilings"] == "alternatives"` times the
    alternative tilings of the Pallas and Triton kernels instead (and checks each
    against the default tiling's output).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_child import Emitter, Task

LLAMA8B_HEADS = (32, 8, 128)  # Hq, Hkv, D: GQA 4
GQA8_HEADS = (32, 4, 128)
SMOKE_HEADS = (4, 2, 64)
TOLERANCES = {"bfloat16": 3e-2, "float32": 2e-5}  # tests/support/attention_batches.py
FP8_SCALES = (0.05, 0.25)  # k, v


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrectnessCase:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len)
    heads: tuple[int, int, int] = LLAMA8B_HEADS
    block_size: int = 16
    dtype: str = "bfloat16"
    decode: bool = False  # a decode-only batch (max_q_len=1)
    window: int | None = None
    softcap: float | None = None
    fp8: bool = False
    quick: bool = False  # runs in every implementation's interpreter in the CPU smoke

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and not self.fp8

    @property
    def shape(self):
        from pallas_kernels.verified import ShapeClass

        hq, hkv, d = self.heads
        return ShapeClass(head_dim=d, page_size=self.block_size, gqa=hq // hkv,
                          window=self.window is not None, softcap=self.softcap is not None,
                          fp8=self.fp8)


def correctness_cases(smoke: bool) -> list[CorrectnessCase]:
    if smoke:
        mixed = ((9, 30), (1, 70), (0, 5), (1, 3), (1, 4100))
        h = SMOKE_HEADS
        return [CorrectnessCase(name="mixed_bf16", seqs=mixed, heads=h, quick=True),
                CorrectnessCase(name="mixed_f32", seqs=mixed, heads=h, dtype="float32"),
                CorrectnessCase(name="decode_bf16", seqs=((1, 90), (1, 17), (1, 1)), heads=h,
                                decode=True),
                CorrectnessCase(name="fp8_window_softcap", seqs=((9, 30), (1, 70), (1, 40)),
                                heads=h, window=16, softcap=30.0, fp8=True, quick=True)]
    prefill = ((300, 300), (129, 129), (37, 37), (0, 9), (512, 512), (1, 1))
    mixed = ((300, 700), (1, 513), (37, 37), (0, 9), (1, 9000), (129, 1000))
    decode = ((1, 900), (1, 17), (1, 3000), (1, 1), (0, 5), (1, 4500))
    return [
        CorrectnessCase(name="prefill_g4_p16", seqs=prefill),
        CorrectnessCase(name="mixed_g4_p16", seqs=mixed),
        CorrectnessCase(name="mixed_g4_p16_f32", seqs=mixed, dtype="float32"),
        CorrectnessCase(name="decode_g4_p16", seqs=decode, decode=True),
        CorrectnessCase(name="mixed_g8_p32", seqs=mixed, heads=GQA8_HEADS, block_size=32),
        CorrectnessCase(name="decode_g8_p32", seqs=decode, heads=GQA8_HEADS, block_size=32,
                        decode=True),
        CorrectnessCase(name="window_softcap_mixed", seqs=mixed, window=200, softcap=30.0),
        CorrectnessCase(name="window_decode", seqs=decode, window=500, decode=True),
        CorrectnessCase(name="fp8_mixed", seqs=mixed, fp8=True),
        CorrectnessCase(name="fp8_decode", seqs=decode, fp8=True, decode=True),
    ]


def unsupported(impl: str, case: CorrectnessCase) -> str | None:
    """Why `impl` does not implement `case` (a skip that does not block its record)."""
    if impl == "mosaic_gpu":
        if not case.decode:
            return "mosaic_gpu serves decode-only batches"
        if not case.plain or case.dtype != "bfloat16":
            return "mosaic_gpu: plain bf16/f16 batches only"
    return None


def unavailable(impl: str, smoke: bool) -> str | None:
    """Why `impl` cannot run here at all (nothing runs, nothing is recorded)."""
    from pallas_kernels import impl_unavailable

    return impl_unavailable(impl, interpret=smoke, platform=None if smoke else "gpu")


def _inputs(case: CorrectnessCase, seed: int):
    """(the case's `AttentionInputs`, the oracle's output, real rows)."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from pallas_kernels import paged_attention
    from pallas_kernels.testing import make_batch

    hq, hkv, d = case.heads
    batch = make_batch(list(case.seqs), num_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=case.block_size,
                       num_tokens=sum(q for q, _ in case.seqs) + 7, seq_bucket=len(case.seqs) + 2,
                       dtype=jnp.dtype(case.dtype), nan_fill=True, seed=seed)
    scales = {}
    if case.fp8:
        fp8, top = jnp.float8_e4m3fn, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
        ks, vs = FP8_SCALES
        k_pages, v_pages = (jnp.clip(p.astype(jnp.float32) / s, -top, top).astype(fp8)
                            for p, s in ((batch.k_pages, ks), (batch.v_pages, vs)))
        batch = dataclasses.replace(batch, k_pages=k_pages, v_pages=v_pages)
        scales = dict(k_scale=ks, v_scale=vs)
    # The window and the scales are pytree leaves: traced under jit, as in the engine.
    inputs = batch.inputs(sliding_window=case.window, logit_softcap=case.softcap,
                          max_q_len=1 if case.decode else None, **scales)
    ref = paged_attention(inputs, impl="reference")
    return inputs, np.asarray(ref, np.float32), int(batch.cu_seqlens_q[batch.num_seqs])


def _call(impl: str, smoke: bool):
    """The dispatch for `impl` (`paged_attention`), jitted over the whole `AttentionInputs`."""
    import jax

    from pallas_kernels import paged_attention

    return jax.jit(functools.partial(paged_attention, impl=impl, interpret=smoke))


def compare(out, ref, real: int) -> dict:
    """NaNs, exact-zero padding rows past `real`, max |out - ref| / (1 + |ref|) of the rest."""
    import numpy as np

    err = np.abs(out[:real] - ref[:real]) / (1 + np.abs(ref[:real]))
    return dict(nan=bool(np.isnan(out).any()), padding_exact_zero=bool((out[real:] == 0).all()),
                max_rel_err=float(np.nanmax(err)) if err.size else 0.0)


def correctness(task: Task, emit: Emitter) -> dict:
    import jax
    import numpy as np

    impl = task.name
    seed = int(time.time()) % 2**16  # fresh inputs every run; recorded to replay
    why_not = unavailable(impl, task.smoke)
    for case in correctness_cases(task.smoke):
        row = dict(impl=impl, case=case.name, shape_class=case.shape.key, dtype=case.dtype,
                   decode=case.decode, tolerance=TOLERANCES[case.dtype], seed=seed)
        if unsupported(impl, case) is not None:
            emit.row(row | dict(skipped=unsupported(impl, case), blocks_record=False))
            continue
        if why_not is not None or task.seconds_left() < 5:
            emit.row(row | dict(skipped=why_not or "time budget spent", blocks_record=True))
            continue
        if task.smoke and impl != "pallas_gpu" and not case.quick:
            emit.row(row | dict(skipped="cpu smoke: the interpreter runs the quick cases only",
                                blocks_record=False))
            continue
        emit.start(case.name)
        start = time.perf_counter()
        try:
            inputs, ref, real = _inputs(case, seed)
            out = np.asarray(_call(impl, task.smoke)(inputs), np.float32)
            row.update(compare(out, ref, real))
            row["ok"] = (not row["nan"] and row["padding_exact_zero"]
                         and row["max_rel_err"] <= row["tolerance"])
        except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        emit.row(row | dict(seconds=round(time.perf_counter() - start, 2)))
    return dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend(),
                seed=seed)


# --- the kernel table -----------------------------------------------------------------------

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
        h = SMOKE_HEADS
        return [KernelCase(name="prefill_c64", kind="prefill", seqs=((64, 64),), heads=h),
                KernelCase(name="decode_4x96", kind="decode", seqs=((1, 96),) * 4, heads=h),
                KernelCase(name="mixed_c40_plus3", kind="mixed",
                           seqs=((40, 72),) + ((1, 50),) * 2 + ((1, 4100),), heads=h)]
    return [KernelCase(name="prefill_c2048", kind="prefill", seqs=((2048, 2048),)),
            KernelCase(name="prefill_c8192", kind="prefill", seqs=((8192, 8192),)),
            KernelCase(name="decode_256x2k", kind="decode", seqs=((1, 2048),) * 256),
            KernelCase(name="decode_64x8k", kind="decode", seqs=((1, 8192),) * 64),
            # one layer of the burst's decode steps: 128 users, 380-token prompts + 64 new
            KernelCase(name="decode_128x450", kind="decode", seqs=((1, 450),) * 128),
            # a later 2k chunk, 62 decodes at 2k and one long (32k) decode row
            KernelCase(name="mixed_c2048_plus63", kind="mixed",
                       seqs=((2048, 6144),) + ((1, 2048),) * 62 + ((1, 32768),))]


def alternative_tilings(kind: str) -> dict[str, dict[str, int]]:
    """make_gpu_plan overrides beside the default. `m64_stages2` / `stages2` is the tiling
    before issue 16 (64-row tiles, 2 stages); `nosplit`: what split-K costs a prefill and
    buys a mixed batch with a long decode row."""
    if kind == "decode":
        return {"stages2": {"num_stages": 2}, "k128": {"block_k": 128}}
    return {"m64_stages2": {"block_m": 64, "num_stages": 2}, "nosplit": {"num_splits": 1}}


def _tiled_fn(impl: str, plan, smoke: bool):
    """`impl`'s kernel with an explicit plan (the alternative tilings), jitted; it takes
    the batch's `AttentionInputs`."""
    import jax

    from pallas_kernels import pallas_gpu, triton_gpu

    kernel = (pallas_gpu.ragged_paged_attention_pallas_gpu if impl == "pallas_gpu"
              else triton_gpu.ragged_paged_attention_triton)
    return jax.jit(functools.partial(kernel, plan=plan, interpret=smoke))


def _runs(impl: str, case: KernelCase, alternatives: bool, smoke: bool):
    """[(tiling, tuning)] this task times for `case`, or a reason it times none."""
    if impl == "mosaic_gpu" and case.kind != "decode":
        return "mosaic_gpu serves decode-only batches"
    if alternatives:
        if impl == "mosaic_gpu":
            return "mosaic_gpu has one tiling"
        if smoke and case.kind != "decode":
            return "cpu smoke: one alternative tiling of the decode case only"
        tilings = list(alternative_tilings(case.kind).items())
        return tilings[:1] if smoke else tilings
    if smoke and impl != "pallas_gpu" and case.kind != "decode":
        return "cpu smoke: the interpreter times the decode case only"
    return [("default", {})]


def table(task: Task, emit: Emitter) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gpu_bench import time_call
    from pallas_kernels import api, paged_attention, testing

    impl, alternatives = task.name, task.params.get("tilings") == "alternatives"
    why_not = unavailable(impl, task.smoke)
    for i, case in enumerate(kernel_cases(task.smoke)):
        runs = _runs(impl, case, alternatives, task.smoke)
        base = dict(impl=impl, case=case.name, kind=case.kind)
        if isinstance(runs, str) or why_not is not None:
            emit.row(base | dict(tiling="default", skipped=why_not or runs))
            continue
        hq, hkv, d = case.heads
        batch = testing.make_device_batch(list(case.seqs), num_heads=hq, num_kv_heads=hkv,
                                          head_dim=d, block_size=case.block_size,
                                          dtype=jnp.bfloat16, key=jax.random.key(i))
        flops, kv_bytes = testing.attention_work(list(case.seqs), num_heads=hq,
                                                 num_kv_heads=hkv, head_dim=d, itemsize=2)
        default_out = None
        if alternatives:
            default_out = np.asarray(jax.jit(functools.partial(
                paged_attention, impl=impl, interpret=task.smoke))(
                    batch.inputs(max_q_len=case.max_q_len)), np.float32)
        for tiling, tuning in runs:
            row = base | dict(tiling=tiling, tuning=tuning)
            if task.seconds_left() < 5:
                emit.row(row | dict(skipped="time budget spent"))
                continue
            emit.start(f"{case.name}/{tiling}")
            try:
                inputs = batch.inputs(max_q_len=case.max_q_len)
                plan = api.gpu_plan_for(inputs, **tuning)
                fn = (_tiled_fn(impl, plan, task.smoke) if alternatives else jax.jit(
                    functools.partial(paged_attention, impl=impl, interpret=task.smoke)))
                timing = time_call(fn, (inputs,), smoke=task.smoke)
                if default_out is not None:
                    out = np.asarray(fn(inputs), np.float32)
                    row["max_diff_vs_default"] = float(np.nanmax(np.abs(out - default_out)))
            except Exception as e:  # noqa: BLE001 - a kernel or tiling that fails is a result
                emit.row(row | dict(error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            row |= timing | dict(tflops=flops / timing["ms"] / 1e9,
                                 tbps=kv_bytes / timing["ms"] / 1e9)
            if impl != "mosaic_gpu":
                row |= dict(rows=plan.rows, block_k=plan.tiles.block_k,
                            num_splits=plan.num_splits, num_warps=plan.num_warps,
                            num_stages=plan.num_stages)
            emit.row(row)
            print(f"  {case.name:22s} {impl:11s} {tiling:12s} {timing['ms']:9.3f} ms",
                  flush=True)
        del batch
    return dict(backend=jax.default_backend())
