"""One layer's attention on the CPU: the compiled kernel ("cpu") beside the xla path.

  1. Builds each case's paged batch (random q/k/v, pages in a scrambled order, the runner's
     bucket padding) in one head geometry (`--geometry`, default SmolLM2-135M's: 9 query /
     3 KV heads of 64, pages of 16 keys) and a cache of `--cache_mib` MiB per K and V, so
     the pages a step reads are spread as a real cache spreads them.
  2. Times every `--impls` on every case, alternating (median of `--iters` runs each, after
     `--warmup`), and checks that the outputs agree.
  3. Reports ms, the KV bytes read per ms (each visible key once), and the ratio to the
     first implementation.

Cases are the CPU workloads of RESULTS.md: 32 decode rows of 80-264 keys (the 32-request
batch), a lone decode of 200 keys, 14 prompts of 80-200 tokens in a 2048-token bucket, and
two 512-token chunks after 1,024 cached keys beside 8 decodes.

  python scripts/bench_cpu_attention.py --out=runs/cpu_attention.json
  taskset -c 0 python scripts/bench_cpu_attention.py --cases=decode   # one core
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels import api, testing

_IMPLS = flags.DEFINE_list("impls", ["xla", "cpu"], "implementations, the first the baseline")
_GEOMETRY = flags.DEFINE_list("geometry", ["9", "3", "64", "16"],
                              "Hq, Hkv, D, block_size")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "q and page dtype")
_CACHE = flags.DEFINE_integer("cache_mib", 64, "MiB of K pages (and of V) in the cache")
_CASES = flags.DEFINE_list("cases", [], "only cases whose name starts with one of these")
_WARMUP = flags.DEFINE_integer("warmup", 3, "untimed runs per case and implementation")
_ITERS = flags.DEFINE_integer("iters", 20, "timed runs; the median is reported")
_SEED = flags.DEFINE_integer("seed", 0, "lengths and data seed")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence
    tokens: int  # the token bucket
    seq_bucket: int
    max_q_len: int


def make_cases(rng: np.random.Generator) -> list[Case]:
    decode = tuple((1, int(k)) for k in rng.integers(80, 265, 32))
    prompts = tuple((int(k), int(k)) for k in rng.integers(80, 201, 14))
    mixed = ((512, 1536), (512, 1536)) + tuple((1, int(k)) for k in rng.integers(80, 265, 8))
    return [Case(name="decode_32rows", seqs=decode, tokens=32, seq_bucket=32, max_q_len=1),
            Case(name="decode_lone", seqs=((1, 200),), tokens=1, seq_bucket=8, max_q_len=1),
            Case(name="prefill_14prompts", seqs=prompts, tokens=2048, seq_bucket=16,
                 max_q_len=2048),
            Case(name="mixed_2chunks_8decodes", seqs=mixed, tokens=2048, seq_bucket=16,
                 max_q_len=2048)]


def run_case(case: Case, impls: list[str], dtype, geometry, num_blocks: int,
             seed: int) -> dict:
    hq, hkv, d, bs = geometry
    batch = testing.make_batch(list(case.seqs), num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=bs, num_tokens=case.tokens,
                               seq_bucket=case.seq_bucket, num_blocks=num_blocks, dtype=dtype,
                               nan_fill=False, seed=seed)
    inputs = batch.inputs(max_q_len=case.max_q_len)
    fns = {impl: jax.jit(functools.partial(api.paged_attention, impl=impl)) for impl in impls}
    outs = {impl: np.asarray(fn(inputs), np.float32) for impl, fn in fns.items()}
    rows = int(np.asarray(batch.cu_seqlens_q)[len(case.seqs)])
    err = {impl: float(np.max(np.abs(out[:rows] - outs[impls[0]][:rows])))
           for impl, out in outs.items()}
    for fn in fns.values():
        for _ in range(_WARMUP.value):
            jax.block_until_ready(fn(inputs))
    times = {impl: [] for impl in impls}
    for _ in range(_ITERS.value):  # alternating: both see the same machine
        for impl, fn in fns.items():
            times[impl].append(testing.time_ms(fn, (inputs,), warmup=0, iters=1))
    _, kv_bytes = testing.attention_work(list(case.seqs), num_heads=hq, num_kv_heads=hkv,
                                         head_dim=d, itemsize=jnp.dtype(dtype).itemsize)
    res = {"case": case.name, "kv_mb": kv_bytes / 1e6, "impls": {}}
    base = float(np.median(times[impls[0]]))
    for impl in impls:
        ms = float(np.median(times[impl]))
        res["impls"][impl] = {"ms": ms, "kv_gb_s": kv_bytes / ms / 1e6,
                              "speedup_vs_first": base / ms, "max_abs_diff_vs_first": err[impl]}
    return res


def main(argv):
    del argv
    geometry = tuple(int(x) for x in _GEOMETRY.value)
    hq, hkv, d, bs = geometry
    dtype = jnp.dtype(_DTYPE.value)
    num_blocks = max(64, _CACHE.value * 2**20 // (bs * hkv * d * dtype.itemsize))
    cases = [c for c in make_cases(np.random.default_rng(_SEED.value))
             if not _CASES.value or any(c.name.startswith(p) for p in _CASES.value)]
    results = {"geometry": {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d,
                            "block_size": bs}, "dtype": _DTYPE.value, "num_blocks": num_blocks,
               "load_average": list(os.getloadavg()), "cases": []}
    for case in cases:
        res = run_case(case, _IMPLS.value, dtype, geometry, num_blocks, _SEED.value)
        results["cases"].append(res)
        line = ", ".join(f"{impl} {r['ms']:.3f} ms ({r['speedup_vs_first']:.2f}x, "
                         f"{r['kv_gb_s']:.1f} GB/s, diff {r['max_abs_diff_vs_first']:.1e})"
                         for impl, r in res["impls"].items())
        print(f"{case.name:26s} KV {res['kv_mb']:6.2f} MB: {line}")
    results["load_average_end"] = list(os.getloadavg())
    print(f"load average: start {results['load_average']}, end {results['load_average_end']}")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
