"""Times ragged paged attention on prefill, decode and mixed steps, beside dense attention.

  1. Build each case's paged batch on the device (random q/k/v, pages handed out in a
     scrambled order), plus the comparable dense `[B, L, H, D]` tensors.
  2. Time `ragged_paged_attention(impl=...)` and `jax.nn.dot_product_attention`: median of
     `--iters` runs after `--warmup`, each synchronized with `block_until_ready`.
  3. Report ms, TFLOP/s (causal work actually needed), GB/s of KV read (every cached key
     read once) and the percent of the roofline: the time the work would take at
     `--peak_tflops` / `--peak_tbps` (H200 measured: 790 TFLOP/s bf16, 4.3 TB/s),
     divided by the measured time.

On an H200 (one command):   python scripts/bench_kernels.py --out=kernels_h200.json
Split-K off, for contrast:  python scripts/bench_kernels.py --impl=pallas_gpu --cases=decode \
                                --gpu_num_splits=1 --out=kernels_h200_nosplit.json
CPU smoke test (< 1 min):   python scripts/bench_kernels.py --impl=xla --small --out=/tmp/k.json
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
from absl import app, flags

import pallas_kernels
from pallas_kernels import api, pallas_gpu, testing

_IMPL = flags.DEFINE_enum("impl", "auto", ["auto", "xla", "pallas_gpu"],
                          "implementation to time (auto: pallas_gpu on GPU, xla elsewhere)")
_SMALL = flags.DEFINE_boolean("small", False,
                              "tiny shapes, at most 1 warm-up and 5 timed runs: a CPU smoke test")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "bfloat16", "float32"],
                           "auto: bfloat16 on GPU, float32 elsewhere")
_WARMUP = flags.DEFINE_integer("warmup", 3, "untimed runs per case (the first compiles)")
_ITERS = flags.DEFINE_integer("iters", 20, "timed runs per case; the median is reported")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "keys per KV page")
_CASES = flags.DEFINE_list("cases", [], "only cases whose name starts with one of these")
_DENSE = flags.DEFINE_boolean("dense", True, "also time jax.nn.dot_product_attention")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 790.0, "measured matmul peak, TFLOP/s")
_PEAK_TBPS = flags.DEFINE_float("peak_tbps", 4.3, "measured HBM bandwidth, TB/s")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_INTERPRET = flags.DEFINE_boolean(
    "interpret", False, "Pallas interpret mode: checks the script on CPU, times nothing real")
# Tuning knobs of the GPU kernel's plan (defaults: gpu_plan.make_gpu_plan's own). Setting
# any of them times pallas_gpu through its internal entry point with that plan.
_GPU_BLOCK_M = flags.DEFINE_integer("gpu_block_m", None, "packed query rows per program")
_GPU_BLOCK_K = flags.DEFINE_integer("gpu_block_k", None, "keys per inner step")
_GPU_SPLITS = flags.DEFINE_integer("gpu_num_splits", None,
                                   "split-K factor (1 disables the decode split)")
_GPU_WARPS = flags.DEFINE_integer("gpu_num_warps", None, "Triton num_warps")
_GPU_STAGES = flags.DEFINE_integer("gpu_num_stages", None, "Triton num_stages")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    impl: str
    small: bool
    dtype: str
    warmup: int
    iters: int
    block_size: int
    cases: tuple[str, ...]
    dense: bool
    peak_tflops: float
    peak_tbps: float
    out: str | None
    gpu_tuning: tuple[tuple[str, int], ...]  # make_gpu_plan overrides, empty for defaults
    interpret: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    kind: str  # "prefill" | "decode" | "mixed"
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_q_len: int | None  # static bound passed to the kernel (1: decode-only plan)


def make_cases(small: bool) -> list[Case]:
    """The shapes of the issue; `small` shrinks them for a CPU smoke test."""
    if small:
        heads, chunks, cached, batches, kvs = (8, 2, 64), (64,), (0, 256), (8,), (128, 512)
        mixed = ((64, 320),) + ((1, 256),) * 4
    else:
        heads, chunks, cached, batches, kvs = (32, 8, 128), (512, 2048), (0, 4096, 16384), \
            (64, 256), (1024, 8192)
        mixed = ((2048, 6144),) + ((1, 2048),) * 64
    hq, hkv, d = heads
    cases = [Case(name=f"prefill_c{c}_cached{k}", kind="prefill", seqs=((c, c + k),),
                  num_heads=hq, num_kv_heads=hkv, head_dim=d, max_q_len=None)
             for c in chunks for k in cached]
    cases += [Case(name=f"decode_b{b}_kv{kv}", kind="decode", seqs=((1, kv),) * b,
                   num_heads=hq, num_kv_heads=hkv, head_dim=d, max_q_len=1)
              for b in batches for kv in kvs]
    cases.append(Case(name=f"mixed_c{mixed[0][0]}_plus{len(mixed) - 1}decodes", kind="mixed",
                      seqs=mixed, num_heads=hq, num_kv_heads=hkv, head_dim=d, max_q_len=None))
    return cases


def case_work(case: Case, itemsize: int) -> tuple[float, float]:
    """(FLOPs of the causal work, bytes of KV read once) for one case."""
    return testing.attention_work(list(case.seqs), num_heads=case.num_heads,
                                  num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                                  itemsize=itemsize)


def make_paged_batch(case: Case, block_size: int, dtype, key) -> testing.Batch:
    """Device-side paged inputs, bucket-padded like the runner."""
    return testing.make_device_batch(list(case.seqs), num_heads=case.num_heads,
                                     num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                                     block_size=block_size, dtype=dtype, key=key)


def time_fn(fn, args, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn(*args)`, synchronized."""
    return testing.time_ms(fn, args, warmup=warmup, iters=iters)


