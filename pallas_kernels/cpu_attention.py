"""Ragged paged attention as a compiled CPU kernel (`cpu_attention.cc`, an XLA FFI call).

Dataflow:
    1. `cpu_build.kernels_unavailable()` builds the kernel once per machine (the C++
       sources compiled with the machine's compiler into a per-user cache, loaded,
       registered as FFI targets). A machine without a compiler, or a failed build, gets
       a reason (the xla path runs instead).
    2. `ragged_paged_attention_cpu(inputs)` hands one call's arrays to the kernel: q as
       float32, the pages as they are stored (float32, bfloat16, float16, or 8-bit with
       their value table), the options as small arrays (the window and scales may be
       traced).
    3. The kernel splits the rows over XLA's intra-op thread pool (both cores of a
       2-core machine), walks each row's visible keys in groups of at most 16 aligned to
       the pages and writes float32 rows (padding rows zero); the output is cast back to
       q's dtype here.
    `write_kv_cpu` is the step's other half on the CPU: this step's keys and values
    copied into their slots in place (the pages aliased with the result).

Why a kernel of its own: XLA:CPU runs the xla path's tile loops on one core with a few
microseconds of dispatch per op, so a 32-row decode step spent most of its attention time
between ops, and gathering pages copied every key before reading it
(docs/design/cpu-step-profile.md). The kernel reads keys in place.

NOTE: every row is computed by the same code in the same key order (pages in position
order), whatever else the call holds: the kernel is batch- and chunk-invariant by
construction (docs/design/batch-invariance.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention_inputs import AttentionInputs

TARGET = "arcjax_cpu_paged_attention"
WRITE_TARGET = "arcjax_cpu_write_kv"
# Page storage the kernel reads: float32, bfloat16, float16, and 8-bit floats through a
# table (cpu_attention.cc PageKind).
_PAGE_KIND = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 3}
_BYTE_KIND = 2


def unsupported(*, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
                kv_dtype) -> str | None:
    """Why the kernel cannot take a call of these shapes (None: it can)."""
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in _PAGE_KIND and not (kv_dtype.itemsize == 1 and
                                           jnp.issubdtype(kv_dtype, jnp.floating)):
        return (f"pages of {kv_dtype} (the kernel reads float32, bfloat16, float16 and "
                f"8-bit float pages)")
    del head_dim, block_size, num_heads, num_kv_heads  # any (Hq a multiple of Hkv)
    return None


def _byte_table(dtype) -> np.ndarray:
    """[256] float32: the value of each byte of an 8-bit page (zeros for other pages)."""
    if jnp.dtype(dtype).itemsize != 1:
        return np.zeros(256, np.float32)
    return np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype)).astype(np.float32)


def ragged_paged_attention_cpu(inputs: AttentionInputs) -> jax.Array:  # [T, Hq, D]
    """`inputs`' attention by the compiled CPU kernel (`cpu_build.kernels_unavailable()`
    must be None).

    Returns:
        `[T, Hq, D]` in q's dtype; float32 arithmetic whatever the dtypes.
    """
    q = inputs.q
    kv_dtype = jnp.dtype(inputs.k_pages.dtype)
    i32, f32 = jnp.int32, jnp.float32
    window = (jnp.zeros((), i32) if inputs.sliding_window is None
              else jnp.asarray(inputs.sliding_window, i32))
    one = jnp.ones((), f32)
    scales = jnp.stack([one if inputs.k_scale is None else inputs.k_scale.astype(f32),
                        one if inputs.v_scale is None else inputs.v_scale.astype(f32)])
    sinks = (jnp.zeros((inputs.num_heads,), f32) if inputs.sinks is None
             else inputs.sinks.astype(f32))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, f32),
                            vmap_method="sequential")
    out = call(q.astype(f32), inputs.k_pages, inputs.v_pages, inputs.block_tables,
               inputs.kv_lens, inputs.cu_seqlens_q, inputs.num_seqs.astype(i32), window,
               scales, jnp.asarray(_byte_table(kv_dtype)), sinks,
               sm_scale=np.float32(inputs.sm_scale),
               softcap=np.float32(inputs.logit_softcap or 0.0),
               page_kind=np.int32(_PAGE_KIND.get(kv_dtype, _BYTE_KIND)),
               has_sinks=inputs.sinks is not None)
    return out.astype(q.dtype)


def write_kv_cpu(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows `k[t]`, `v[t]` ([T, Hkv, D], already in the pages' dtype) copied into slot
    `slot_mapping[t]` of the pages (`cpu_build.kernels_unavailable()` must be None); slots
    outside `[0, num_blocks * block_size)` write nothing. The results alias the pages, so under jit
    with the cache donated the write is in place: XLA:CPU's own scatter into 16-bit
    pages converts the whole cache to float32 and back.

    Returns:
        The updated `(k_pages, v_pages)`.
    """
    call = jax.ffi.ffi_call(WRITE_TARGET, (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                           jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))
