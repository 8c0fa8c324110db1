"""Ragged paged attention as one Pallas kernel for NVIDIA GPUs (Triton lowering).

Dataflow:
    1. `plan.tile_metadata` (XLA, tiny) assigns query tiles to sequences;
       `plan.longest_first` orders them by key steps, most first.
    2. `gpu_plan.pack_queries` lays q out so that a tile's tokens x query heads
       of one KV head are `rows` contiguous rows (GQA heads packed into M).
    3. One `pallas_call` over the grid `(Hkv, num_splits, num_tiles)`: each
       program loads its query rows once, then walks its key steps with an
       online softmax (base 2). Key steps below the tile's first position need
       no mask; steps on the causal diagonal are masked with `where` on scores
       and values; steps past the tile's last position are never visited. Under
       a sliding window, steps wholly before the first row's window are never
       visited either (prefill and decode tiles alike), steps on the window's
       left edge are masked like the diagonal, and scores may be soft-capped
       (`cap * tanh(s / cap)`, Gemma 2). The page ids of step i+1 are read
       during step i, so Triton's pipeliner can keep the next K/V loads in
       flight while a step computes.
    4. Decode rows (`gpu_plan.split_sequences`, with `num_splits > 1`) split
       their keys across programs, which write unnormalized partials that XLA
       combines and scatters into place; every other tile writes final rows.
    5. Padding rows (never written) are set to zero.

Batch-invariant plans (`gpu_plan.make_gpu_plan(batch_invariant=True)`, one plan for every
bucket, no split-K) walk every key step with the masked body: a row's scores and sums are
then computed by the same program, over the same key blocks (aligned to absolute
positions), whatever its chunk, its tile or its bucket holds. A step a row cannot see is an
exact no-op of the online softmax (its p are exact zeros; alpha is 1, or 0 before any key).

Attention sinks (`sinks`, gpt-oss): each packed row's sink logit (base 2) is one more term
of the final denominator, `l * 2**(m - top) + 2**(sink - top)` with `top = max(m, sink)`;
a split row's partials take it once, in the combine (`gpu_plan.combine_splits`).

Quantized pages (float8_e4m3fn, `k_scale`/`v_scale`): each step upcasts the loaded K/V
tile to q's dtype (exact: e4m3 values are bf16 values); `k_scale` folds into the score
scale and `v_scale` multiplies the accumulator before it is written, so no scaled copy
of a page is ever made.

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
from pallas_kernels.attention_inputs import AttentionInputs

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: masked-row max stays finite
LOG2E = math.log2(math.e)


def dot_precision(dtype, *, interpret: bool):
    """The precision rule: float32 inputs never take plain TF32 dots.

    Plain TF32 keeps 10 mantissa bits (~3e-4 relative error on these scores, 15x the
    2e-5 float32 tolerance of the oracle tests), so a float32 cache would silently be
    less accurate than the reference it is tested against. On the GPU, float32 dots
    use 3xTF32 (each operand split into a TF32 high part and a TF32 remainder, three
    tensor-core products: about float32 accuracy, ~3x the tensor-core time of bf16);
    exact float32 FMA dots spill heavily at these tiles (gpu_compile_report.py). In
    interpret mode (CPU, which has no TF32) they are exact float32. bf16/fp16 inputs
    keep the default: tensor cores, float32 accumulation.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return None
    return jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _attention_kernel(
    # Tile metadata, each [W] int32 (split: 1 for a split sequence's tile), live count [1].
    seq_ref, q_start_ref, q_end_ref, first_pos_ref, kv_len_ref, split_ref, num_live_ref,
    window_ref,  # [1] int32 sliding window (read only when `windowed`)
    tables_ref,  # [S, cols] int32 page ids
    scales_ref,  # [2] float32: k_scale, v_scale (1.0 for plain pages)
    sinks_ref,  # [rows] float32 base-2 sink logit of each packed row (read only with sinks)
    q_ref,  # [rows_total, D] packed queries of this KV head
    k_ref,  # [num_blocks, page_size, D] this KV head's key pages
    v_ref,  # [num_blocks, page_size, D]
    *out_refs,  # o [rows_total, D]; with splits also o, m, l partials [split_total(, D)]
    plan: gpu_plan_lib.GpuPlan,
    sm_scale: float,
    precision,  # dot_precision of the inputs
    windowed: bool,
    softcap: float | None,
    has_sinks: bool,
):
    tiles = plan.tiles
    rows, group, bk, pps = plan.rows, plan.group, tiles.block_k, tiles.pages_per_step
    head_dim = q_ref.shape[-1]
    split, w = pl.program_id(1), pl.program_id(2)
    # natural-log score scale (the pages hold k / k_scale), and v's
    score_scale, v_scale = sm_scale * scales_ref[0], scales_ref[1]

    live = w < num_live_ref[0]
    seq, q_start = seq_ref[w], q_start_ref[w]
    first_pos, kv_len = first_pos_ref[w], kv_len_ref[w]
    n_rows = jnp.where(live, jnp.clip(q_end_ref[w] - q_start, 0, tiles.block_q), 0)
    is_split = split_ref[w] == 1
    ways = 1 + (plan.num_splits - 1) * split_ref[w]  # splits of this tile's keys
    unmasked, total = plan_lib.kv_steps(tiles, first_pos, n_rows)
    window = window_ref[0] if windowed else None
    start = jnp.minimum(plan_lib.window_start(tiles, first_pos, window), total)
    full = plan_lib.window_full_start(tiles, first_pos, n_rows, window)
    per_split = plan_lib.cdiv(total - start, ways)
    lo = start + split * per_split
    hi = jnp.minimum(lo + per_split, total)
    # A split tile's every program writes its partial (empty ones too: the combine
    # reads them); other tiles run whole in program 0; idle tiles do nothing.
    has_work = live & (is_split | (split == 0))

    @pl.when(has_work)
    def _():
        token = jnp.arange(rows) // group  # [M] token offset of each packed row
        row_ok = token < n_rows  # [M]
        pos = first_pos + token  # [M] absolute position of each row
        q = q_ref[pl.ds(q_start * group, rows), :]  # [M, D]
        last_step = tables_ref.shape[1] // pps - 1  # table columns are padded to whole steps

        def page_ids(i):  # [pps] pages of key step i (clamped: past the end is never read)
            return tables_ref[seq, pl.ds(jnp.minimum(i, last_step) * pps, pps)]

        def step(i, carry, *, masked: bool):
            # NOTE: `pages` arrives from the previous step, so this step's K/V loads do
            # not wait behind a table load, and the next ids load while this step runs.
            m, l, acc, pages = carry  # [M], [M], [M, D] float32, [pps] int32
            next_pages = page_ids(i + 1)
            k = k_ref[pages].reshape(bk, head_dim).astype(q.dtype)  # [bk, D] (FP8 upcast)
            v = v_ref[pages].reshape(bk, head_dim).astype(q.dtype)  # [bk, D]
            s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32)
            if softcap is None:
                s = s * (score_scale * LOG2E)
            else:  # cap * tanh(s / cap) on natural-log scores, then to base 2
                s = jnp.tanh(s * (score_scale / softcap)) * (softcap * LOG2E)
            if masked:
                keys = i * bk + jnp.arange(bk)  # [bk]
                ok = (keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_len)  # [M, bk]
                readable = keys < kv_len  # [bk] keys some row may see
                if windowed:  # and not older than each row's window (row 0's for values)
                    ok = ok & (keys[None, :] > pos[:, None] - window)
                    readable = readable & (keys > first_pos - window)
                s = jnp.where(ok, s, MASK_VALUE)
                v = jnp.where(readable[:, None], v, jnp.zeros_like(v))  # NaN pages out
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            if masked:
                p = jnp.where(ok, p, 0.0)
            l = alpha * l + jnp.sum(p, axis=1)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [M, D]
            acc = acc * alpha[:, None] + pv.astype(jnp.float32)
            return m_new, l, acc, next_pages

        # [lo, m1) masked (the window's left edge), [m1, m2) unmasked, [m2, hi) masked
        # (the causal diagonal): consecutive ranges, so the carried page ids fit each.
        # A batch-invariant plan runs every step masked: [lo, hi) in one body.
        m1 = lo if plan.all_masked else jnp.clip(full, lo, hi)
        m2 = lo if plan.all_masked else jnp.clip(unmasked, m1, hi)
        carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
                 jnp.zeros((rows, head_dim), jnp.float32), page_ids(lo))
        if windowed:
            carry = jax.lax.fori_loop(lo, m1, functools.partial(step, masked=True), carry)
        carry = jax.lax.fori_loop(m1, m2, functools.partial(step, masked=False), carry)
        carry = jax.lax.fori_loop(m2, hi, functools.partial(step, masked=True), carry)
        m, l, acc, _ = carry
        acc = acc * v_scale  # the pages hold v / v_scale

        col_ok = (jnp.arange(head_dim) < head_dim)[None, :]  # [1, D] broadcasts masks
        final_ok = row_ok & ~is_split
        o_ref = out_refs[0]
        if has_sinks:  # one more denominator term: 2**sink, no value
            sink = sinks_ref[...]  # [M]
            top = jnp.maximum(m, sink)
            rescale = jnp.exp2(m - top)
            o = acc * (rescale / (l * rescale + jnp.exp2(sink - top)))[:, None]
        else:
            o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[pl.ds(q_start * group, rows), :], o.astype(o_ref.dtype),
                    mask=final_ok[:, None] & col_ok)
        if plan.num_splits > 1:
            _, op_ref, mp_ref, lp_ref = out_refs
            slot = pl.ds(seq * plan.split_rows, rows)
            part_ok = row_ok & is_split
            plgpu.store(op_ref.at[slot, :], acc, mask=part_ok[:, None] & col_ok)
            plgpu.store(mp_ref.at[slot], m, mask=part_ok)
            plgpu.store(lp_ref.at[slot], l, mask=part_ok)


