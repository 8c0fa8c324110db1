"""Times the per-token LoRA delta of one projection (`arcjax.lora.lora_delta`), every
implementation side by side.

  1. One projection of width `--dims` (in,out), `--slots` adapters of rank `--rank` (slot 0,
     the base model's, zeros, as in the engine), at each of `--tokens` token counts.
  2. Tokens are spread over the adapters round-robin, with `--base_share` of them on the
     base model (slot 0).
  3. Per case, every implementation is compiled and warmed, then they run round-robin
     `--iters` times (each run synchronized) and each reports its median: load that drifts
     during the run hits every arm alike. The dense base projection `x @ W` of the same
     shape is timed beside them, as the yardstick the delta adds to.

CPU (what docs/design/lora.md reports): python scripts/bench_lora.py --out=/tmp/lora.json
Smoke test (seconds):                   python scripts/bench_lora.py --small
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from arcjax.lora.lora_delta import IMPLS, lora_delta

_SMALL = flags.DEFINE_boolean("small", False, "tiny shapes, 3 runs: a smoke test")
_TOKENS = flags.DEFINE_list("tokens", ["8", "64", "512"], "token counts (rows of x)")
_DIMS = flags.DEFINE_list("dims", ["2048", "2048"], "the projection's in and out widths")
_SLOTS = flags.DEFINE_integer("slots", 8, "adapter slots (slot 0 comes on top)")
_RANK = flags.DEFINE_integer("rank", 16, "every slot's rank")
_BASE_SHARE = flags.DEFINE_float("base_share", 0.25, "share of tokens on the base model")
_IMPLS = flags.DEFINE_list("impls", list(IMPLS), "implementations to time")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed runs per case (the first compiles)")
_ITERS = flags.DEFINE_integer("iters", 20, "timed runs per case; the median is reported")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")


@functools.partial(jax.jit, static_argnames="impl")
def _delta(x, a, b, slots, *, impl):
    return lora_delta(x, a, b, slots, impl=impl)


@jax.jit
def _base(x, w):
    return x @ w


def _case(tokens: int, d_in: int, d_out: int, dtype) -> dict:
    rng = np.random.default_rng(tokens)
    num = _SLOTS.value + 1
    x = jnp.asarray(rng.normal(size=(tokens, d_in)), dtype)
    a = rng.normal(size=(num, d_in, _RANK.value)) * 0.02
    b = rng.normal(size=(num, _RANK.value, d_out)) * 0.02
    a[0], b[0] = 0, 0
    a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    w = jnp.asarray(rng.normal(size=(d_in, d_out)) * 0.02, dtype)
    slots = np.arange(tokens) % _SLOTS.value + 1
    slots[rng.random(tokens) < _BASE_SHARE.value] = 0
    slots = jnp.asarray(slots, jnp.int32)
    arms = {impl: functools.partial(_delta, x, a, b, slots, impl=impl) for impl in _IMPLS.value}
    arms["base_matmul"] = functools.partial(_base, x, w)
    for fn in arms.values():
        for _ in range(_WARMUP.value):
            fn().block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(_ITERS.value):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn().block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}  # microseconds


def main(argv):
    del argv
    if _SMALL.value:
        _TOKENS.value, _DIMS.value, _SLOTS.value, _ITERS.value = ["8", "32"], ["64", "64"], 2, 3
    d_in, d_out = (int(d) for d in _DIMS.value)
    dtype = jnp.dtype(_DTYPE.value)
    results = {"platform": jax.default_backend(), "device": str(jax.devices()[0]),
               "host": platform.node(), "dims": [d_in, d_out], "slots": _SLOTS.value,
               "rank": _RANK.value, "dtype": str(dtype), "base_share": _BASE_SHARE.value,
               "cases": {}}
    for tokens in (int(t) for t in _TOKENS.value):
        us = _case(tokens, d_in, d_out, dtype)
        results["cases"][str(tokens)] = us
        print(f"T={tokens:5d}  " + "  ".join(f"{k} {v:9.1f} us" for k, v in us.items()))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
