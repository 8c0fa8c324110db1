"""Launch plan and data layout of the GPU attention kernels, independent of the lowering.

The Triton-lowered kernel in `pallas_gpu.py` (and a Mosaic GPU kernel later)
share everything here: tile sizes, the grid, how queries are packed so that
the GQA query heads of one KV head fill the matrix M dimension, and how
split-K partial results are combined.

Grid: `(Hkv, num_splits, num_tiles)`. Program `(h, p, w)` computes query tile
`w` (see `plan.py`, ordered longest first) for KV head `h`; programs start in
that order, heads fastest, so the longest causal tiles start first. A tile of a
*split* sequence (a decode row, see `split_sequences`) covers only the `p`-th
slice of its key steps and writes unnormalized partials to the sequence's slot;
other tiles run whole in `p == 0` and write final rows (`p > 0` do nothing).

Query packing: `q [T, Hq, D]` becomes `[Hkv, (T + pad) * G, D]`, row
`t * G + g` holding query head `h * G + g` of token `t`. A tile of `block_q`
tokens starting at token `t0` is then the contiguous rows
`t0 * G .. (t0 + block_q) * G - 1` for every KV head; M = `block_q * G`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels import plan as plan_lib
from pallas_kernels.kernel_errors import require

LOG2E = math.log2(math.e)
MIN_DOT = 16  # smallest matmul dimension the GPU lowering accepts
NUM_SMS = 132  # H200; only steers the split-K heuristic


# Prefill tiles: 128 packed query rows reuse each K/V tile twice as often as 64, and
# compile for sm_90a without spills at 2-byte dtypes and D <= 128 (see
# scripts/gpu_compile_report.py); wider dtypes or heads keep 64.
PREFILL_BLOCK_M = 128
NARROW_BLOCK_M = 64
# Mixed batches split a decode row's keys so each split walks at least this many steps,
# into at most MIXED_MAX_SPLITS: every tile launches num_splits programs per KV head and
# the extra ones of unsplit tiles exit at once, so a large factor costs launches.
MIXED_SPLIT_STEPS = 32
MIXED_MAX_SPLITS = 4
# Three stages: with the page ids carried one step ahead, Triton keeps two K/V loads in
# flight (cp.async.wait_group 2) instead of waiting for each load before computing.
NUM_STAGES = 3
# Batch-invariant plans: one packed-row width for decode and prefill buckets alike (the
# narrow one: a decode row pays for the idle rows of its tile).
INVARIANT_BLOCK_M = NARROW_BLOCK_M


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuPlan:
    """Static launch parameters; hashable."""

    tiles: plan_lib.TilePlan
    group: int  # query heads per KV head, padded to a power of two
    rows: int  # M: packed query rows a program loads (>= block_q * group, >= MIN_DOT)
    num_splits: int  # split-K factor over the keys of a split sequence's tile
    split_max_q_len: int  # sequences with 1 .. this many query tokens are split (<= block_q)
    num_warps: int
    num_stages: int
    # Batch-invariant plan (`make_gpu_plan(batch_invariant=True)`): every key step runs the
    # masked body, so a row's keys go through one program text whatever its tile holds.
    all_masked: bool = False

    @property
    def tokens_loaded(self) -> int:
        """Tokens a program's M rows span (rows past the tile's own are idle)."""
        return self.rows // self.group

    @property
    def split_rows(self) -> int:
        """Packed rows of one split sequence's slot in the split-K partials."""
        return self.split_max_q_len * self.group


