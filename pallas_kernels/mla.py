"""Multi-head latent attention (MLA) entry points: the call, the dispatch, the cache write.

`ragged_paged_mla(q_latent, q_rope, latent_pages, rope_pages, ...)` builds one `MLAInputs`
(it validates) and `mla_attention(inputs, impl=...)` dispatches it: "reference" (the
float64 oracle, `mla_reference`), "xla" (vectorized jnp, `mla_xla`), "pallas_gpu" (the
Pallas-Triton kernel, `mla_pallas_gpu`), "auto" (`resolve_mla_impl`). `write_latent`
scatters this step's latents and rope keys into their pages.

The cache of an MLA layer holds `kv_lora_rank + qk_rope_head_dim` values per token (one
latent and one rope key shared by every head), against `2 * Hkv * head_dim` for per-head
keys and values: DeepSeek-V2-Lite's 512 + 64 = 576 values per token and layer, against
16 * (192 + 128) = 5120 for its 16 heads' keys and values expanded (8.9x less).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import backends
from pallas_kernels import gpu_plan as gpu_plan_lib
from pallas_kernels import plan as plan_lib
from pallas_kernels import verified
from pallas_kernels.api import XLA_DECODE_BLOCK_K
from pallas_kernels.kernel_errors import KernelArgumentError, require
from pallas_kernels.kv import drop_padding_slots
from pallas_kernels.mla_inputs import MLAInputs
from pallas_kernels.mla_reference import mla_attention_reference
from pallas_kernels.mla_xla import mla_attention_xla

MLA_IMPLS = ("auto", "reference", "xla", "pallas_gpu")
# The XLA path's tiles for prefill chunks: query tokens x heads per tile (block_q is this
# over the head count) and keys per online-softmax step. Not retuned with the paged path's
# (api.XLA_BLOCK_Q / XLA_BLOCK_K): a latent tile's width multiplies by the heads.
MLA_XLA_BLOCK_Q = 128
MLA_XLA_BLOCK_K = 512


def _check_impl(impl: str) -> None:
    require(impl in MLA_IMPLS, "impl",
            f"unknown MLA implementation {impl!r}; expected one of {MLA_IMPLS}")


def _gpu_tiles(latent_dim: int, rope_dim: int, block_size: int) -> bool:
    """The Pallas GPU kernel tiles these dims: powers of two, dots of at least 16."""
    return (all(plan_lib.is_pow2(d) and d >= gpu_plan_lib.MIN_DOT
                for d in (latent_dim, rope_dim)) and plan_lib.is_pow2(block_size))


def mla_shape_class(inputs: MLAInputs) -> verified.ShapeClass:
    """The shape class a GPU pass of the MLA kernel is specific to: the latent as one KV
    head of every query head (e.g. DeepSeek-V2-Lite per device: "d512-r64-p16-g16")."""
    return verified.ShapeClass(head_dim=inputs.latent_dim, rope_dim=inputs.rope_dim,
                               page_size=inputs.block_size, gqa=inputs.num_heads)


def choose_mla_impl(impl: str, inputs: MLAInputs, *, platform: str | None = None,
                    kind: str | None = None) -> backends.Choice:
    """What `mla_attention(inputs, impl=impl)` runs on `platform` (None: the default
    backend), and whether a recorded GPU pass vouches for it: `impl` itself, or for
    "auto" the Pallas GPU kernel on a GPU where Pallas' Triton backend is current, the dims
    tile and a record of `verified.MLA_KERNEL` on this device kind (`kind`, default the
    device's) and shape class (`mla_shape_class`) vouches for it; "xla" otherwise (like
    "mosaic_gpu", never chosen unverified)."""
    _check_impl(impl)
    shape = mla_shape_class(inputs)

    def passed() -> bool:
        return verified.has_passed(verified.MLA_KERNEL, kind or backends.device_kind(), shape)

    if impl == "auto":
        run = ((platform or jax.default_backend()) in ("gpu", "cuda")
               and backends.pallas_triton_state() == "current"
               and _gpu_tiles(inputs.latent_dim, inputs.rope_dim, inputs.block_size)
               and passed())
        impl = "pallas_gpu" if run else "xla"
        return backends.Choice(impl=impl, verified=True if run else None,
                               shape_class=shape.key)
    return backends.Choice(impl=impl, verified=passed() if impl == "pallas_gpu" else None,
                           shape_class=shape.key)


def resolve_mla_impl(impl: str, inputs: MLAInputs, *, platform: str | None = None,
                     kind: str | None = None) -> str:
    """The implementation `mla_attention(inputs, impl=impl)` runs: `choose_mla_impl`'s."""
    return choose_mla_impl(impl, inputs, platform=platform, kind=kind).impl