def dense_inputs(case: Case, batch: testing.Batch, block_size: int):
    """Comparable dense tensors: one `[B, L, H, D]` batch per case kind.

    Prefill: the chunk's queries over all its keys (bottom-right causal mask). Decode: one
    query per sequence over equal-length keys. Mixed: the prefill and decode parts are
    timed as two dense calls.
    """
    q, k_pages, v_pages = batch.q, batch.k_pages, batch.v_pages
    tables = batch.block_tables[:len(case.seqs)]

    def keys_of(s, kv_len):  # [kv_len, Hkv, D] gathered once, outside the timing
        idx = jnp.arange(kv_len)
        return (k_pages[tables[s, idx // block_size], idx % block_size],
                v_pages[tables[s, idx // block_size], idx % block_size])

    groups = []
    if case.kind == "prefill" or case.kind == "mixed":
        q_len, kv_len = case.seqs[0]
        k, v = keys_of(0, kv_len)
        groups.append((q[None, :q_len], k[None], v[None], q_len, kv_len))
    rows = [(s, kv) for s, (ql, kv) in enumerate(case.seqs) if ql == 1]
    if rows:
        kv_len = rows[0][1]
        ks, vs = zip(*(keys_of(s, kv) for s, kv in rows))
        first = 1 if case.kind == "mixed" else 0
        qs = q[first:first + len(rows), None]  # [B, 1, Hq, D]
        groups.append((qs, jnp.stack(ks), jnp.stack(vs), 1, kv_len))
    return groups


def dense_attention(q, k, v, *, q_len: int, kv_len: int):
    if q_len == 1:
        return jax.nn.dot_product_attention(q, k, v)
    if q_len == kv_len:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    mask = jnp.arange(kv_len)[None, :] <= (kv_len - q_len + jnp.arange(q_len))[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])


def kernel_fn(case: Case, cfg: BenchConfig, batch: testing.Batch):
    """The jitted attention call of one case (with the tuned GPU plan if asked for) and its
    arguments."""
    if not cfg.gpu_tuning:
        return jax.jit(functools.partial(pallas_kernels.ragged_paged_attention,
                                         impl=cfg.impl, max_q_len=case.max_q_len,
                                         interpret=cfg.interpret)), batch.args()
    if cfg.impl != "pallas_gpu":
        raise app.UsageError("--gpu_* tuning flags need --impl=pallas_gpu")
    inputs = batch.inputs(max_q_len=case.max_q_len)
    plan = api.gpu_plan_for(inputs, **dict(cfg.gpu_tuning))
    return jax.jit(functools.partial(pallas_gpu.ragged_paged_attention_pallas_gpu, plan=plan,
                                     interpret=cfg.interpret)), (inputs,)


def run_case(case: Case, cfg: BenchConfig, dtype, key) -> dict:
    batch = make_paged_batch(case, cfg.block_size, dtype, key)
    attention, args = kernel_fn(case, cfg, batch)
    ms = time_fn(attention, args, cfg.warmup, cfg.iters)
    flops, kv_bytes = case_work(case, jnp.dtype(dtype).itemsize)
    floor_s = max(flops / (cfg.peak_tflops * 1e12), kv_bytes / (cfg.peak_tbps * 1e12))
    row = dict(case=case.name, kind=case.kind, num_seqs=len(case.seqs),
               tokens=int(sum(q for q, _ in case.seqs)), keys=int(sum(k for _, k in case.seqs)),
               num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
               ms=ms, tflops=flops / ms / 1e9, kv_gbps=kv_bytes / ms / 1e6,
               roofline_pct=100.0 * floor_s * 1e3 / ms,
               bound="compute" if flops / (cfg.peak_tflops * 1e12) > kv_bytes / (
                   cfg.peak_tbps * 1e12) else "memory")
    if cfg.dense:
        dense_ms = 0.0
        for q, k, v, q_len, kv_len in dense_inputs(case, batch, cfg.block_size):
            fn = jax.jit(functools.partial(dense_attention, q_len=q_len, kv_len=kv_len))
            dense_ms += time_fn(fn, (q, k, v), cfg.warmup, cfg.iters)
        row.update(dense_ms=dense_ms, dense_tflops=flops / dense_ms / 1e9)
    del args, batch
    return row


def main(argv):
    del argv
    small = _SMALL.value
    cfg = BenchConfig(impl=_IMPL.value, small=small, dtype=_DTYPE.value,
                      warmup=min(_WARMUP.value, 1) if small else _WARMUP.value,
                      iters=min(_ITERS.value, 5) if small else _ITERS.value,
                      block_size=_BLOCK_SIZE.value,
                      cases=tuple(_CASES.value), dense=_DENSE.value,
                      peak_tflops=_PEAK_TFLOPS.value, peak_tbps=_PEAK_TBPS.value, out=_OUT.value,
                      gpu_tuning=tuple((name, flag.value) for name, flag in [
                          ("block_m", _GPU_BLOCK_M), ("block_k", _GPU_BLOCK_K),
                          ("num_splits", _GPU_SPLITS), ("num_warps", _GPU_WARPS),
                          ("num_stages", _GPU_STAGES)] if flag.value is not None),
                      interpret=_INTERPRET.value)
    on_gpu = jax.default_backend() == "gpu"
    dtype = {"auto": jnp.bfloat16 if on_gpu else jnp.float32, "bfloat16": jnp.bfloat16,
             "float32": jnp.float32}[cfg.dtype]
    cases = [c for c in make_cases(cfg.small)
             if not cfg.cases or any(c.name.startswith(p) for p in cfg.cases)]
    device = str(jax.devices()[0].device_kind)
    print(f"device={device} impl={cfg.impl} dtype={jnp.dtype(dtype).name}")
    header = f"{'case':34s} {'ms':>9s} {'TFLOP/s':>8s} {'GB/s':>8s} {'%roof':>6s} {'dense ms':>9s}"
    print(header)
    results = []
    key = jax.random.key(0)
    for i, case in enumerate(cases):
        row = run_case(case, cfg, dtype, jax.random.fold_in(key, i))
        results.append(row)
        dense = f"{row['dense_ms']:9.3f}" if "dense_ms" in row else f"{'-':>9s}"
        print(f"{case.name:34s} {row['ms']:9.3f} {row['tflops']:8.3f} {row['kv_gbps']:8.1f} "
              f"{row['roofline_pct']:6.1f} {dense}")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(dict(config=dataclasses.asdict(cfg), device=device,
                           backend=jax.default_backend(), dtype=jnp.dtype(dtype).name,
                           results=results), f, indent=2)
        print(f"wrote {cfg.out}")


if __name__ == "__main__":
    app.run(main)