def make_gpu_plan(*, num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, page_size: int, max_blocks: int, max_q_len: int,
                  itemsize: int = 2, block_m: int | None = None, block_k: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int = NUM_STAGES, batch_invariant: bool = False) -> GpuPlan:
    """Chooses tile sizes and the split-K factor for one bucket.

    Args:
        num_tokens, num_seqs: T and S of the bucket.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        page_size, max_blocks: cache page size and block-table width.
        max_q_len: static bound on any chunk's length; 1 means a decode-only batch.
        itemsize: bytes per element of q and the cache (steers the default block_m).
        block_m: target packed query rows per program (tokens x query heads).
        block_k: target keys per inner step (rounded to whole pages); by default 64,
            or 32 for 4-byte dtypes (3xTF32 float32 tiles at 64 keys need more than
            the 227 KB of shared memory a block may use).
        num_splits: split-K factor for decode rows. By default chosen to fill the
            GPU in decode-only batches, and so each split of a mixed batch's decode
            row walks at least `MIXED_SPLIT_STEPS` key steps.
        num_warps, num_stages: Triton launch parameters.
        batch_invariant: one plan for every bucket of a cache geometry and dtype (see
            `INVARIANT_BLOCK_M`): block_m `INVARIANT_BLOCK_M` unless given, tiles never
            narrowed to the bucket's max_q_len, no split-K (num_splits must be 1 if
            given), every key step masked (`GpuPlan.all_masked`). A row's program then
            has the same shapes, key blocks (aligned to absolute positions, as always)
            and body whatever its chunk, its tile or its bucket holds.
    """
    group = plan_lib.next_pow2(num_heads // num_kv_heads)
    if batch_invariant:
        require(num_splits in (None, 1), "num_splits", f"a batch-invariant plan does not "
                f"split keys (the split follows the batch), got {num_splits}")
        num_splits = 1
        block_m = INVARIANT_BLOCK_M if block_m is None else block_m
    if block_m is None:
        wide = itemsize <= 2 and head_dim <= 128 and max_q_len > 1
        block_m = PREFILL_BLOCK_M if wide else NARROW_BLOCK_M
    if block_k is None:
        block_k = 64 if itemsize <= 2 else 32
    tiles = plan_lib.make_plan(num_tokens=num_tokens, num_seqs=num_seqs, page_size=page_size,
                               max_blocks=max_blocks, max_q_len=max_q_len,
                               block_q=max(1, block_m // group), block_k=block_k,
                               pow2_tiles=True, min_block_k=MIN_DOT,
                               one_width=batch_invariant)
    rows = max(tiles.block_q * group, MIN_DOT)
    max_steps = plan_lib.cdiv(max_blocks * page_size, tiles.block_k)
    if num_splits is None:
        if max_q_len == 1:
            programs = tiles.num_tiles * num_kv_heads
            num_splits = min(16, max_steps, max(1, 4 * NUM_SMS // programs))
        else:
            num_splits = min(MIXED_MAX_SPLITS, max_steps // MIXED_SPLIT_STEPS)
    if num_warps is None:
        num_warps = 4 if rows * head_dim <= 64 * 64 else 8
    return GpuPlan(tiles=tiles, group=group, rows=rows, num_splits=max(1, num_splits),
                   split_max_q_len=1, num_warps=num_warps, num_stages=num_stages,
                   all_masked=batch_invariant)


def split_sequences(plan: GpuPlan, cu_seqlens_q: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """[S] bool: live sequences whose keys are split across `num_splits` programs.

    Those with 1 .. `split_max_q_len` query tokens (decode rows): their one tile has
    little to compute per key, so a long context would otherwise run serially.
    """
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [S]
    live = jnp.arange(q_lens.shape[0]) < num_seqs
    return live & (q_lens >= 1) & (q_lens <= plan.split_max_q_len) & (plan.num_splits > 1)


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


def packed_sinks(sinks: jax.Array | None, plan: GpuPlan, num_kv_heads: int,
                 num_rows: int) -> jax.Array:
    """`[Hq]` sink logits -> `[Hkv, num_rows]` float32 base-2 logits of packed rows (row
    `r` of KV head h is query head `h * Hq/Hkv + r % group`; rows of a padded group get
    0); zeros when `sinks` is None (the kernels then never read them)."""
    if sinks is None:
        return jnp.zeros((num_kv_heads, num_rows), jnp.float32)
    g = sinks.shape[0] // num_kv_heads
    per_group = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, g) * LOG2E,
                        ((0, 0), (0, plan.group - g)))  # [Hkv, group]
    return jnp.tile(per_group, (1, -(-num_rows // plan.group)))[:, :num_rows]


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array,
                   sinks: jax.Array | None = None) -> jax.Array:
    """Merges split-K partials (base-2 log domain) into normalized output.

    Args:
        o: [P, Hkv, R, D] unnormalized partial outputs.
        m: [P, Hkv, R] running maxima of the base-2 scores.
        l: [P, Hkv, R] partial softmax denominators.
        sinks: None, or [Hkv, R] base-2 sink logits (`packed_sinks`), one more
            denominator term per row, taken once here.

    Returns:
        [Hkv, R, D] float32.
    """
    m_max = jnp.max(m, axis=0)
    if sinks is not None:
        m_max = jnp.maximum(m_max, sinks)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0)
    w = jnp.exp2(m - m_max[None])  # [P, Hkv, R]; empty splits have m=-inf, weight 0
    den = jnp.sum(w * l, axis=0)
    if sinks is not None:
        den = den + jnp.exp2(sinks - m_max)
    num = jnp.sum(w[..., None] * o, axis=0)
    return num / jnp.where(den > 0, den, 1)[..., None]


def scatter_split_rows(out: jax.Array, combined: jax.Array, plan: GpuPlan,
                       cu_seqlens_q: jax.Array, split: jax.Array) -> jax.Array:
    """Writes the combined rows of split sequences into the `[T, Hq, D]` output.

    Args:
        out: [T, Hq, D]; rows of split sequences hold garbage until now.
        combined: [Hkv, S * split_rows + pad, D], sequence s at rows
            `s * split_rows ..` (token-major, then query head, as packed).
        plan: the launch plan.
        cu_seqlens_q: [S + 1].
        split: [S] bool from `split_sequences`.
    """
    t, hq, d = out.shape
    hkv, s = combined.shape[0], split.shape[0]
    g, length = hq // hkv, plan.split_max_q_len
    rows = combined[:, :s * plan.split_rows].reshape(hkv, s, length, plan.group, d)
    rows = rows[:, :, :, :g].transpose(1, 2, 0, 3, 4).reshape(s, length, hq, d)
    j = jnp.arange(length)  # [L]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [S]
    ok = split[:, None] & (j[None, :] < q_lens[:, None])  # [S, L]
    target = jnp.where(ok, cu_seqlens_q[:-1, None] + j[None, :], t)  # t: dropped
    return out.at[target.reshape(-1)].set(rows.reshape(-1, hq, d).astype(out.dtype),
                                          mode="drop")


def padding_rows_to_zero(out: jax.Array, cu_seqlens_q: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """Rows at and past `cu_seqlens_q[num_seqs]` were never written: make them 0."""
    real = jnp.arange(out.shape[0]) < cu_seqlens_q[num_seqs]
    return jnp.where(real[:, None, None], out, 0)
