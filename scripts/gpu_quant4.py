"""W4A16 decode matmuls on the GPU: the Pallas kernel, the XLA path and bf16, side by side.

For each decode shape (`--shapes`: M x K x N) and each zero-point kind (AWQ / GPTQ zero
points, GGUF Q4_1 mins, a constant shift), one row:

1. correctness: the kernel against its oracle (`pallas_kernels.w4a16.w4a16_reference`);
2. time (median of `--iters` synchronized calls) of
   - `kernel`: `w4a16_matmul` (Pallas, Triton lowering), the packed weight read once,
   - `xla`: the engine's path today, x @ `PackedWeight.dequantize` (XLA fuses what it can),
   - `bf16`: x @ a bf16 weight of the same shape (what a float checkpoint costs);
3. bytes/s of the weight each moves (packed bytes for kernel and xla, 2 bytes a weight for
   bf16) against the device's copy rate (a 1 GiB device-to-device copy, measured here).

  python scripts/gpu_quant4.py --out=runs/gpu_quant4.json
  python scripts/gpu_quant4.py --smoke            # tiny shapes, CPU, interpret mode

Standalone: every shape and kind, more iterations. scripts/gpu_check.sh's `kernel_table.w4a16`
task times three of these shapes (`gpu_bench.w4a16_decode`, its operands from here).
Writes the JSON and prints the markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import platform

import numpy as np
from absl import app

from arcjax.entrypoints.flags import config_from_flags, define_flags


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuQuant4Config:
    shapes: str = "1x4096x4096,8x4096x4096,16x4096x14336,1x14336x4096,1x576x1536"
    kinds: str = "zero,offset,shift"
    group: int = 128
    iters: int = 50
    warmup: int = 5
    smoke: bool = False  # tiny shapes in interpret mode (CPU)
    out: str = ""


def copy_rate(nbytes: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (read + write counted once each)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.testing import time_ms

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0)
    return 2 * nbytes / (time_ms(copy, (x,), warmup=2, iters=iters) / 1e3)


def operands(m: int, k: int, n: int, kind: str, group: int, seed: int = 0) -> dict:
    """Random operands of one W4A16 matmul: x [m, k] bf16, qweight [k / 8, n], fp16
    scales every `group` rows, and the zero-point kind's arrays ("zero": AWQ / GPTQ zero
    points, "offset": GGUF Q4_1 mins, "shift": the constant 8). Also the weight as a
    `PackedWeight` (`w`, what the XLA path dequantizes) and its packed bytes."""
    import jax.numpy as jnp

    from arcjax.model.packed import PackedLayout, PackedWeight

    rng = np.random.default_rng(seed)
    g = k // group
    qweight = jnp.asarray(rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint64)
                          .astype(np.uint32))
    scale = jnp.asarray(rng.normal(size=(g, n)) * 0.01, jnp.float16)
    zero = jnp.asarray(rng.integers(0, 16, (g, n)), jnp.uint8) if kind == "zero" else None
    offset = (jnp.asarray(rng.normal(size=(g, n)) * 0.01, jnp.float16)
              if kind == "offset" else None)
    shift = 8 if kind == "shift" else 0
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = PackedWeight((qweight,), scale, zero, offset, None,
                     PackedLayout("w4", (4,), group, k, shift))
    nbytes = sum(int(a.nbytes) for a in (qweight, scale, zero, offset) if a is not None)
    return dict(x=x, qweight=qweight, scale=scale, zero=zero, offset=offset, shift=shift,
                group=group, w=w, nbytes=nbytes)


def row(m: int, k: int, n: int, kind: str, cfg: GpuQuant4Config, rate: float) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.testing import time_ms
    from pallas_kernels.w4a16 import plan_w4a16, w4a16_matmul, w4a16_reference

    group = min(cfg.group, k)
    ops = operands(m, k, n, kind, group)
    x, qweight, scale, zero, offset, shift, w = (ops[name] for name in (
        "x", "qweight", "scale", "zero", "offset", "shift", "w"))
    rng = np.random.default_rng(1)
    interpret = cfg.smoke
    kernel = jax.jit(lambda x, q, s, z, o: w4a16_matmul(x, q, s, z, o, group=group,
                                                        shift=shift, interpret=interpret))
    args = (x, qweight, scale, zero, offset)
    got = np.asarray(kernel(*args), np.float32)
    want = np.asarray(w4a16_reference(*args, group=group, shift=shift), np.float32)
    err = float(np.max(np.abs(got - want)) / max(1e-6, np.max(np.abs(want))))
    xla = jax.jit(lambda x, w: x @ w.dequantize(x.dtype))
    dense_w = jnp.asarray(rng.normal(size=(k, n)) * 0.01, jnp.bfloat16)
    bf16 = jax.jit(lambda x, w: x @ w)
    timing = dict(warmup=cfg.warmup, iters=cfg.iters)
    ms = {"kernel": time_ms(kernel, args, **timing), "xla": time_ms(xla, (x, w), **timing),
          "bf16": time_ms(bf16, (x, dense_w), **timing)}
    moved = {"kernel": ops["nbytes"], "xla": ops["nbytes"], "bf16": 2 * k * n}
    out = {"shape": f"{m}x{k}x{n}", "kind": kind, "group": group,
           "plan": dataclasses.asdict(plan_w4a16(m, k, n, group)), "max_rel_err": err,
           "ms": ms, "copy_rate_gbs": rate / 1e9}
    out["gbs"] = {name: moved[name] / (t / 1e3) / 1e9 for name, t in ms.items()}
    out["of_copy_rate"] = {name: moved[name] / (t / 1e3) / rate for name, t in ms.items()}
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| shape MxKxN | zero | kernel ms | xla ms | bf16 ms | kernel GB/s (of copy) | "
             "bf16 GB/s (of copy) | kernel vs bf16 | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, gbs, frac = r["ms"], r["gbs"], r["of_copy_rate"]
        lines.append(f"| {r['shape']} | {r['kind']} | {ms['kernel']:.4f} | {ms['xla']:.4f} | "
                     f"{ms['bf16']:.4f} | {gbs['kernel']:.0f} ({100 * frac['kernel']:.0f}%) | "
                     f"{gbs['bf16']:.0f} ({100 * frac['bf16']:.0f}%) | "
                     f"{ms['bf16'] / ms['kernel']:.2f}x | {r['max_rel_err']:.1e} |")
    return "\n".join(lines)


def main(_):
    import jax

    cfg = config_from_flags(GpuQuant4Config)
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, shapes="1x256x64,4x128x128", iters=2, warmup=1,
                                  group=min(cfg.group, 64))
    rate = copy_rate((1 << 24) if cfg.smoke else (1 << 30), cfg.iters)
    rows = []
    for shape in cfg.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        for kind in cfg.kinds.split(","):
            rows.append(row(m, k, n, kind, cfg, rate))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "device": str(jax.devices()[0]),
                       "machine": platform.machine(), "rows": rows}, f, indent=2)
    print(markdown(rows))


if __name__ == "__main__":
    define_flags(GpuQuant4Config)
    app.run(main)
