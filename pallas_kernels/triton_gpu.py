"""Ragged paged attention through the raw Triton kernel (`triton_kernel.py`).

Dataflow (steps 1, 4 and 5 are the Pallas kernel's, from `plan.py` / `gpu_plan.py`):
    1. `plan.tile_metadata` assigns query tiles to sequences, `plan.longest_first`
       orders them, `gpu_plan.split_sequences` marks the decode rows whose keys split.
    2. The metadata, the traced scalars (live tiles, window, k/v scales) and the arrays
       go to one kernel launch over the grid `(Hkv, num_splits, num_tiles)`:
       - on a GPU, `jax_triton.triton_call` inside the jitted step (Triton compiles the
         kernel when the step is lowered; XLA launches it as a custom call);
       - with `interpret=True`, a host callback runs the same kernel in Triton's own
         interpreter (CPU tensors), `triton_interpret.launch`.
    3. The kernel reads q and the pages in place (no packing copies) and writes final
       rows into `[T, Hq, D]`, split rows' partials into their slots.
    4. Split partials are combined and scattered into place.
    5. Padding rows (never written) are set to zero.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_plan as gpu_plan_lib
from pallas_kernels import plan as plan_lib

KERNEL_NAME = "ragged_paged_attention_kernel"


def _precision(dtype) -> str | None:
    """The precision rule of `pallas_gpu.dot_precision`: float32 dots take 3xTF32 on the
    GPU (never plain TF32); Triton's interpreter computes them in float32 either way."""
    return "tf32x3" if jnp.dtype(dtype) == jnp.float32 else None


def _kernel_args(block_tables, kv_lens, cu_seqlens_q, num_seqs, plan, *, sliding_window,
                 k_scale, v_scale):
    """The kernel's array inputs before q/k/v: metadata, scalars, scales, tables."""
    meta = plan_lib.tile_metadata(plan.tiles, kv_lens, cu_seqlens_q, num_seqs)
    meta = plan_lib.longest_first(plan.tiles, meta)
    split = gpu_plan_lib.split_sequences(plan, cu_seqlens_q, num_seqs)  # [S]
    is_split = split[meta.seq] & (jnp.arange(plan.tiles.num_tiles) < meta.num_live)  # [W]
    metadata = jnp.stack([meta.seq, meta.q_start, meta.q_end, meta.first_pos, meta.kv_len,
                          is_split.astype(jnp.int32)]).astype(jnp.int32)  # [6, W]
    window = 0 if sliding_window is None else sliding_window
    scalars = jnp.stack([jnp.asarray(meta.num_live, jnp.int32),
                         jnp.asarray(window, jnp.int32)])  # [2]
    scales = jnp.stack([jnp.asarray(1.0 if k_scale is None else k_scale, jnp.float32),
                        jnp.asarray(1.0 if v_scale is None else v_scale, jnp.float32)])  # [2]
    return (metadata, scalars, scales, block_tables), split


def launch_params(q, k_pages, block_tables, plan: gpu_plan_lib.GpuPlan, *, sm_scale: float,
                  sliding_window, logit_softcap: float | None, interpret: bool) -> dict:
    """The kernel's compile-time parameters (Triton constexprs) for one bucket."""
    num_blocks, page_size, hkv, head_dim = k_pages.shape
    return dict(
        NUM_TILES=plan.tiles.num_tiles, BLOCK_Q=plan.tiles.block_q, GROUP=plan.group,
        Q_PER_KV=q.shape[1] // hkv, ROWS=plan.rows, BLOCK_K=plan.tiles.block_k,
        PAGE=page_size, COLS=block_tables.shape[1], NUM_BLOCKS=num_blocks, NUM_KV_HEADS=hkv,
        HEAD_DIM=head_dim, NUM_SPLITS=plan.num_splits, SPLIT_ROWS=plan.split_rows,
        SPLIT_TOTAL=split_total(plan, block_tables.shape[0]), SM_SCALE=float(sm_scale),
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap is not None,
        SOFTCAP=float(logit_softcap or 0.0), PRECISION=_precision(q.dtype),
        UPCAST_DOTS=interpret and jnp.dtype(q.dtype).itemsize < 4)


def split_total(plan: gpu_plan_lib.GpuPlan, num_seqs_bucket: int) -> int:
    """Rows per (split, KV head) of the partials: one slot of `split_rows` per sequence,
    plus `rows` so every store window of a program fits."""
    return num_seqs_bucket * plan.split_rows + plan.rows


def output_shapes(q, k_pages, block_tables, plan: gpu_plan_lib.GpuPlan):
    """Final output, then split-K partials o, m, l (1-element dummies without splits)."""
    hkv, head_dim = k_pages.shape[2], k_pages.shape[3]
    if plan.num_splits > 1:
        part = (plan.num_splits, hkv, split_total(plan, block_tables.shape[0]))
    else:
        part = (1, 1, 1)
    return (jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(part + ((head_dim,) if plan.num_splits > 1 else (1,)),
                                 jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32))


def grid(k_pages, plan: gpu_plan_lib.GpuPlan) -> tuple[int, int, int]:
    return (k_pages.shape[2], plan.num_splits, plan.tiles.num_tiles)


def _launch_jax_triton(arrays, out_shapes, grid_, params, plan):
    import jax_triton

    from pallas_kernels import triton_kernel

    # jax-triton 0.4 renamed out_shape (deprecated there) to out_type.
    out_kw = ("out_type" if "out_type" in inspect.signature(jax_triton.triton_call).parameters
              else "out_shape")
    return jax_triton.triton_call(
        *arrays, kernel=getattr(triton_kernel, KERNEL_NAME), grid=grid_,
        num_warps=plan.num_warps, num_stages=plan.num_stages, name="ragged_paged_attention",
        **{out_kw: out_shapes}, **params)


def ragged_paged_attention_triton(
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
    sliding_window: jax.Array | int | None = None,
    logit_softcap: float | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """See `pallas_kernels.ragged_paged_attention`; `plan` from `gpu_plan.make_gpu_plan`."""
    head, split = _kernel_args(block_tables, kv_lens, cu_seqlens_q, num_seqs, plan,
                               sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    arrays = head + (q, k_pages, v_pages)
    params = launch_params(q, k_pages, block_tables, plan, sm_scale=sm_scale,
                           sliding_window=sliding_window, logit_softcap=logit_softcap,
                           interpret=interpret)
    shapes = output_shapes(q, k_pages, block_tables, plan)
    if interpret:
        from pallas_kernels import triton_interpret

        outs = triton_interpret.launch(KERNEL_NAME, grid(k_pages, plan), arrays, shapes, params)
    else:
        outs = _launch_jax_triton(arrays, shapes, grid(k_pages, plan), params, plan)
    out = outs[0]
    if plan.num_splits > 1:
        combined = gpu_plan_lib.combine_splits(*outs[1:])  # [Hkv, split_total, D]
        out = gpu_plan_lib.scatter_split_rows(out, combined, plan, cu_seqlens_q, split)
    return gpu_plan_lib.padding_rows_to_zero(out, cu_seqlens_q, num_seqs)
