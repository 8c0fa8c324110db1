"""Ragged paged attention through the raw Triton kernel (`triton_kernel.py`).

Dataflow (steps 1, 4 and 5 are the Pallas kernel's, from `plan.py` / `gpu_plan.py`):
    1. `plan.tile_metadata` assigns query tiles to sequences, `plan.longest_first`
       orders them, `gpu_plan.split_sequences` marks the decode rows whose keys split.
    2. The metadata, the traced scalars (live tiles, window, k/v scales, sinks) and the arrays
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
from pallas_kernels.attention_inputs import AttentionInputs

KERNEL_NAME = "ragged_paged_attention_kernel"


def _precision(dtype) -> str | None:
    """The precision rule of `pallas_gpu.dot_precision`: float32 dots take 3xTF32 on the
    GPU (never plain TF32); Triton's interpreter computes them in float32 either way."""
    return "tf32x3" if jnp.dtype(dtype) == jnp.float32 else None


def _kernel_args(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan):
    """The kernel's array inputs before q/k/v: metadata, scalars, scales, tables."""
    cu_seqlens_q, num_seqs = inputs.cu_seqlens_q, inputs.num_seqs
    meta = plan_lib.tile_metadata(plan.tiles, inputs.kv_lens, cu_seqlens_q, num_seqs)
    meta = plan_lib.longest_first(plan.tiles, meta)
    split = gpu_plan_lib.split_sequences(plan, cu_seqlens_q, num_seqs)  # [S]
    is_split = split[meta.seq] & (jnp.arange(plan.tiles.num_tiles) < meta.num_live)  # [W]
    metadata = jnp.stack([meta.seq, meta.q_start, meta.q_end, meta.first_pos, meta.kv_len,
                          is_split.astype(jnp.int32)]).astype(jnp.int32)  # [6, W]
    window = 0 if inputs.sliding_window is None else inputs.sliding_window
    scalars = jnp.stack([jnp.asarray(meta.num_live, jnp.int32),
                         jnp.asarray(window, jnp.int32)])  # [2]
    k_scale = 1.0 if inputs.k_scale is None else inputs.k_scale
    v_scale = 1.0 if inputs.v_scale is None else inputs.v_scale
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32),
                        jnp.asarray(v_scale, jnp.float32)])  # [2]
    sinks = (jnp.zeros((inputs.num_heads,), jnp.float32) if inputs.sinks is None
             else inputs.sinks)  # [Hq]
    return (metadata, scalars, scales, sinks, inputs.block_tables), split


def launch_params(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan, *,
                  interpret: bool) -> dict:
    """The kernel's compile-time parameters (Triton constexprs) for one bucket; `inputs`
    may hold `jax.ShapeDtypeStruct`s (only shapes, dtypes and the settings are read)."""
    num_blocks, page_size, hkv, head_dim = inputs.k_pages.shape
    q, softcap = inputs.q, inputs.logit_softcap
    return dict(
        NUM_TILES=plan.tiles.num_tiles, BLOCK_Q=plan.tiles.block_q, GROUP=plan.group,
        Q_PER_KV=q.shape[1] // hkv, ROWS=plan.rows, BLOCK_K=plan.tiles.block_k,
        PAGE=page_size, COLS=inputs.max_blocks, NUM_BLOCKS=num_blocks, NUM_KV_HEADS=hkv,
        HEAD_DIM=head_dim, NUM_SPLITS=plan.num_splits, SPLIT_ROWS=plan.split_rows,
        SPLIT_TOTAL=split_total(plan, inputs.seq_bucket), SM_SCALE=float(inputs.sm_scale),
        HAS_WINDOW=inputs.sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        SOFTCAP=float(softcap or 0.0), PRECISION=_precision(q.dtype),
        INTERPRETED_DOTS=interpret,
        HAS_SINKS=inputs.sinks is not None, ALL_MASKED=plan.all_masked)


def split_total(plan: gpu_plan_lib.GpuPlan, num_seqs_bucket: int) -> int:
    """Rows per (split, KV head) of the partials: one slot of `split_rows` per sequence,
    plus `rows` so every store window of a program fits."""
    return num_seqs_bucket * plan.split_rows + plan.rows


def output_shapes(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan):
    """Final output, then split-K partials o, m, l (1-element dummies without splits)."""
    hkv, head_dim = inputs.num_kv_heads, inputs.head_dim
    if plan.num_splits > 1:
        part = (plan.num_splits, hkv, split_total(plan, inputs.seq_bucket))
    else:
        part = (1, 1, 1)
    return (jax.ShapeDtypeStruct(inputs.q.shape, inputs.q.dtype),
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


def ragged_paged_attention_triton(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan, *,
                                  interpret: bool = False) -> jax.Array:  # [T, Hq, D]
    """See `pallas_kernels.ragged_paged_attention`; `plan` from `gpu_plan.make_gpu_plan`."""
    head, split = _kernel_args(inputs, plan)
    arrays = head + (inputs.q, inputs.k_pages, inputs.v_pages)
    params = launch_params(inputs, plan, interpret=interpret)
    shapes = output_shapes(inputs, plan)
    grid_ = grid(inputs.k_pages, plan)
    if interpret:
        from pallas_kernels import triton_interpret

        outs = triton_interpret.launch(KERNEL_NAME, grid_, arrays, shapes, params)
    else:
        outs = _launch_jax_triton(arrays, shapes, grid_, params, plan)
    out = outs[0]
    if plan.num_splits > 1:
        sinks = None if inputs.sinks is None else gpu_plan_lib.packed_sinks(
            inputs.sinks, plan, inputs.num_kv_heads, outs[2].shape[-1])  # [Hkv, split_total]
        combined = gpu_plan_lib.combine_splits(*outs[1:], sinks=sinks)
        out = gpu_plan_lib.scatter_split_rows(out, combined, plan, inputs.cu_seqlens_q, split)
    return gpu_plan_lib.padding_rows_to_zero(out, inputs.cu_seqlens_q, inputs.num_seqs)
