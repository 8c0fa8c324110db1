"""Ragged paged latent attention (MLA, absorbed) as one Pallas kernel for NVIDIA GPUs.

The paged attention kernel's plan (`gpu_plan.py`) with the latent as the one KV "head":
query heads are cut into blocks of `block_h` (a power of two dividing Hq), and each head
block plays the part of a KV head of GQA group `block_h`, so `gpu_plan.pack_queries`,
`split_sequences`, `combine_splits`, `scatter_split_rows` and `unpack_output` serve
unchanged. Dataflow:

    1. `plan.tile_metadata` / `plan.longest_first`: query tiles of one sequence each (its
       own first position: decode rows and prefill chunks mix in one launch).
    2. `pack_queries`: q_latent and q_rope as `[Hq / block_h, rows_total, D]`; a program's
       M rows are `block_q` tokens x `block_h` heads.
    3. One `pallas_call` over `(Hq / block_h, num_splits, num_tiles)`: each program loads
       its M query rows once and walks its key steps (`block_k` keys, whole pages) with
       an online softmax in base 2: `s = q_lat @ c^T + q_rope @ pe^T` (two dots, so the
       576-wide DeepSeek key never needs a non-power-of-two tile), `acc += p @ c`. Steps
       below the tile's first position need no mask; the causal diagonal is masked.
       Every head block reads the same latent pages (from L2 after the first).
    4. Decode rows (`split_sequences`) split their keys across programs; XLA combines the
       partials; padding rows are zeroed.

Runs on the CPU with `interpret=True`; lowers for CUDA on the CPU (`lowering.lower_for_cuda`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_plan as gpu_plan_lib
from pallas_kernels import plan as plan_lib
from pallas_kernels.mla_inputs import MLAInputs
from pallas_kernels.pallas_gpu import LOG2E, MASK_VALUE, dot_precision

MAX_BLOCK_H = 16  # heads per program: M rows x Dl accumulators stay in registers
ACC_BUDGET = 16 * 512  # M x Dl float32 accumulator elements per program (32 KiB)


def head_block(num_heads: int) -> int:
    """Query heads per program: the largest power of two <= MAX_BLOCK_H dividing Hq."""
    b = 1
    while b * 2 <= MAX_BLOCK_H and num_heads % (b * 2) == 0:
        b *= 2
    return b


def make_mla_plan(inputs: MLAInputs, **tuning) -> gpu_plan_lib.GpuPlan:
    """The launch plan for `inputs`' shapes: head blocks as KV heads, M x Dl accumulators
    within `ACC_BUDGET`, 32-key steps (16 for Dl > 256 in float32); `tuning` overrides
    `gpu_plan.make_gpu_plan`'s block_m, block_k, num_splits, num_warps, num_stages."""
    bh = head_block(inputs.num_heads)
    itemsize = jnp.dtype(inputs.q_latent.dtype).itemsize
    defaults = dict(block_m=max(gpu_plan_lib.MIN_DOT, min(64, ACC_BUDGET // inputs.latent_dim)),
                    block_k=16 if itemsize > 2 and inputs.latent_dim > 256 else 32,
                    num_stages=2)
    return gpu_plan_lib.make_gpu_plan(
        num_tokens=inputs.num_tokens, num_seqs=inputs.seq_bucket, num_heads=inputs.num_heads,
        num_kv_heads=inputs.num_heads // bh, head_dim=inputs.latent_dim,
        page_size=inputs.block_size, max_blocks=inputs.max_blocks, max_q_len=inputs.max_q_len,
        itemsize=itemsize, **(defaults | tuning))


def _mla_kernel(seq_ref, q_start_ref, q_end_ref, first_pos_ref, kv_len_ref, split_ref,
                num_live_ref,  # tile metadata, each [W] int32; live count [1]
                tables_ref,  # [S, cols] int32 page ids
                ql_ref,  # [rows_total, Dl] packed latent queries of this head block
                qr_ref,  # [rows_total, Dr] packed rope queries
                c_ref,  # [num_blocks, page_size, Dl] latent pages
                pe_ref,  # [num_blocks, page_size, Dr] rope key pages
                *out_refs,  # o [rows_total, Dl]; with splits o, m, l partials
                plan: gpu_plan_lib.GpuPlan, sm_scale: float, precision):
    tiles = plan.tiles
    rows, group, bk, pps = plan.rows, plan.group, tiles.block_k, tiles.pages_per_step
    dl, dr = ql_ref.shape[-1], qr_ref.shape[-1]
    split, w = pl.program_id(1), pl.program_id(2)
    live = w < num_live_ref[0]
    seq, q_start = seq_ref[w], q_start_ref[w]
    first_pos, kv_len = first_pos_ref[w], kv_len_ref[w]
    n_rows = jnp.where(live, jnp.clip(q_end_ref[w] - q_start, 0, tiles.block_q), 0)
    is_split = split_ref[w] == 1
    ways = 1 + (plan.num_splits - 1) * split_ref[w]
    unmasked, total = plan_lib.kv_steps(tiles, first_pos, n_rows)
    per_split = plan_lib.cdiv(total, ways)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, total)
    has_work = live & (is_split | (split == 0))

    @pl.when(has_work)
    def _():
        token = jnp.arange(rows) // group  # [M]
        row_ok = token < n_rows
        pos = first_pos + token  # [M]
        ql = ql_ref[pl.ds(q_start * group, rows), :]  # [M, Dl]
        qr = qr_ref[pl.ds(q_start * group, rows), :]  # [M, Dr]
        last_step = tables_ref.shape[1] // pps - 1

        def page_ids(i):  # [pps], clamped: past the end is never read
            return tables_ref[seq, pl.ds(jnp.minimum(i, last_step) * pps, pps)]

        def step(i, carry, *, masked: bool):
            m, l, acc, pages = carry  # [M], [M], [M, Dl] float32, [pps]
            next_pages = page_ids(i + 1)
            c = c_ref[pages].reshape(bk, dl).astype(ql.dtype)  # [bk, Dl]
            pe = pe_ref[pages].reshape(bk, dr).astype(qr.dtype)  # [bk, Dr]
            s = (plgpu.dot(ql, c, trans_b=True, precision=precision).astype(jnp.float32)
                 + plgpu.dot(qr, pe, trans_b=True, precision=precision).astype(jnp.float32))
            s = s * (sm_scale * LOG2E)  # [M, bk] base 2
            if masked:
                keys = i * bk + jnp.arange(bk)
                ok = (keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_len)
                s = jnp.where(ok, s, MASK_VALUE)
                c = jnp.where((keys < kv_len)[:, None], c, jnp.zeros_like(c))  # NaN out
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            if masked:
                p = jnp.where(ok, p, 0.0)
            l = alpha * l + jnp.sum(p, axis=1)
            pv = plgpu.dot(p.astype(c.dtype), c, precision=precision)  # [M, Dl]
            return m_new, l, acc * alpha[:, None] + pv.astype(jnp.float32), next_pages

        mid = jnp.clip(unmasked, lo, hi)  # [lo, mid) unmasked, [mid, hi) the diagonal
        carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
                 jnp.zeros((rows, dl), jnp.float32), page_ids(lo))
        carry = jax.lax.fori_loop(lo, mid, functools.partial(step, masked=False), carry)
        m, l, acc, _ = jax.lax.fori_loop(mid, hi, functools.partial(step, masked=True), carry)

        col_ok = (jnp.arange(dl) < dl)[None, :]
        o_ref = out_refs[0]
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[pl.ds(q_start * group, rows), :], o.astype(o_ref.dtype),
                    mask=(row_ok & ~is_split)[:, None] & col_ok)
        if plan.num_splits > 1:
            _, op_ref, mp_ref, lp_ref = out_refs
            slot = pl.ds(seq * plan.split_rows, rows)
            part_ok = row_ok & is_split
            plgpu.store(op_ref.at[slot, :], acc, mask=part_ok[:, None] & col_ok)
            plgpu.store(mp_ref.at[slot], m, mask=part_ok)
            plgpu.store(lp_ref.at[slot], l, mask=part_ok)


