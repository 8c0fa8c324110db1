"""Decode-only ragged paged attention as a Pallas Mosaic GPU kernel (Hopper).

The decode step is bandwidth-bound: this kernel streams each sequence's pages with TMA
copies through `plgpu.emit_pipeline` and does both products on the tensor cores with
warpgroup matmuls (`plgpu.wgmma`).

Dataflow:
    1. XLA packs each sequence's one query row: the G query heads of KV head h become
       rows 0..G-1 of a 64-row tile (`[S, Hkv, 64, D]`; wgmma's M is 64 per warpgroup),
       and sequences with no query row this step get no keys.
    2. One program per (KV head, sequence, split) over the grid `(Hkv, S, num_splits)`:
       it copies its query tile to shared memory, then pipelines its slice of the
       sequence's pages (one page per step, page ids read from the block table in the
       index map, `MAX_CONCURRENT_STEPS` TMA copies in flight), keeping an online
       softmax in base 2 in registers. The last page of a sequence is masked (its keys
       past kv_len are set to zero in shared memory, NaN included).
    3. Programs write unnormalized partials (o, m, l) that XLA combines across splits
       (`gpu_plan.combine_splits`) and scatters to the sequences' rows.

Sliding windows, soft-caps and float8 pages are not implemented here (the Triton kernel
has them); `api.py` sends such calls elsewhere.

NOTE: Mosaic GPU kernels can neither run nor be interpreted on the CPU. This one lowers
for CUDA on the CPU (tests/test_gpu_lowering_mosaic.py); its numbers are checked against
the oracle only by scripts/gpu_check.sh on a GPU, which records a passing run
(`pallas_kernels.verified`); "auto" uses it only after that.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_plan as gpu_plan_lib

ROWS = 64  # wgmma M per warpgroup: the packed query heads of one KV head, padded
MAX_CONCURRENT_STEPS = 4  # pages in flight per program
LOG2E = math.log2(math.e)
SWIZZLE = 128  # bytes


def _smem_transforms(dtype) -> tuple:
    elems = SWIZZLE // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE))


def _launch(q_packed, k_pages, v_pages, tables, lens, *, num_splits: int, sm_scale: float):
    s_bucket, hkv, _, head_dim = q_packed.shape
    num_blocks, page_size = k_pages.shape[:2]
    dtype = q_packed.dtype
    transforms = _smem_transforms(dtype)

    def kernel(q_gmem, k_gmem, v_gmem, tables_gmem, lens_gmem, o_gmem, m_gmem, l_gmem,
               q_smem, o_smem, q_barrier):
        h, s, p = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("p")
        kv_len = lens_gmem[s]
        pages = (kv_len + page_size - 1) // page_size
        per_split = (pages + num_splits - 1) // num_splits
        lo = jnp.minimum(p * per_split, pages)
        steps = jnp.minimum(lo + per_split, pages) - lo

        plgpu.copy_gmem_to_smem(q_gmem.at[s, h], q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)

        def page_of(i):
            return jnp.clip(tables_gmem[s, lo + i], 0, num_blocks - 1)

        def step(indices, k_smem, v_smem, carry):
            (i,) = indices
            m, l, acc = carry
            first_key = (lo + i) * page_size

            @pl.when(first_key + page_size > kv_len)  # the last page: zero keys past kv_len
            def _():
                keys = first_key + plgpu.broadcasted_iota(
                    jnp.int32, (page_size, head_dim), 0,
                    layout=plgpu.Layout.WG_STRIDED((page_size, head_dim), vec_size=8))
                v_smem[...] = jnp.where(keys < kv_len, v_smem[...], 0).astype(dtype)
                plgpu.commit_smem()

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
                return acc_ref[...]

            s_ = pl.run_scoped(qk, plgpu.ACC((ROWS, page_size), jnp.float32))
            s_ = s_ * (sm_scale * LOG2E)
            keys = first_key + plgpu.broadcasted_iota(
                jnp.int32, (ROWS, page_size), 1, layout=plgpu.Layout.WGMMA)
            s_ = jnp.where(keys < kv_len, s_, -jnp.inf)
            m_new = jnp.maximum(m, s_.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            prob = jnp.exp2(s_ - lax.broadcast_in_dim(m_new, s_.shape, [0]))
            l = l * alpha + prob.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, prob.astype(dtype), v_smem)

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            return m_new, l, acc

        m0 = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32),
                               plgpu.Layout.WGMMA.reduce(1))
        l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc0 = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        page_spec = plgpu.BlockSpec((None, page_size, None, head_dim),
                                    lambda i: (page_of(i), 0, h, 0), transforms=transforms)
        m, l, acc = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=[page_spec, page_spec],
            max_concurrent_steps=MAX_CONCURRENT_STEPS, init_carry=(m0, l0, acc0),
        )(k_gmem, v_gmem)

        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[p, h, s])
        plgpu.wait_smem_to_gmem(0)
        m_gmem[p, h, s] = m
        l_gmem[p, h, s] = l

    part = (num_splits, hkv, s_bucket, ROWS)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)),
        scratch_types=dict(
            q_smem=plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
            o_smem=plgpu.SMEM((ROWS, head_dim), jnp.float32),
            q_barrier=plgpu.Barrier(num_arrivals=1)),
        grid=(hkv, s_bucket, num_splits), grid_names=("h", "s", "p"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(q_packed, k_pages, v_pages, tables, lens)


def ragged_paged_attention_mosaic_gpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, page_size, Hkv, D]
    block_tables: jax.Array,  # [S, max_blocks] int32
    kv_lens: jax.Array,  # [S] int32
    cu_seqlens_q: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # scalar int32
    sm_scale: float,
    plan: gpu_plan_lib.GpuPlan,
) -> jax.Array:  # [T, Hq, D]
    """Decode-only batches (every chunk has at most one query row)."""
    t, hq, d = q.shape
    s_bucket = block_tables.shape[0]
    hkv = k_pages.shape[2]
    g = hq // hkv
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [S]
    live = (jnp.arange(s_bucket) < num_seqs) & (q_lens == 1)
    rows = jnp.clip(cu_seqlens_q[:-1], 0, t - 1)  # [S] each sequence's query row
    q_seq = jnp.where(live[:, None, None], q[rows], 0).reshape(s_bucket, hkv, g, d)
    q_packed = jnp.pad(q_seq, ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))  # [S, Hkv, 64, D]
    lens = jnp.where(live, kv_lens, 0).astype(jnp.int32)
    o, m, l = _launch(q_packed, k_pages, v_pages, block_tables.astype(jnp.int32), lens,
                      num_splits=plan.num_splits, sm_scale=sm_scale)
    out = gpu_plan_lib.combine_splits(o, m, l)  # [Hkv, S, 64, D]
    out = out[:, :, :g].transpose(1, 0, 2, 3).reshape(s_bucket, hq, d).astype(q.dtype)
    full = jnp.zeros((t, hq, d), q.dtype).at[jnp.where(live, rows, t)].set(out, mode="drop")
    return gpu_plan_lib.padding_rows_to_zero(full, cu_seqlens_q, num_seqs)
