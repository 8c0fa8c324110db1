"""Launch plan and data layout of the GPU attention kernels, independent of the lowering.

The Triton-lowered kernel in `pallas_gpu.py` (and a Mosaic GPU kernel later)
share everything here: tile sizes, the grid, how queries are packed so that
the GQA query heads of one KV head fill the matrix M dimension, and how
split-K partial results are combined.

Grid: `(num_tiles, Hkv, num_splits)`. Program `(w, h, p)` computes query tile
`w` (see `plan.py`) for KV head `h` over the `p`-th slice of the tile's
unmasked key steps.

Query packing: `q [T, Hq, D]` becomes `[Hkv, (T + pad) * G, D]`, row
`t * G + g` holding query head `h * G + g` of token `t`. A tile of `block_q`
tokens starting at token `t0` is then the contiguous rows
`t0 * G .. (t0 + block_q) * G - 1` for every KV head; M = `block_q * G`.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import plan as plan_lib

MIN_DOT = 16  # smallest matmul dimension the GPU lowering accepts
NUM_SMS = 132  # H200; only steers the split-K heuristic


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuPlan:
    """Static launch parameters; hashable."""

    tiles: plan_lib.TilePlan
    group: int  # query heads per KV head, padded to a power of two
    rows: int  # M: packed query rows a program loads (>= block_q * group, >= MIN_DOT)
    num_splits: int  # split-K factor over a tile's key steps
    num_warps: int
    num_stages: int

    @property
    def tokens_loaded(self) -> int:
        """Tokens a program's M rows span (rows past the tile's own are idle)."""
        return self.rows // self.group


def make_gpu_plan(*, num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, page_size: int, max_blocks: int, max_q_len: int,
                  block_m: int = 64, block_k: int = 64, num_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int = 2) -> GpuPlan:
    """Chooses tile sizes and the split-K factor for one bucket.

    Args:
        num_tokens, num_seqs: T and S of the bucket.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        page_size, max_blocks: cache page size and block-table width.
        max_q_len: static bound on any chunk's length; 1 means a decode-only batch.
        block_m: target packed query rows per program (tokens x query heads).
        block_k: target keys per inner step (rounded to whole pages).
        num_splits: split-K factor; by default 1 unless the batch is decode-only,
            where it is chosen to fill the GPU.
        num_warps, num_stages: Triton launch parameters.
    """
    group = plan_lib.next_pow2(num_heads // num_kv_heads)
    tiles = plan_lib.make_plan(num_tokens=num_tokens, num_seqs=num_seqs, page_size=page_size,
                               max_blocks=max_blocks, max_q_len=max_q_len,
                               block_q=max(1, block_m // group), block_k=block_k,
                               pow2_tiles=True, min_block_k=MIN_DOT)
    rows = max(tiles.block_q * group, MIN_DOT)
    max_steps = plan_lib.cdiv(max_blocks * page_size, tiles.block_k)
    if num_splits is None:
        programs = tiles.num_tiles * num_kv_heads
        num_splits = 1 if max_q_len > 1 else min(16, max_steps, max(1, 4 * NUM_SMS // programs))
    if num_warps is None:
        num_warps = 4 if rows * head_dim <= 64 * 64 else 8
    return GpuPlan(tiles=tiles, group=group, rows=rows, num_splits=max(1, num_splits),
                   num_warps=num_warps, num_stages=num_stages)


def pack_queries(q: jax.Array, plan: GpuPlan, num_kv_heads: int) -> jax.Array:
    """`[T, Hq, D]` -> `[Hkv, (T + tokens_loaded) * G, D]` (zero padded)."""
    t, hq, d = q.shape
    g = hq // num_kv_heads
    q = q.reshape(t, num_kv_heads, g, d)
    q = jnp.pad(q, ((0, plan.tokens_loaded), (0, 0), (0, plan.group - g), (0, 0)))
    return q.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, d)


def unpack_output(o: jax.Array, num_tokens: int, num_heads: int) -> jax.Array:
    """`[Hkv, rows_total, D]` -> `[T, Hq, D]`, inverse of `pack_queries`."""
    hkv, _, d = o.shape
    g = num_heads // hkv
    o = o.reshape(hkv, -1, plan_lib.next_pow2(g), d)[:, :num_tokens, :g]  # [Hkv, T, G, D]
    return o.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, d)


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merges split-K partials (base-2 log domain) into normalized output.

    Args:
        o: [P, Hkv, R, D] unnormalized partial outputs.
        m: [P, Hkv, R] running maxima of the base-2 scores.
        l: [P, Hkv, R] partial softmax denominators.

    Returns:
        [Hkv, R, D] float32.
    """
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0)
    w = jnp.exp2(m - m_max[None])  # [P, Hkv, R]; empty splits have m=-inf, weight 0
    den = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * o, axis=0)
    return num / jnp.where(den > 0, den, 1)[..., None]


def padding_rows_to_zero(out: jax.Array, cu_seqlens_q: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """Rows at and past `cu_seqlens_q[num_seqs]` were never written: make them 0."""
    real = jnp.arange(out.shape[0]) < cu_seqlens_q[num_seqs]
    return jnp.where(real[:, None, None], out, 0)
