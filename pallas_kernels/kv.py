"""Writing this step's keys and values into the paged KV cache."""

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_attention, cpu_build
from pallas_kernels.kernel_errors import KernelArgumentError


def write_kv(
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32
    *,
    k_scale: jax.Array | float | None = None,  # [] float32
    v_scale: jax.Array | float | None = None,  # [] float32
    impl: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """Scatters token `t`'s key/value into slot `slot_mapping[t]` of the pages.

    A slot is `block * block_size + offset`. A slot outside
    `[0, num_blocks * block_size)` writes nothing: bucket padding rows carry one.

    Quantized pages (float8_e4m3fn): the pages hold `k / k_scale` (`v / v_scale`),
    saturated to the format's finite range (e4m3fn has no infinity: an overflow would
    otherwise become NaN); attention reads them back with the same scales.

    Args:
        k_pages, v_pages: the cache pages of one layer (donate them under jit).
        k, v: this step's keys and values, cast to the pages' dtype.
        slot_mapping: destination slot of every token.
        k_scale, v_scale: None, or the scalars the pages are quantized with (traced or not).
        impl: "xla" (a scatter) or "cpu" (the CPU kernel's in-place copy,
            `cpu_attention.write_kv_cpu`: what the engine runs beside impl="cpu" attention).

    Returns:
        The updated `(k_pages, v_pages)`.
    """
    if k_pages.ndim != 4:
        raise KernelArgumentError(
            "k_pages", f"expected rank 4 [num_blocks, block_size, Hkv, D], got {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise KernelArgumentError(
            "v_pages", f"shape {v_pages.shape} differs from k_pages {k_pages.shape}")
    num_blocks, block_size, hkv, d = k_pages.shape
    if k.ndim != 3 or k.shape[1:] != (hkv, d):
        raise KernelArgumentError("k", f"expected [T, {hkv}, {d}], got shape {k.shape}")
    if v.shape != k.shape:
        raise KernelArgumentError("v", f"shape {v.shape} differs from k {k.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise KernelArgumentError(
            "slot_mapping", f"expected shape ({k.shape[0]},), got {slot_mapping.shape}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise KernelArgumentError(
            "slot_mapping", f"expected an integer dtype, got {slot_mapping.dtype}")

    if impl == "cpu":
        reason = cpu_build.kernels_unavailable()
        if reason is not None:
            raise KernelArgumentError("impl", reason)
        return cpu_attention.write_kv_cpu(k_pages, v_pages, quantize_kv(k, k_pages.dtype, k_scale),
                                          quantize_kv(v, v_pages.dtype, v_scale), slot_mapping)
    if impl != "xla":
        raise KernelArgumentError("impl", f'expected "xla" or "cpu", got {impl!r}')
    block, offset = drop_padding_slots(slot_mapping, num_blocks, block_size)
    k_pages = k_pages.at[block, offset].set(quantize_kv(k, k_pages.dtype, k_scale), mode="drop")
    v_pages = v_pages.at[block, offset].set(quantize_kv(v, v_pages.dtype, v_scale), mode="drop")
    return k_pages, v_pages


def drop_padding_slots(slot_mapping: jax.Array, num_blocks: int,
                       block_size: int) -> tuple[jax.Array, jax.Array]:
    """(block [T], offset [T]) of each slot, for a `mode="drop"` scatter into pages
    `[num_blocks, block_size, ...]`: slots outside the pages (padding) land past the end."""
    num_slots = num_blocks * block_size
    slots = slot_mapping.astype(jnp.int32)
    # NOTE: jnp indexing wraps negative indices before mode="drop" applies, so a
    # negative slot is moved past the end to be dropped like any other padding.
    slots = jnp.where(slots < 0, num_slots, slots)  # [T]
    # NOTE: scatter into the pages by (block, offset). Scattering into a flat
    # [num_slots, Hkv, D] reshape of the pages made XLA copy the whole cache (twice) in
    # every layer of the scanned decoder: the reshape of a loop-carried buffer defeats
    # in-place update (a lone decode step on the CPU: 2.4 ms -> see RESULTS.md).
    return slots // block_size, slots % block_size


def quantize_kv(x: jax.Array, dtype, scale: jax.Array | float | None) -> jax.Array:
    """`x / scale` in the page dtype; saturated to its finite range for 8-bit floats."""
    dtype = jnp.dtype(dtype)
    if scale is not None:
        x = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)
