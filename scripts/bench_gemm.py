"""A model's matrix products under XLA:CPU beside torch's, same shapes, same cores.

The step's dense products (the projections and the gated MLP of one layer) at the row
counts a bucket runs (`--rows`: a decode bucket, a prefill one), timed as jitted jnp
products (arcjax's XLA path) and, with `--torch_python` (the Python of an environment
with torch, e.g. vLLM's CPU build's), as torch products with as many threads as cores:
the ceiling each engine's matrix products set on its step, side by side. `--impls=xla,cpu`
times the compiled CPU kernel's products (`pallas_kernels.cpu_matmul`, packed_matmul's
"cpu") beside XLA's, in the same loop.

  python scripts/bench_gemm.py --model=$MODEL_DIR --torch_python=VENV/bin/python
  python scripts/bench_gemm.py --rows=1,32,2048 --out=runs/gemm.json
  python scripts/bench_gemm.py --model=$MODEL_DIR --rows=1,2,8,32 --impls=xla,cpu
  python scripts/bench_gemm.py --model=$MODEL_DIR --rows=1,8 --impls=xla,cpu --layers=30

`--layers=L` gives each round L layers of distinct weights, as a step's layers are: with
more weights than the caches hold, the products stream them from memory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "HF model dir or GGUF file (default: the "
                             "packaged model)")
_ROWS = flags.DEFINE_list("rows", ["32", "2048"], "rows (tokens) of each product")
_ITERS = flags.DEFINE_integer("iters", 30, "rounds per timing: XLA runs them in one compiled "
                              "loop (5 timings, the median kept), torch as calls (the median)")
_TORCH = flags.DEFINE_string("torch_python", None, "a Python with torch: the same products "
                             "in torch (skipped with a line where absent)")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_LAYERS = flags.DEFINE_integer("layers", 1, "layers of distinct weights per round (times "
                               "are per layer)")
_IMPLS = flags.DEFINE_list("impls", ["xla"], "jitted products timed: xla (jnp's) and/or cpu "
                           "(the compiled CPU kernel)")

# The torch side, run by `--torch_python` (argv[1]: the JSON of {"groups", "rows", "iters"}).
_TORCH_CHILD = r"""
import json, os, statistics, sys, time
import torch
torch.set_num_threads(os.cpu_count())
spec = json.loads(sys.argv[1])
res = {"version": torch.__version__, "threads": torch.get_num_threads(), "ms": {}}
for name, shapes in spec["groups"].items():
    for m in spec["rows"]:
        x = {k: torch.randn(m, k) for k, _ in shapes}
        ws = [torch.randn(k, n) for k, n in shapes]
        def run():
            return [x[k] @ w for (k, _), w in zip(shapes, ws)]
        for _ in range(3):
            run()
        ts = []
        for _ in range(spec["iters"]):
            t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
        res["ms"][f"{name}@{m}"] = 1e3 * statistics.median(ts)
print(json.dumps(res))
"""


def product_groups(cfg) -> dict[str, list[tuple[int, int]]]:
    """One layer's dense products as (in, out) pairs, grouped as the step runs them."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": [(h, q), (h, kv), (h, kv)], "o": [(q, h)],
            "mlp": [(h, i), (h, i), (i, h)]}


def time_jax(groups, rows: list[int], iters: int, impl: str = "xla",
             layers: int = 1) -> dict[str, float]:
    """ms per group of products (per layer), inside one compiled loop of `iters` rounds (as
    in a step: no per-call dispatch), each round over `layers` layers of distinct weights;
    each layer's input depends on the last one's products. `impl`: "xla" (jnp's products)
    or "cpu" (`pallas_kernels.cpu_matmul`)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.cpu_matmul import cpu_matmul

    product = cpu_matmul if impl == "cpu" else jnp.matmul

    out = {}
    key = jax.random.PRNGKey(0)
    for name, shapes in groups.items():
        ws = [[jax.random.normal(jax.random.fold_in(key, layer * len(shapes) + j), s)
               for j, s in enumerate(shapes)] for layer in range(layers)]
        for m in rows:
            xs = {k: jax.random.normal(key, (m, k)) for k, _ in shapes}

            def rounds(xs, ws, shapes=shapes):
                def body(_, xs):
                    for layer_ws in ws:
                        ys = [product(xs[k], w) for (k, _), w in zip(shapes, layer_ws)]
                        tie = sum(jnp.sum(y[0, :1]) for y in ys) * 1e-30
                        xs = {k: x + tie for k, x in xs.items()}
                    return xs
                return jax.lax.fori_loop(0, iters, body, xs)

            fn = jax.jit(rounds)
            jax.block_until_ready(fn(xs, ws))
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(xs, ws))
                ts.append(time.perf_counter() - t0)
            out[f"{name}@{m}"] = 1e3 * statistics.median(ts) / (iters * layers)
    return out


def time_torch(python: str | None, groups, rows: list[int], iters: int) -> dict | None:
    if python is None:
        print("torch: skipped (pass --torch_python=<a Python with torch>)")
        return None
    spec = json.dumps({"groups": groups, "rows": rows, "iters": iters})
    try:
        proc = subprocess.run([python, "-c", _TORCH_CHILD, spec], capture_output=True,
                              text=True)
    except OSError as e:
        print(f"torch: skipped ({python} cannot run: {e})")
        return None
    if proc.returncode != 0:
        print(f"torch: skipped (exit {proc.returncode}: {proc.stderr.strip()[-500:]})")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    import arcjax
    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import model_config

    model = _MODEL.value or str(arcjax.default_model_path())
    groups = product_groups(model_config(resolve_model(model)))
    rows = [int(r) for r in _ROWS.value]
    if not _IMPLS.value or set(_IMPLS.value) - {"xla", "cpu"}:
        raise app.UsageError(f"--impls: xla and/or cpu, got {_IMPLS.value}")
    timed = {impl: time_jax(groups, rows, _ITERS.value, impl, _LAYERS.value)
             for impl in _IMPLS.value}
    jax_ms = timed.get("xla") or next(iter(timed.values()))
    torch_res = time_torch(_TORCH.value, groups, rows, _ITERS.value)
    res = {"model": model, "groups": groups, "rows": rows, "layers": _LAYERS.value,
           "cores": os.cpu_count(),
           "load_average": list(os.getloadavg()), "xla_ms": timed.get("xla"),
           "cpu_kernel_ms": timed.get("cpu"), "torch": torch_res}
    for key in jax_ms:
        name, m = key.split("@")
        gflop = 2 * int(m) * sum(k * n for k, n in groups[name]) / 1e9
        line = f"{key:>10}:" + "".join(
            f" {'XLA' if impl == 'xla' else 'kernel'} {t[key]:8.3f} ms = "
            f"{gflop / t[key] * 1e3:6.1f} GFLOP/s |" for impl, t in timed.items())
        if len(timed) == 2:
            line += f" kernel / XLA time {timed['cpu'][key] / timed['xla'][key]:.2f}x"
        ms = jax_ms[key]
        if torch_res:
            t = torch_res["ms"][key]
            line += (f" | torch {t:8.3f} ms = {gflop / t * 1e3:6.1f} GFLOP/s | "
                     f"{'XLA' if 'xla' in timed else 'kernel'} / torch time {ms / t:.2f}x")
        print(line)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    app.run(main)