def mla_attention(inputs: MLAInputs, *, impl: str = "auto",
                  interpret: bool = False) -> jax.Array:  # [T, Hq, Dl]
    """Absorbed latent attention of `inputs` (from `MLAInputs.create`), by `impl`.

    Args:
        inputs: the call.
        impl: one of `MLA_IMPLS`. Static.
        interpret: run "pallas_gpu" in Pallas' interpreter on the CPU. Static.

    Returns:
        `[T, Hq, Dl]` in q_latent's dtype: each head's softmax-weighted latents (the caller
        applies the value up-projection `W_uv`).
    """
    impl = resolve_mla_impl(impl, inputs)
    if impl == "reference":
        return mla_attention_reference(inputs)
    if impl == "pallas_gpu":
        require(_gpu_tiles(inputs.latent_dim, inputs.rope_dim, inputs.block_size), "q_latent",
                f'impl="pallas_gpu" needs power-of-two kv_lora_rank and rope dims >= 16 and '
                f"a power-of-two block size, got Dl={inputs.latent_dim}, "
                f"Dr={inputs.rope_dim}, block_size={inputs.block_size}")
        from pallas_kernels import mla_pallas_gpu

        plan = mla_pallas_gpu.make_mla_plan(inputs)
        return mla_pallas_gpu.mla_attention_pallas_gpu(inputs, plan, interpret=interpret)
    tiles = plan_lib.make_plan(
        num_tokens=inputs.num_tokens, num_seqs=inputs.seq_bucket, page_size=inputs.block_size,
        max_blocks=inputs.max_blocks, max_q_len=inputs.max_q_len,
        block_q=max(1, MLA_XLA_BLOCK_Q // inputs.num_heads),
        block_k=XLA_DECODE_BLOCK_K if inputs.max_q_len == 1 else MLA_XLA_BLOCK_K)
    return mla_attention_xla(inputs, tiles)


def ragged_paged_mla(
    q_latent: jax.Array,  # [T, Hq, Dl]
    q_rope: jax.Array,  # [T, Hq, Dr]
    latent_pages: jax.Array,  # [num_blocks, block_size, Dl]
    rope_pages: jax.Array,  # [num_blocks, block_size, Dr]
    block_tables: jax.Array,  # [S, max_blocks] int32
    kv_lens: jax.Array,  # [S] int32
    cu_seqlens_q: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array | int,
    *,
    sm_scale: float,
    impl: str = "auto",
    interpret: bool = False,
    max_q_len: int | None = None,
) -> jax.Array:  # [T, Hq, Dl]
    """Causal latent attention of a flat ragged batch over paged latents (`MLAInputs`).

    Args:
        q_latent: the absorbed queries `W_uk_h^T q_nope_h`; q_rope: the rope queries.
        latent_pages, rope_pages: one layer's pages of latents and rope keys.
        block_tables, kv_lens, cu_seqlens_q, num_seqs: as `ragged_paged_attention`'s.
        sm_scale: the softmax scale (required: the model's, not `Dl ** -0.5`).
        impl, interpret: see `mla_attention`. Static.
        max_q_len: static bound on any chunk's length (1: decode-only); defaults to T.
    """
    _check_impl(impl)
    inputs = MLAInputs.create(q_latent=q_latent, q_rope=q_rope, latent_pages=latent_pages,
                              rope_pages=rope_pages, block_tables=block_tables,
                              kv_lens=kv_lens, cu_seqlens_q=cu_seqlens_q, num_seqs=num_seqs,
                              sm_scale=sm_scale, max_q_len=max_q_len)
    return mla_attention(inputs, impl=impl, interpret=interpret)


def write_latent(
    latent_pages: jax.Array,  # [num_blocks, block_size, Dl]
    rope_pages: jax.Array,  # [num_blocks, block_size, Dr]
    latent: jax.Array,  # [T, Dl]
    rope: jax.Array,  # [T, Dr]
    slot_mapping: jax.Array,  # [T] int32
) -> tuple[jax.Array, jax.Array]:
    """Scatters token t's latent and rope key into slot `slot_mapping[t]` (`block *
    block_size + offset`); slots outside the pages (bucket padding) write nothing.

    Returns:
        The updated `(latent_pages, rope_pages)` (donate them under jit).
    """
    if latent_pages.ndim != 3 or rope_pages.ndim != 3 or (
            rope_pages.shape[:2] != latent_pages.shape[:2]):
        raise KernelArgumentError("latent_pages", f"expected [num_blocks, block_size, Dl] and "
                                  f"[num_blocks, block_size, Dr] pages, got "
                                  f"{latent_pages.shape} and {rope_pages.shape}")
    t = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    for name, x, pages in (("latent", latent, latent_pages), ("rope", rope, rope_pages)):
        if x.shape != (t, pages.shape[2]):
            raise KernelArgumentError(name, f"expected [{t}, {pages.shape[2]}] for "
                                      f"slot_mapping {slot_mapping.shape}, got {x.shape}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise KernelArgumentError("slot_mapping",
                                  f"expected an integer dtype, got {slot_mapping.dtype}")
    block, offset = drop_padding_slots(slot_mapping, *latent_pages.shape[:2])
    latent_pages = latent_pages.at[block, offset].set(latent.astype(latent_pages.dtype),
                                                      mode="drop")
    rope_pages = rope_pages.at[block, offset].set(rope.astype(rope_pages.dtype), mode="drop")
    return latent_pages, rope_pages