def mla_attention_pallas_gpu(inputs: MLAInputs, plan: gpu_plan_lib.GpuPlan, *,
                             interpret: bool = False) -> jax.Array:  # [T, Hq, Dl]
    """See `pallas_kernels.mla.ragged_paged_mla`; `plan` from `make_mla_plan`."""
    q_lat, q_rope, cu, num_seqs = (inputs.q_latent, inputs.q_rope, inputs.cu_seqlens_q,
                                   inputs.num_seqs)
    t, hq, dl = q_lat.shape
    dr = q_rope.shape[2]
    num_blocks, page_size = inputs.latent_pages.shape[:2]
    hb = hq // plan.group  # head blocks: the grid's "KV heads"
    meta = plan_lib.longest_first(
        plan.tiles, plan_lib.tile_metadata(plan.tiles, inputs.kv_lens, cu, num_seqs))
    split = gpu_plan_lib.split_sequences(plan, cu, num_seqs)  # [S]
    is_split = split[meta.seq] & (jnp.arange(plan.tiles.num_tiles) < meta.num_live)
    pad = (-inputs.max_blocks) % plan.tiles.pages_per_step
    tables = jnp.pad(jnp.clip(inputs.block_tables, 0, num_blocks - 1), ((0, 0), (0, pad)))
    ql = gpu_plan_lib.pack_queries(q_lat, plan, hb)  # [Hb, rows_total, Dl]
    qr = gpu_plan_lib.pack_queries(q_rope, plan, hb)  # [Hb, rows_total, Dr]
    rows_total = ql.shape[1]

    def whole(x):
        return pl.BlockSpec(x.shape, lambda h, p, w: (0,) * x.ndim)

    metadata = (meta.seq, meta.q_start, meta.q_end, meta.first_pos, meta.kv_len,
                is_split.astype(jnp.int32), meta.num_live.reshape(1))
    in_specs = [whole(x) for x in metadata] + [
        whole(tables),
        pl.BlockSpec((None, rows_total, dl), lambda h, p, w: (h, 0, 0)),
        pl.BlockSpec((None, rows_total, dr), lambda h, p, w: (h, 0, 0)),
        pl.BlockSpec((num_blocks, page_size, dl), lambda h, p, w: (0, 0, 0)),
        pl.BlockSpec((num_blocks, page_size, dr), lambda h, p, w: (0, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((hb, rows_total, dl), q_lat.dtype)]
    out_specs = [pl.BlockSpec((None, rows_total, dl), lambda h, p, w: (h, 0, 0))]
    if plan.num_splits > 1:
        split_total = inputs.seq_bucket * plan.split_rows + plan.rows
        part = (plan.num_splits, hb, split_total)
        out_shape += [jax.ShapeDtypeStruct(part + (dl,), jnp.float32),
                      jax.ShapeDtypeStruct(part, jnp.float32),
                      jax.ShapeDtypeStruct(part, jnp.float32)]
        out_specs += [pl.BlockSpec((None, None, split_total, dl), lambda h, p, w: (p, h, 0, 0)),
                      pl.BlockSpec((None, None, split_total), lambda h, p, w: (p, h, 0)),
                      pl.BlockSpec((None, None, split_total), lambda h, p, w: (p, h, 0))]
    kernel = functools.partial(_mla_kernel, plan=plan, sm_scale=inputs.sm_scale,
                               precision=dot_precision(q_lat.dtype, interpret=interpret))
    outs = pl.pallas_call(
        kernel, grid=(hb, plan.num_splits, plan.tiles.num_tiles), in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret, name="ragged_paged_mla",
    )(*metadata, tables, ql, qr, inputs.latent_pages, inputs.rope_pages)
    out = gpu_plan_lib.unpack_output(outs[0], t, hq)  # [T, Hq, Dl]
    if plan.num_splits > 1:
        combined = gpu_plan_lib.combine_splits(*outs[1:])  # [Hb, split_total, Dl]
        out = gpu_plan_lib.scatter_split_rows(out, combined, plan, cu, split)
    return gpu_plan_lib.padding_rows_to_zero(out, cu, num_seqs)
