"""MXFP4 weights kept packed on the device (OCP microscaling FP4: gpt-oss's experts).

An `Mxfp4Weight` is a linear weight `[..., in, out]` stored as the published checkpoints
store it, per output row and block of BLOCK = 32 input values:

- `blocks`: uint8 `[..., out, G, 16]` (G = in / 32), the block's 32 e2m1 codes two per
  byte, the low nibble first (input 2j in bits 0-3, 2j + 1 in bits 4-7);
- `scales`: uint8 `[..., out, G]`, one e8m0 byte per block: the power of two
  `2 ** (scale - 127)`.

    w[32 g + j, o] = FP4_VALUES[code(o, g, j)] * 2 ** (scales[o, g] - 127)

4.25 bits per weight (a byte per two values, a byte per 32). `block_values` is the one
decoding: `arcjax.model.formats.mxfp4.decode` runs it with numpy at load (transformers'
`convert_moe_packed_tensors`, bit-exact), `dequantize` with jax.numpy inside the jitted
step, where `quant.dense_at` reads one (layer, expert)'s matrix inside the grouped GEMMs.
Every product is an FP4 value times a power of two, exact in float32 (and in bfloat16);
`block_values` writes its float32 bits from the code and scale fields with integer
operations, elementwise (XLA fuses them into the GEMM's operand; a table gather and
`ldexp` cost the CPU step ten times more), and identical under numpy and XLA.

It is a pytree (both arrays are leaves), so layer stacks shard and donate like arrays;
it answers `PackedWeight`'s protocol (`shape`, `dtype`, `map_arrays`, `dequantize`,
`leaf_axes`, `splits_rows`), so `quant` and `moe` treat both packed kinds alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # values per scale
E8M0_BIAS = 127
# e2m1 code -> value (bit 3 the sign): the OCP FP4 table.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FMT = "mxfp4"  # the storage "dtype" reported


def unpack_codes(blocks, xp=np):
    """uint8 blocks [..., G, 16] -> uint8 codes [..., G, 32] (low nibble first), with the
    array module `xp` (numpy on the host, jax.numpy in the step)."""
    pairs = xp.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]
    return pairs.reshape(*blocks.shape[:-1], BLOCK)


def block_values(blocks, scales, xp=np):
    """float32 [..., G * 32]: the values of `blocks` [..., G, 16] scaled by their e8m0
    `scales` [..., G] (`xp`: numpy or jax.numpy): `FP4_VALUES[code] * 2 ** (scale - 127)`,
    the float32 bits built from the fields in integers (no table gather, no float
    arithmetic, so no flushing: subnormal and infinite products come out as `ldexp`
    gives them)."""
    c = unpack_codes(blocks, xp).astype(xp.uint32)  # [..., G, 32]
    s = scales.astype(xp.int32)[..., None]  # [..., G, 1]
    e, m = ((c >> 1) & 3).astype(xp.int32), c & 1  # e2m1: exponent field, mantissa bit
    # (1 + m / 2) * 2**(e - 1) for e > 0, and 0.5 (e = 0, m = 1) is 1.0 * 2**-1: the
    # product's float32 exponent field is s + e - 1 either way
    field = s + e - 1
    mant = xp.where(e > 0, m, 0).astype(xp.uint32) << 22
    normal = (xp.clip(field, 0, 255).astype(xp.uint32) << 23) | mant
    shift = xp.clip(1 - field, 0, 31).astype(xp.uint32)  # field <= 0: a subnormal
    magnitude = xp.where(field >= 255, xp.uint32(0x7F800000), xp.where(
        field > 0, normal, ((xp.uint32(1) << 23) | mant) >> shift))
    magnitude = xp.where((e == 0) & (m == 0), xp.uint32(0), magnitude)
    bits = ((c >> 3) << 31) | magnitude
    return bits.view(xp.float32).reshape(*blocks.shape[:-2], -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Weight:
    """A linear weight stored as MXFP4 blocks (see the module docstring)."""

    blocks: jax.Array  # [..., out, G, 16] uint8
    scales: jax.Array  # [..., out, G] uint8

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight's shape [..., in, out] (a device's share of `in` inside a
        per-device computation that split the blocks)."""
        *lead, out, groups = self.scales.shape
        return (*lead, groups * BLOCK, out)

    @property
    def dtype(self) -> str:
        return FMT

    def map_arrays(self, fn) -> "Mxfp4Weight":
        """The same weight with `fn` applied to both arrays (e.g. an index into the leading
        (layer, expert) axes they share)."""
        return Mxfp4Weight(fn(self.blocks), fn(self.scales))

    def dequantize(self, dtype) -> jax.Array:
        """The weight in `dtype` (float32 decode, exact): [..., in, out]."""
        w = block_values(self.blocks, self.scales, jnp)  # [..., out, in]
        return jnp.swapaxes(w, -1, -2).astype(dtype)

    def leaf_axes(self, axes: tuple, degree=None) -> "Mxfp4Weight":
        """The logical axes of each array given the weight's `axes` ([..., in, out]): the
        leading and output axes alike; the blocks' group axis follows the input axis when
        the groups split evenly over `degree(axis)` devices (else it stays whole: the
        jitted step's global view is the same)."""
        lead, ax_in, ax_out = tuple(axes[:-2]), axes[-2], axes[-1]
        d = 1 if degree is None or ax_in is None else degree(ax_in)
        groups = ax_in if ax_in is not None and self.scales.shape[-1] % d == 0 else None
        return Mxfp4Weight((*lead, ax_out, groups, None), (*lead, ax_out, groups))

    def splits_rows(self, degree: int) -> bool:
        """Whether the input axis splits over `degree` devices in whole blocks (each device
        holds its rows' codes and scales)."""
        return self.scales.shape[-1] % degree == 0
