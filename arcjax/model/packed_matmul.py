"""x @ a linear weight inside the step: XLA's dequantize-then-dot, or the W4A16 Pallas kernel.

Every projection of the decoder (attention's q, k, v, o, the dense MLP, the LM head) is
`matmul(x, w, impl)`. The implementations (`IMPLS`, the engine's `packed_matmul_impl`):

- "xla": `x @ quant.dense(w)`: a packed or quantized weight is dequantized inside the
  jitted step and XLA multiplies (and fuses what it can). Every platform runs it.
- "w4a16": a packed weight in the kernel's layout (`packed.w4a16_layout`: one 4-bit plane
  in group order: AWQ, GPTQ without act-order, 4-bit compressed-tensors, GGUF Q4_0 / Q4_1 /
  Q4_K) goes through `pallas_kernels.w4a16.w4a16_matmul` (Triton lowering, NVIDIA GPUs)
  when the matmul has at most `w4a16.MAX_ROWS` rows (decode steps) and shapes the kernel
  tiles; the weight is read packed and nothing dequantized is written to memory. Every
  other weight and wider steps (prefill chunks) take "xla". The choice is made while the
  step is traced (shapes are static), so each bucket's executable holds one or the other.
- "w4a16_interpret": "w4a16" with the kernel in Pallas' interpreter: the same choices on
  any platform, for tests on the CPU (slow).
- "cpu": a bfloat16 weight multiplied by at most `CPU_MAX_ROWS` rows (decode steps) goes
  through the compiled CPU kernel (`pallas_kernels.cpu_matmul`), which reads the weight as
  stored; XLA:CPU converts such a weight to float32 before the product, in every step (the
  tied LM head's whole embedding table too). Other weights and wider steps take "xla"
  (float32 weights too: the kernel's float32 sweeps run at about XLA's speed, faster for
  some shapes and slower for others, RESULTS.md; switching the engine's float32 products
  is not measured). Inside a
  batch-invariant row tile (`row_tiles.tile_live_rows`) every float32 and bfloat16 matrix
  goes through the kernel, for the tile's live rows only: its products are row-invariant
  by construction, and a lone request's then stream the weights for one row instead of
  XLA's product over the whole tile.

"auto" (`resolve_impl`) is "w4a16" on a GPU for one device when some layer weight is in
the kernel's layout and Pallas' Triton backend exists; "cpu" on the CPU for one device when
some weight is bfloat16 and the CPU kernels build, or in the batch-invariant mode; else
"xla". NOTE: where JAX deprecates that backend (0.11), the kernel's lowering warns
`jax-pallas-triton` (`pallas_kernels.backends`), once per step compiled. One device only: a
Pallas call cannot be partitioned by GSPMD, so under tensor or expert parallelism the step
stays on "xla". The grouped expert GEMMs (`arcjax.model.expert_ffn`) and Qwen2-MoE's shared
expert keep "xla": the kernel is one matrix, not a grouped GEMM. The trace summary names the
resolved choice (`packed_matmul`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from arcjax.model.layer_arrays import LayerArrays
from arcjax.model.packed import PackedWeight, w4a16_layout, w4a16_operands
from arcjax.model.quant import LINEAR_WEIGHTS, dense, tied_head
from arcjax.model.row_tiles import tile_live_rows
from pallas_kernels import cpu_build
from pallas_kernels.backends import pallas_triton_state
from pallas_kernels.cpu_matmul import cpu_matmul
from pallas_kernels.w4a16 import w4a16_matmul, w4a16_unsupported

IMPLS = ("auto", "xla", "cpu", "w4a16", "w4a16_interpret")
KERNEL_IMPLS = ("w4a16", "w4a16_interpret")
CPU_MAX_ROWS = 64  # "cpu": products of at most this many rows (decode-sized buckets)


def _cpu_kernel_takes(x: jax.Array, w) -> bool:
    """"cpu" multiplies `x` by `w` with the kernel: a plain bfloat16 matrix and few rows, or
    inside a batch-invariant row tile any float32 or bfloat16 matrix."""
    if not (isinstance(w, jax.Array) and w.ndim == 2):
        return False
    if tile_live_rows() is not None:
        return w.dtype in (jnp.float32, jnp.bfloat16)
    return w.dtype == jnp.bfloat16 and math.prod(x.shape[:-1]) <= CPU_MAX_ROWS


def _cpu_rows(x: jax.Array) -> jax.Array | None:
    """The rows of `x` the kernel computes: a row tile's live rows when `x` is the tile's
    [rows, K], else all (None)."""
    live = tile_live_rows()
    return live if live is not None and x.ndim == 2 else None


def matmul(x: jax.Array, w, impl: str = "xla") -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype (`impl`: one of `IMPLS` but "auto",
    see the module docstring). `w`: an array, a `QuantizedWeight` or a `PackedWeight`."""
    if impl == "cpu" and _cpu_kernel_takes(x, w):
        out = cpu_matmul(x.reshape(-1, x.shape[-1]), w, rows=_cpu_rows(x))  # [M, N] float32
        return out.reshape(*x.shape[:-1], w.shape[1]).astype(x.dtype)
    if impl in KERNEL_IMPLS and isinstance(w, PackedWeight):
        ops = w4a16_operands(w)
        rows = math.prod(x.shape[:-1])
        if ops is not None and w4a16_unsupported(rows, x.shape[-1], w.shape[-1],
                                                 ops["group"]) is None:
            out = w4a16_matmul(x.reshape(rows, x.shape[-1]), **ops,
                               interpret=impl == "w4a16_interpret")  # [M, N]
            return out.reshape(*x.shape[:-1], w.shape[-1])
    return x @ dense(w, x.dtype)


