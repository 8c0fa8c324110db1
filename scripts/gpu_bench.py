"""Timing and the reference figures of `scripts/gpu_check.py` (tasks run by gpu_child.py).

  - `time_call`: the way FlashAttention's benchmarks time a kernel: N calls back to back
    and one synchronization, the median of several such runs (JAX 0.11 exposes no CUDA
    events, so the clock is the host's around the N calls: dispatch overlaps the device's
    work and only one sync is paid per N); also the median of single synchronized calls,
    which shows what dispatch and glue add to a small case.
  - `ceilings`: the machine's own ceilings, in the same run: an 8192^3 bf16 matmul
    (TFLOP/s) and a large device copy (bytes read + written per second).
  - `cudnn_reference`: cuDNN's fused attention (`jax.nn.dot_product_attention(...,
    implementation="cudnn")`) on the dense shapes of the kernel table's prefill cases.
  - `moe_grouped_gemm`: one Mixtral-8x7B-shaped MoE layer (`arcjax.model.moe.moe_mlp`)
    with `ragged_dot` and the tiled grouped GEMM, at decode and prefill token counts.
  - `w4a16_decode`: the W4A16 kernel against its oracle, XLA's dequantize-then-dot and a
    bf16 weight on 8B-model decode shapes (`W4A16_SHAPES`).
  - `mla_decode`: the Pallas GPU MLA kernel against its float64 oracle, and XLA's MLA path
    beside it, on DeepSeek-V2-Lite decode batches (`MLA_CASES`), TB/s of the latent pages.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_child import Emitter, Task

DATASHEET = dict(tflops=989.0, tbps=4.8)  # H200 SXM: dense bf16, HBM3e


def time_call(fn, args, *, smoke: bool, target_s: float = 0.05, reps: int = 5) -> dict:
    """{"ms": back-to-back median per call, "ms_synced": single synchronized call median,
    "n": calls per run, "reps"}; `fn` is compiled by the first call (untimed)."""
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm
    synced = []
    for _ in range(1 if smoke else 3):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        synced.append(time.perf_counter() - start)
    one = statistics.median(synced)
    if smoke:
        return dict(ms=1e3 * one, ms_synced=1e3 * one, n=1, reps=1)
    n = max(3, min(500, int(target_s / max(one, 1e-6))))
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / n)
    return dict(ms=1e3 * statistics.median(runs), ms_synced=1e3 * one, n=n, reps=reps)


def ceilings(task: Task, emit: Emitter) -> dict:
    import jax
    import jax.numpy as jnp

    n = 256 if task.smoke else 8192
    emit.start(f"matmul_{n}")
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    t = time_call(jax.jit(lambda x, y: x @ y), (a, b), smoke=task.smoke)
    emit.row(dict(impl="xla", case=f"matmul_{n}", what="bf16 matmul", **t,
                  tflops=2.0 * n**3 / t["ms"] / 1e9))
    del a, b
    elems = 2**20 if task.smoke else 2**30  # 2 MiB / 2 GiB of bf16
    emit.start("copy")
    x = jnp.ones((elems,), jnp.bfloat16)
    t = time_call(jax.jit(lambda v: v * 2), (x,), smoke=task.smoke)
    moved = 2.0 * elems * 2  # read once, written once
    emit.row(dict(impl="xla", case=f"copy_{elems * 2 >> 20}MiB", what="device copy (x * 2)",
                  **t, tbps=moved / t["ms"] / 1e9))
    return {}


def _dense_prefill_cases(smoke: bool) -> list[tuple[str, int, tuple[int, int, int]]]:
    """(name, T, (Hq, Hkv, D)): the kernel table's prefill cases as one dense sequence."""
    from gpu_kernels import kernel_cases

    return [(c.name, c.seqs[0][0], c.heads) for c in kernel_cases(smoke) if c.kind == "prefill"]