def _launch(meta, is_split, window, tables, scales, sinks, q_packed, k_pages, v_pages, *,
            plan: gpu_plan_lib.GpuPlan, sm_scale: float, softcap: float | None,
            has_sinks: bool, interpret: bool):
    num_blocks, page_size, hkv, head_dim = k_pages.shape
    rows_total = q_packed.shape[1]
    grid = (hkv, plan.num_splits, plan.tiles.num_tiles)

    def whole(x):  # the whole (small) array in every program
        return pl.BlockSpec(x.shape, lambda h, p, w: (0,) * x.ndim)

    windowed = window is not None
    metadata = (meta.seq, meta.q_start, meta.q_end, meta.first_pos, meta.kv_len,
                is_split.astype(jnp.int32), meta.num_live.reshape(1),
                (window if windowed else jnp.int32(0)).reshape(1))
    in_specs = [whole(x) for x in metadata] + [
        whole(tables), whole(scales),
        pl.BlockSpec((None, plan.rows), lambda h, p, w: (h, 0)),
        pl.BlockSpec((None, rows_total, head_dim), lambda h, p, w: (h, 0, 0)),
        pl.BlockSpec((num_blocks, page_size, None, head_dim), lambda h, p, w: (0, 0, h, 0)),
        pl.BlockSpec((num_blocks, page_size, None, head_dim), lambda h, p, w: (0, 0, h, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((hkv, rows_total, head_dim), q_packed.dtype)]
    out_specs = [pl.BlockSpec((None, rows_total, head_dim), lambda h, p, w: (h, 0, 0))]
    if plan.num_splits > 1:
        # One slot of split_rows per sequence, plus `rows` so every store window fits.
        split_total = tables.shape[0] * plan.split_rows + plan.rows
        split_shape = (plan.num_splits, hkv, split_total)
        out_shape += [jax.ShapeDtypeStruct(split_shape + (head_dim,), jnp.float32),
                      jax.ShapeDtypeStruct(split_shape, jnp.float32),
                      jax.ShapeDtypeStruct(split_shape, jnp.float32)]
        out_specs += [
            pl.BlockSpec((None, None, split_total, head_dim), lambda h, p, w: (p, h, 0, 0)),
            pl.BlockSpec((None, None, split_total), lambda h, p, w: (p, h, 0)),
            pl.BlockSpec((None, None, split_total), lambda h, p, w: (p, h, 0))]
    kernel = functools.partial(_attention_kernel, plan=plan, sm_scale=sm_scale,
                               precision=dot_precision(q_packed.dtype, interpret=interpret),
                               windowed=windowed, softcap=softcap, has_sinks=has_sinks)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret, name="ragged_paged_attention",
    )(*metadata, tables, scales, sinks, q_packed, k_pages, v_pages)


def ragged_paged_attention_pallas_gpu(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan, *,
                                      interpret: bool = False) -> jax.Array:  # [T, Hq, D]
    """See `pallas_kernels.ragged_paged_attention`; `plan` from `gpu_plan.make_gpu_plan`.
    Pages may be float8_e4m3fn with `inputs.k_scale` / `v_scale` (pages hold k / k_scale)."""
    q, k_pages, v_pages = inputs.q, inputs.k_pages, inputs.v_pages
    cu_seqlens_q, num_seqs, window = inputs.cu_seqlens_q, inputs.num_seqs, inputs.sliding_window
    t, hq, _ = q.shape
    num_blocks, _, hkv, _ = k_pages.shape
    meta = plan_lib.tile_metadata(plan.tiles, inputs.kv_lens, cu_seqlens_q, num_seqs)
    meta = plan_lib.longest_first(plan.tiles, meta, window)
    split = gpu_plan_lib.split_sequences(plan, cu_seqlens_q, num_seqs)  # [S]
    is_split = split[meta.seq] & (jnp.arange(plan.tiles.num_tiles) < meta.num_live)  # [W]
    pad = (-inputs.max_blocks) % plan.tiles.pages_per_step
    # Entries past a sequence's pages may hold anything: clip them in bounds.
    tables = jnp.pad(jnp.clip(inputs.block_tables, 0, num_blocks - 1), ((0, 0), (0, pad)))
    q_packed = gpu_plan_lib.pack_queries(q, plan, hkv)  # [Hkv, rows_total, D]
    one = jnp.float32(1.0)
    scales = jnp.stack([one if inputs.k_scale is None else inputs.k_scale,
                        one if inputs.v_scale is None else inputs.v_scale])  # [2] float32
    has_sinks = inputs.sinks is not None
    sinks = gpu_plan_lib.packed_sinks(inputs.sinks, plan, hkv, plan.rows)  # [Hkv, M] base 2
    outs = _launch(meta, is_split, window, tables, scales, sinks, q_packed, k_pages, v_pages,
                   plan=plan, sm_scale=inputs.sm_scale, softcap=inputs.logit_softcap,
                   has_sinks=has_sinks, interpret=interpret)
    out = gpu_plan_lib.unpack_output(outs[0], t, hq)  # [T, Hq, D]
    if plan.num_splits > 1:
        split_sinks = None
        if has_sinks:  # [Hkv, split_total]: split slots start at multiples of the group
            split_sinks = gpu_plan_lib.packed_sinks(inputs.sinks, plan, hkv,
                                                    outs[2].shape[-1])
        combined = gpu_plan_lib.combine_splits(*outs[1:], sinks=split_sinks)
        out = gpu_plan_lib.scatter_split_rows(out, combined, plan, cu_seqlens_q, split)
    return gpu_plan_lib.padding_rows_to_zero(out, cu_seqlens_q, num_seqs)