def tied_matmul(x: jax.Array, embed, impl: str = "xla") -> jax.Array:
    """x [..., H] @ the tied LM head (`embed` [V, H], the embedding table) -> [..., V] in
    x's dtype: `matmul(x, tied_head(embed), impl)`, the table read in place by "cpu"."""
    if impl == "cpu" and _cpu_kernel_takes(x, embed):
        out = cpu_matmul(x.reshape(-1, x.shape[-1]), embed, transposed=True,
                         rows=_cpu_rows(x))  # [M, V]
        return out.reshape(*x.shape[:-1], embed.shape[0]).astype(x.dtype)
    return matmul(x, tied_head(embed), impl)


def kernel_weights(params: dict) -> tuple[str, ...]:
    """The names of the weights "w4a16" may send through the kernel: the layer weights
    (and a packed embedding / LM head) in its layout."""
    layers = {name: w[0] if isinstance(w, LayerArrays) else w  # held one per layer
              for name, w in params["layers"].items()}
    names = [name for name in LINEAR_WEIGHTS
             if isinstance(layers.get(name), PackedWeight) and w4a16_layout(layers[name])]
    return tuple(names + [name for name in ("embed", "lm_head")
                          if isinstance(params.get(name), PackedWeight)
                          and w4a16_layout(params[name])])


def impl_unavailable(impl: str, *, platform: str, parallel: bool) -> str | None:
    """Why `impl` (one of `IMPLS`) cannot run here, or None: the kernel off an NVIDIA GPU
    (its interpreter runs anywhere), under a mesh, or without Pallas' Triton backend."""
    if impl not in IMPLS:
        return f"must be one of {IMPLS}, got {impl!r}"
    if impl == "cpu":
        if platform != "cpu":
            return f'"cpu" runs on the CPU and this runs on {platform}'
        if parallel:
            return ('"cpu" runs on one device (GSPMD cannot partition its call); tensor and '
                    'expert parallelism take "xla"')
        return cpu_build.kernels_unavailable()
    if impl not in KERNEL_IMPLS:
        return None
    if parallel:
        return (f'"{impl}" runs on one device (a Pallas call cannot be partitioned); '
                f'tensor and expert parallelism take "xla"')
    if impl == "w4a16" and platform not in ("gpu", "cuda"):
        return (f'"w4a16" runs on an NVIDIA GPU and this runs on {platform} '
                f'("w4a16_interpret" runs the kernel in Pallas\' interpreter; "auto" picks '
                f'xla here)')
    if pallas_triton_state() == "absent":
        return f"jax {jax.__version__} has no Pallas Triton backend"
    return None


def resolve_impl(impl: str, params: dict, *, platform: str, parallel: bool,
                 batch_invariant: bool = False) -> str:
    """The implementation the step runs: `impl` itself, or what "auto" picks (see the
    module docstring) for `params` on `platform` (`parallel`: a mesh splits the model;
    `batch_invariant`: the mode's row tiles, where "auto" is "cpu" wherever the CPU kernel
    runs, whatever the weights' dtype, else "xla")."""
    if impl != "auto":
        return impl
    if batch_invariant:
        return ("cpu" if impl_unavailable("cpu", platform=platform, parallel=parallel) is None
                else "xla")
    if (platform in ("gpu", "cuda") and kernel_weights(params)
            and impl_unavailable("w4a16", platform=platform, parallel=parallel) is None):
        return "w4a16"
    if (any(isinstance(w, jax.Array) and w.dtype == jnp.bfloat16
            for w in jax.tree.leaves(params))
            and impl_unavailable("cpu", platform=platform, parallel=parallel) is None):
        return "cpu"
    return "xla"