def cudnn_reference(task: Task, emit: Emitter) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels import testing

    # cuDNN needs a GPU; the CPU smoke runs XLA's implementation through the same code.
    impl = "xla" if task.smoke else "cudnn"
    for name, t, (hq, hkv, d) in _dense_prefill_cases(task.smoke):
        emit.start(name)
        kq, kk, kv = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(kq, (1, t, hq, d), jnp.bfloat16)  # [B, T, N, H]
        k = jax.random.normal(kk, (1, t, hkv, d), jnp.bfloat16)
        v = jax.random.normal(kv, (1, t, hkv, d), jnp.bfloat16)
        fn = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
            a, b, c, is_causal=True, implementation=impl))
        row = dict(impl=impl, case=name, kind="prefill")
        try:
            timing = time_call(fn, (q, k, v), smoke=task.smoke)
        except Exception as e:  # noqa: BLE001 - a reference that cannot run is a result
            emit.row(row | dict(error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        flops, _ = testing.attention_work([(t, t)], num_heads=hq, num_kv_heads=hkv,
                                          head_dim=d, itemsize=2)
        emit.row(row | timing | dict(tflops=flops / timing["ms"] / 1e9))
    return {}


def _moe_layer(hidden: int, width: int, experts: int, key):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 4)
    scale = hidden**-0.5
    lp = {"router": jax.random.normal(ks[0], (hidden, experts), jnp.bfloat16) * scale}
    shapes = {"we_gate": (1, experts, hidden, width), "we_up": (1, experts, hidden, width),
              "we_down": (1, experts, width, hidden)}
    weights = {name: jax.random.normal(k, shape, jnp.bfloat16) * scale
               for (name, shape), k in zip(shapes.items(), ks[1:])}
    return lp, weights


def moe_grouped_gemm(task: Task, emit: Emitter) -> dict:
    """ragged_dot vs the tiled grouped GEMM on one MoE layer (Mixtral-8x7B: H 4096, 8
    experts of width 14,336, top 2), TFLOP/s of the routed work."""
    import functools

    import jax
    import jax.numpy as jnp

    from arcjax.model import moe

    hidden, width, experts, top_k = (64, 128, 4, 2) if task.smoke else (4096, 14336, 8, 2)
    lp, weights = _moe_layer(hidden, width, experts, jax.random.key(1))
    for tokens in ((16,) if task.smoke else (128, 2048)):
        h = jax.random.normal(jax.random.key(tokens), (tokens, hidden), jnp.bfloat16)
        valid = jnp.ones((tokens,), bool)
        for impl in ("ragged_dot", "tiled"):
            case = f"{impl}_t{tokens}"
            emit.start(case)
            fn = jax.jit(functools.partial(
                moe.moe_mlp, num_experts=experts, top_k=top_k, renormalize=True, act="silu",
                valid=valid, impl=impl))
            row = dict(impl=impl, case=f"moe_t{tokens}", tokens=tokens, experts=experts,
                       top_k=top_k, hidden=hidden, width=width)
            layer = jnp.int32(0)  # traced, as in the step
            try:
                timing = time_call(lambda x: fn(x, lp, weights, layer)[0], (h,),
                                   smoke=task.smoke)
            except Exception as e:  # noqa: BLE001 - an implementation that fails is a result
                emit.row(row | dict(error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            flops = 2.0 * tokens * top_k * 3 * hidden * width  # gate, up, down
            emit.row(row | timing | dict(tflops=flops / timing["ms"] / 1e9))
    return {}


W4A16_SHAPES = ((1, 4096, 4096), (16, 4096, 14336), (1, 14336, 4096))  # M x K x N, decode
W4A16_TOLERANCE = 2e-2  # max |kernel - oracle| / max |oracle| (bf16 outputs)


def w4a16_decode(task: Task, emit: Emitter) -> dict:
    """The W4A16 kernel (`pallas_kernels.w4a16`) on 8B-model decode shapes, AWQ zero points
    and GGUF Q4_1 mins: checked against its oracle, timed beside XLA's dequantize-then-dot
    (the engine's path off the kernel) and a bf16 weight; TB/s of the bytes each reads
    (packed for the kernel and XLA, 2 a weight for bf16), set against the copy ceiling."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gpu_quant4 import operands
    from pallas_kernels.w4a16 import w4a16_matmul, w4a16_reference

    shapes = ((1, 256, 64), (4, 128, 128)) if task.smoke else W4A16_SHAPES
    for m, k, n in shapes:
        for kind in ("zero", "offset"):
            case = f"w4a16_{m}x{k}x{n}_{kind}"
            emit.start(case)
            ops = operands(m, k, n, kind, group=min(128, k))
            group, shift = ops["group"], ops["shift"]
            args = tuple(ops[name] for name in ("x", "qweight", "scale", "zero", "offset"))
            kernel = jax.jit(lambda x, q, s, z, o: w4a16_matmul(
                x, q, s, z, o, group=group, shift=shift, interpret=task.smoke))
            row = dict(case=case, kind="decode", rows=m, shape=f"{m}x{k}x{n}", zero=kind)
            try:
                got = np.asarray(kernel(*args), np.float32)
                timing = time_call(kernel, args, smoke=task.smoke)
            except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
                emit.row(row | dict(impl="w4a16", error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            want = np.asarray(w4a16_reference(*args, group=group, shift=shift), np.float32)
            err = float(np.max(np.abs(got - want)) / max(1e-6, float(np.max(np.abs(want)))))
            bad = {} if err <= W4A16_TOLERANCE else {"error": f"max rel err {err:.2g} over "
                                                              f"{W4A16_TOLERANCE}"}
            emit.row(row | timing | dict(impl="w4a16", max_rel_err=err, **bad,
                                         tbps=ops["nbytes"] / timing["ms"] / 1e9))
            dense = jnp.asarray(np.random.default_rng(1).normal(size=(k, n)) * 0.01,
                                jnp.bfloat16)
            for impl, fn, inputs, nbytes in (
                    ("xla", lambda x, w: x @ w.dequantize(x.dtype), (ops["x"], ops["w"]),
                     ops["nbytes"]),
                    ("bf16", lambda x, w: x @ w, (ops["x"], dense), 2 * k * n)):
                t = time_call(jax.jit(fn), inputs, smoke=task.smoke)
                emit.row(row | t | dict(impl=impl, tbps=nbytes / t["ms"] / 1e9))
    return {}


# DeepSeek-V2-Lite's attention per device: 16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
# softmax scale (qk_nope 128 + rope 64) ** -0.5; bf16 latent pages of 16 tokens.
MLA_SHAPE = dict(num_heads=16, latent_dim=512, rope_dim=64, block_size=16)
MLA_CASES = ((64, 1024), (32, 4096), (16, 16384))  # (sequences, context): one decode step
MLA_SMOKE = dict(num_heads=16, latent_dim=64, rope_dim=16, block_size=16)
MLA_SMOKE_CASES = ((4, 96), (2, 300))  # the CPU smoke: the kernel interpreted


def mla_decode(task: Task, emit: Emitter) -> dict:
    """The MLA kernel (`pallas_kernels.mla_pallas_gpu`) on DeepSeek-V2-Lite decode batches
    at 1k, 4k and 16k tokens of context: checked against the float64 oracle
    (`mla_reference`) with the attention kernels' bf16 tolerance, timed beside XLA's MLA
    path (`mla_xla`, what runs off the kernel); TB/s of the latent and rope pages each
    reads once (`kv_bytes`), set against the copy ceiling and the data sheet."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gpu_kernels import TOLERANCES, compare
    from pallas_kernels import testing
    from pallas_kernels.mla import mla_attention
    from pallas_kernels.mla_pallas_gpu import make_mla_plan
    from pallas_kernels.mla_reference import mla_attention_float64

    shape = MLA_SMOKE if task.smoke else MLA_SHAPE
    hq, dl, dr = shape["num_heads"], shape["latent_dim"], shape["rope_dim"]
    for i, (n, ctx) in enumerate(MLA_SMOKE_CASES if task.smoke else MLA_CASES):
        case = f"mla_decode_{n}x{ctx}"
        row = dict(case=case, kind="decode", seqs=n, context=ctx, heads=hq, latent_dim=dl,
                   rope_dim=dr, tolerance=TOLERANCES["bfloat16"])
        if task.seconds_left() < 5:
            emit.row(row | dict(impl="pallas_gpu", skipped="time budget spent"))
            continue
        emit.start(case)
        batch = testing.make_mla_device_batch([(1, ctx)] * n, **shape, dtype=jnp.bfloat16,
                                              key=jax.random.key(i))
        inputs = batch.inputs(sm_scale=192**-0.5, max_q_len=1)
        kv_bytes = n * ctx * (dl + dr) * 2  # [ctx, Dl + Dr] bf16 per sequence
        plan = make_mla_plan(inputs)
        row |= dict(rows=plan.rows, block_k=plan.tiles.block_k, num_splits=plan.num_splits)
        ref = mla_attention_float64(inputs)  # [T, Hq, Dl] float64
        real = int(batch.cu_seqlens_q[batch.num_seqs])
        for impl in ("pallas_gpu", "xla"):
            fn = jax.jit(functools.partial(mla_attention, impl=impl, interpret=task.smoke))
            try:
                got = compare(np.asarray(fn(inputs), np.float32), ref, real)
                timing = time_call(fn, (inputs,), smoke=task.smoke)
            except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
                emit.row(row | dict(impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            ok = (got["max_rel_err"] <= row["tolerance"] and not got["nan"]
                  and got["padding_exact_zero"])
            bad = {} if ok else {"error": f"{impl} against the oracle: {got}"}
            emit.row(row | got | bad | timing | dict(impl=impl, kv_bytes=kv_bytes,
                                                     tbps=kv_bytes / timing["ms"] / 1e9))
        del batch, inputs
    return {}
