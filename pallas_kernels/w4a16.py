"""W4A16 matmul for decode shapes: x [M, K] (bf16/f16/f32) times a 4-bit packed weight,
as one Pallas kernel for NVIDIA GPUs (Triton lowering), with its oracle.

The weight is `arcjax.model.packed`'s single 4-bit plane: `qweight` uint32 [K / 8, N],
word k of column n holding rows 8k .. 8k + 7 (row 8k + j in bits 4j .. 4j + 3), and per
group of `group` rows `scale` [K / group, N] with the zero point `zero` [K / group, N]
(uint8; AWQ, GPTQ) or the constant `shift` (Q4_0: 8, symmetric GPTQ / compressed-tensors:
8), and optionally `offset` [K / group, N] added after scaling (Q4_1, Q4_K mins):

    w[k, n] = scale[k // group, n] * (code[k, n] - zero) + offset[k // group, n]

Dataflow (`w4a16_matmul`):
    1. `plan_w4a16` picks the tiles: block_n columns per program, block_k rows per step,
       and a split of K over `splits` programs when the N tiles alone are too few to fill
       the device (decode: M is 1-16, so the weight's bytes are the whole cost).
    2. x is padded to block_m rows (Triton's dots need 16).
    3. One `pallas_call` over (N / block_n, splits): each program walks its K steps; a
       step loads the step's words once per row they feed (`rows // 8`: repeated rows come
       from cache, as AutoGPTQ's Triton kernel reads them), shifts each row's nibble out,
       gathers its group's scale (and zero, offset) row the same way, dequantizes in
       float32 into x's dtype and accumulates `x_tile @ w_tile` in float32. Nothing
       dequantized is ever written to memory.
    4. Split partials [splits, M, N] are summed by XLA.

`w4a16_reference` is the oracle (plain jnp, float32 math). The kernel runs on CPU with
`interpret=True` (tests/test_quant4_kernel.py); tests lower it for CUDA on the CPU too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kernel_errors import KernelArgumentError
from pallas_kernels.pallas_gpu import dot_precision

TARGET_PROGRAMS = 128  # about an H100/H200's SM count: programs that keep it busy
# The most rows (M) the engine's step sends through the kernel: decode shapes, where the
# weight's bytes are the whole cost. Its x block and float32 accumulator grow with M; a
# wider step (a prefill chunk) is compute-bound and takes XLA's dequantize-then-dot.
MAX_ROWS = 16


@dataclasses.dataclass(frozen=True)
class W4A16Plan:
    """Tiles of one W4A16 matmul (all powers of two, block_m and block_k >= 16)."""

    block_m: int
    block_n: int
    block_k: int
    splits: int  # programs sharing each column tile's K steps
    num_warps: int = 4
    num_stages: int = 2


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def plan_w4a16(m: int, k: int, n: int, group: int, *, block_n: int | None = None,
               block_k: int | None = None, splits: int | None = None) -> W4A16Plan:
    """The tiles for x [m, k] @ w [k, n] with scales every `group` rows.

    Raises:
      KernelArgumentError: k or n without a power-of-two tile of at least 16, or a group
        that is neither a multiple nor a divisor of the K step.
    """
    block_m = max(16, 1 << (max(m, 1) - 1).bit_length())
    block_n = block_n or _pow2_divisor(n, 128)
    block_k = block_k or _pow2_divisor(k, 256)
    if block_n < 16 or n % block_n:
        raise KernelArgumentError("qweight", f"N={n} has no power-of-two column tile >= 16")
    if block_k < 16 or k % block_k:
        raise KernelArgumentError("x", f"K={k} has no power-of-two row tile >= 16")
    if block_k % group and group % block_k:
        raise KernelArgumentError("scale", f"group {group} neither divides nor is a "
                                           f"multiple of the K step {block_k}")
    steps = k // block_k
    if splits is None:
        want = max(1, TARGET_PROGRAMS // (n // block_n))
        splits = max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)
    if steps % splits:
        raise KernelArgumentError("splits", f"{splits} does not divide the {steps} K steps")
    return W4A16Plan(block_m, block_n, block_k, splits)


def w4a16_unsupported(m: int, k: int, n: int, group: int) -> str | None:
    """Why `w4a16_matmul` would not take x [m, k] @ w [k, n] with scales every `group`
    rows in the engine's step (more than MAX_ROWS rows, or no tiling), or None if it
    would."""
    if m > MAX_ROWS:
        return f"M={m} is more than the kernel's {MAX_ROWS} decode rows"
    try:
        plan_w4a16(m, k, n, group)
    except KernelArgumentError as e:
        return str(e)
    return None


def _kernel(x_ref, qw_ref, scale_ref, *refs, plan: W4A16Plan, group: int, shift: int,
            has_zero: bool, has_offset: bool, precision):
    """One (column tile, split) program: its K steps, accumulated in float32."""
    refs = list(refs)
    zero_ref = refs.pop(0) if has_zero else None
    offset_ref = refs.pop(0) if has_offset else None
    (o_ref,) = refs
    bk, steps = plan.block_k, x_ref.shape[1] // plan.block_k // plan.splits
    first = pl.program_id(1) * steps
    nibble = ((jnp.arange(bk) % 8) * 4).astype(jnp.uint32)[:, None]  # [bk, 1]

    def step(i, acc):
        k0 = (first + i) * bk
        rows = k0 + jnp.arange(bk)  # [bk]
        words = qw_ref[rows // 8, :]  # [bk, bn] uint32, each word once per row it holds
        codes = ((words >> nibble) & jnp.uint32(0xF)).astype(jnp.int32)
        g = rows // group  # [bk] each row's group
        if has_zero:
            codes = codes - zero_ref[g, :].astype(jnp.int32)
        elif shift:
            codes = codes - shift
        w = scale_ref[g, :].astype(jnp.float32) * codes.astype(jnp.float32)
        if has_offset:
            w = w + offset_ref[g, :].astype(jnp.float32)
        x = x_ref[:, pl.ds(k0, bk)]  # [bm, bk]
        return acc + plgpu.dot(x, w.astype(x.dtype), precision=precision).astype(jnp.float32)

    acc = jax.lax.fori_loop(0, steps, step,
                            jnp.zeros((plan.block_m, plan.block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _check(x, qweight, scale, zero, offset, group):
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape != (k // 8, n) or qweight.dtype != jnp.uint32:
        raise KernelArgumentError("qweight", f"expected uint32 [{k // 8}, N], got "
                                             f"{qweight.dtype} {qweight.shape}")
    groups = -(-k // group)
    for name, a in (("scale", scale), ("zero", zero), ("offset", offset)):
        if a is not None and a.shape != (groups, n):
            raise KernelArgumentError(name, f"expected [{groups}, {n}], got {a.shape}")


@functools.partial(jax.jit, static_argnames=("group", "shift", "plan", "interpret"))
def w4a16_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array,
                 zero: jax.Array | None = None, offset: jax.Array | None = None, *,
                 group: int, shift: int = 0, plan: W4A16Plan | None = None,
                 interpret: bool = False) -> jax.Array:
    """x [M, K] @ the packed weight [K, N] (see the module docstring), in x's dtype.

    Args:
      x: [M, K] activations.
      qweight: [K / 8, N] uint32 codes.
      scale: [K / group, N]; zero: [K / group, N] uint8 or None (then `shift`);
        offset: [K / group, N] or None.
      group: rows per scale; shift: the constant zero point when `zero` is None.
      plan: the tiles (`plan_w4a16`'s choice when None).
      interpret: run the kernel in Pallas' interpreter (CPU tests).

    Returns:
      [M, N] in x's dtype (float32 accumulation).
    """
    _check(x, qweight, scale, zero, offset, group)
    m, k = x.shape
    n = qweight.shape[1]
    plan = plan or plan_w4a16(m, k, n, group)
    xp = jnp.pad(x, ((0, plan.block_m - m), (0, 0))) if m < plan.block_m else x
    if xp.shape[0] > plan.block_m:
        raise KernelArgumentError("x", f"M={m} exceeds the plan's block_m {plan.block_m}")
    bn = plan.block_n
    extras = [a for a in (zero, offset) if a is not None]

    def columns(a):  # a column tile of a [rows, N] array, whole along its rows
        return pl.BlockSpec((a.shape[0], bn), lambda j, s: (0, j))

    in_specs = [pl.BlockSpec(xp.shape, lambda j, s: (0, 0)), columns(qweight),
                columns(scale)] + [columns(a) for a in extras]
    kernel = functools.partial(_kernel, plan=plan, group=group, shift=shift,
                               has_zero=zero is not None, has_offset=offset is not None,
                               precision=dot_precision(x.dtype, interpret=interpret))
    partial = pl.pallas_call(
        kernel, grid=(n // bn, plan.splits), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, plan.block_m, bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((plan.splits, plan.block_m, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret, name="w4a16_matmul",
    )(xp, qweight, scale, *extras)
    return jnp.sum(partial, axis=0)[:m].astype(x.dtype)


def w4a16_reference(x: jax.Array, qweight: jax.Array, scale: jax.Array,
                    zero: jax.Array | None = None, offset: jax.Array | None = None, *,
                    group: int, shift: int = 0) -> jax.Array:
    """The oracle: the weight dequantized in float32 and rounded to x's dtype (as the
    kernel feeds its dots), x @ w in float32, the result in x's dtype."""
    k = x.shape[1]
    shifts = jnp.arange(8, dtype=jnp.uint32) * jnp.uint32(4)
    codes = ((qweight[:, None, :] >> shifts[:, None]) & jnp.uint32(0xF)).reshape(k, -1)
    g = jnp.arange(k) // group
    q = codes.astype(jnp.int32) - (zero[g].astype(jnp.int32) if zero is not None else shift)
    w = scale[g].astype(jnp.float32) * q.astype(jnp.float32)
    if offset is not None:
        w = w + offset[g].astype(jnp.float32)
    w = w.astype(x.dtype).astype(jnp.float32)
    out = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)
