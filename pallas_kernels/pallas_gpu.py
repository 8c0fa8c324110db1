"""Ragged paged attention as one Pallas kernel for NVIDIA GPUs (Triton lowering).

Dataflow:
    1. `plan.tile_metadata` (XLA, tiny) assigns query tiles to sequences.
    2. `gpu_plan.pack_queries` lays q out so that a tile's tokens x query heads
       of one KV head are `rows` contiguous rows (GQA heads packed into M).
    3. One `pallas_call` over the grid `(num_tiles, Hkv, num_splits)`: each
       program loads its query rows once, then walks its key steps with an
       online softmax (base 2). Key steps below the tile's first position need
       no mask; steps on the causal diagonal are masked with `where` on scores
       and values; steps past the tile's last position are never visited. Each
       step reads page ids from the block table and gathers those pages.
    4. With `num_splits > 1` (decode-only batches), programs write unnormalized
       partials that XLA combines; otherwise they write the final rows.
    5. Padding rows (never written) are set to zero.

Only step 3 depends on the Triton lowering; steps 1, 2, 4, 5 and the grid
live in `plan.py` / `gpu_plan.py` for a future Mosaic GPU kernel to share.
Runs on CPU with `interpret=True` for tests.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_plan as gpu_plan_lib
from pallas_kernels import plan as plan_lib

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: masked-row max stays finite
LOG2E = math.log2(math.e)


def _attention_kernel(
    # Tile metadata, each [W] int32, and the live-tile count [1].
    seq_ref, q_start_ref, q_end_ref, first_pos_ref, kv_len_ref, num_live_ref,
    tables_ref,  # [S, cols] int32 page ids
    q_ref,  # [rows_total, D] packed queries of this KV head
    k_ref,  # [num_blocks, page_size, D] this KV head's key pages
    v_ref,  # [num_blocks, page_size, D]
    *out_refs,  # final: o [rows_total, D]; split: o [rows_total, D], m, l [rows_total]
    plan: gpu_plan_lib.GpuPlan,
    scale: float,  # sm_scale * log2(e)
):
    tiles = plan.tiles
    rows, group, bk, pps = plan.rows, plan.group, tiles.block_k, tiles.pages_per_step
    head_dim = q_ref.shape[-1]
    w, split = pl.program_id(0), pl.program_id(2)

    live = w < num_live_ref[0]
    seq, q_start = seq_ref[w], q_start_ref[w]
    first_pos, kv_len = first_pos_ref[w], kv_len_ref[w]
    n_rows = jnp.where(live, jnp.clip(q_end_ref[w] - q_start, 0, tiles.block_q), 0)
    unmasked, total = plan_lib.kv_steps(tiles, first_pos, n_rows)
    per_split = plan_lib.cdiv(total, plan.num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, total)

    token = jnp.arange(rows) // group  # [M] token offset of each packed row
    row_ok = token < n_rows  # [M]
    pos = first_pos + token  # [M] absolute position of each row
    q = q_ref[pl.ds(q_start * group, rows), :]  # [M, D]

    def step(i, carry, *, masked: bool):
        m, l, acc = carry  # [M], [M], [M, D] float32
        pages = tables_ref[seq, pl.ds(i * pps, pps)]  # [pps]
        k = k_ref[pages].reshape(bk, head_dim)  # [bk, D]
        v = v_ref[pages].reshape(bk, head_dim)  # [bk, D]
        s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * scale  # [M, bk]
        if masked:
            keys = i * bk + jnp.arange(bk)  # [bk]
            ok = (keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_len)  # [M, bk]
            s = jnp.where(ok, s, MASK_VALUE)
            v = jnp.where((keys < kv_len)[:, None], v, jnp.zeros_like(v))  # NaN pages stay out
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(ok, p, 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return m_new, l, acc

    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    carry = jax.lax.fori_loop(lo, jnp.minimum(hi, unmasked),
                              functools.partial(step, masked=False), carry)
    carry = jax.lax.fori_loop(jnp.maximum(lo, unmasked), hi,
                              functools.partial(step, masked=True), carry)
    m, l, acc = carry

    out_rows = pl.ds(q_start * group, rows)
    mask_2d = row_ok[:, None] & (jnp.arange(head_dim) < head_dim)[None, :]  # [M, D]
    if plan.num_splits == 1:
        (o_ref,) = out_refs
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[out_rows, :], o.astype(o_ref.dtype), mask=mask_2d)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[out_rows, :], acc, mask=mask_2d)
        plgpu.store(m_ref.at[out_rows], m, mask=row_ok)
        plgpu.store(l_ref.at[out_rows], l, mask=row_ok)


def _launch(meta, tables, q_packed, k_pages, v_pages, *, plan: gpu_plan_lib.GpuPlan,
            sm_scale: float, interpret: bool):
    num_blocks, page_size, hkv, head_dim = k_pages.shape
    rows_total = q_packed.shape[1]
    grid = (plan.tiles.num_tiles, hkv, plan.num_splits)

    def whole(x):  # the whole (small) array in every program
        return pl.BlockSpec(x.shape, lambda w, h, p: (0,) * x.ndim)

    metadata = (meta.seq, meta.q_start, meta.q_end, meta.first_pos, meta.kv_len,
                meta.num_live.reshape(1))
    in_specs = [whole(x) for x in metadata] + [
        whole(tables),
        pl.BlockSpec((None, rows_total, head_dim), lambda w, h, p: (h, 0, 0)),
        pl.BlockSpec((num_blocks, page_size, None, head_dim), lambda w, h, p: (0, 0, h, 0)),
        pl.BlockSpec((num_blocks, page_size, None, head_dim), lambda w, h, p: (0, 0, h, 0)),
    ]
    if plan.num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((hkv, rows_total, head_dim), q_packed.dtype)]
        out_specs = [pl.BlockSpec((None, rows_total, head_dim), lambda w, h, p: (h, 0, 0))]
    else:
        split_shape = (plan.num_splits, hkv, rows_total)
        out_shape = [jax.ShapeDtypeStruct(split_shape + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, rows_total, head_dim), lambda w, h, p: (p, h, 0, 0)),
                     pl.BlockSpec((None, None, rows_total), lambda w, h, p: (p, h, 0)),
                     pl.BlockSpec((None, None, rows_total), lambda w, h, p: (p, h, 0))]
    kernel = functools.partial(_attention_kernel, plan=plan, scale=sm_scale * LOG2E)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret, name="ragged_paged_attention",
    )(*metadata, tables, q_packed, k_pages, v_pages)


def ragged_paged_attention_pallas_gpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, page_size, Hkv, D]
    block_tables: jax.Array,  # [S, max_blocks] int32
    kv_lens: jax.Array,  # [S] int32
    cu_seqlens_q: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # scalar int32
    sm_scale: float,
    plan: gpu_plan_lib.GpuPlan,
    *,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    t, hq, _ = q.shape
    num_blocks, _, hkv, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    meta = plan_lib.tile_metadata(plan.tiles, kv_lens, cu_seqlens_q, num_seqs)
    pad = (-max_blocks) % plan.tiles.pages_per_step
    # Entries past a sequence's pages may hold anything: clip them in bounds.
    tables = jnp.pad(jnp.clip(block_tables, 0, num_blocks - 1), ((0, 0), (0, pad)))
    q_packed = gpu_plan_lib.pack_queries(q, plan, hkv)  # [Hkv, rows_total, D]
    outs = _launch(meta, tables, q_packed, k_pages, v_pages, plan=plan, sm_scale=sm_scale,
                   interpret=interpret)
    if plan.num_splits == 1:
        o = outs[0]
    else:
        o = gpu_plan_lib.combine_splits(*outs)
    out = gpu_plan_lib.unpack_output(o.astype(q.dtype), t, hq)
    return gpu_plan_lib.padding_rows_to_zero(out, cu_seqlens_q, num_seqs)
