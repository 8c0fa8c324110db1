"""Packed low-bit weights: integer codes packed into uint32 words, per-group scales beside.

A `PackedWeight` is a linear weight `[..., in, out]` stored as:

- `planes`: the codes `u` (unsigned, `sum(layout.bits)` bits each), split into bit planes
  of 8, 4, 2 or 1 bits (`layout.bits`, low plane first: Q5 = (4, 1), Q6 = (4, 2)); plane
  `p` is uint32 `[..., ceil(in * bits_p / 32), out]`, packed along the input dimension:
  word `k` of a column holds rows `k * n .. k * n + n - 1` (n = 32 / bits_p), row
  `k * n + j` in bits `j * bits_p ..` (the order GPTQ and compressed-tensors use);
- `scale`: `[..., G, out]`, one per group of `layout.group` consecutive input rows (G =
  ceil(in / group)), or per row's group `g_idx[..., in]` when given (GPTQ's act-order);
- the zero point: `layout.shift` (a constant: Q4_0's 8) or `zero` `[..., G, out]` uint8
  (AWQ, GPTQ, asymmetric compressed-tensors);
- `offset`: `[..., G, out]` added after scaling (GGUF's mins: Q4_1, Q4_K, ...), or None.

    w[i, o] = scale[g, o] * (u[i, o] - zero) + offset[g, o],   g = group of row i

computed in float32 (integers first, then one multiply and one add) and cast to the
compute dtype: bit-exact with `gguf`'s and the AWQ/GPTQ tools' float32 dequantization,
because every product there is exact in float32 (an fp16 scale times a code of at most 8
bits), so fusing the multiply and add cannot change a bit. Scales and offsets keep the
dtype that holds them exactly (float16 for GGUF's legacy types and the fp16 checkpoints,
float32 for the K-quants' scale x sub-scale products).

It is a pytree (arrays are leaves; `layout` is static), so layer stacks scan, shard and
donate like arrays; `dequantize` runs inside the jitted step (`quant.dense`), never on the
host. A packed embedding is stored as its transpose (`[H, V]`, the tied LM head's
orientation), so `columns` gathers the rows of the tokens of a step before unpacking them.
`pack_codes` builds the planes on the host (numpy), for the formats' readers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

PLANES = {2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 8: (8,)}  # code bits -> planes


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """The static part of a `PackedWeight`.

    Attributes:
      fmt: what the weights came from ("q4_1", "q4_k", "awq", "gptq", "pack-quantized", ...),
        reported as the weights' dtype.
      bits: bits of each plane, low first (`PLANES`).
      group: input rows per scale.
      rows: input rows (`in`; the planes may hold a few padding rows past it).
      shift: the zero point subtracted from every code when `zero` is None.
    """

    fmt: str
    bits: tuple[int, ...]
    group: int
    rows: int
    shift: int = 0

    @property
    def code_bits(self) -> int:
        return sum(self.bits)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["planes", "scale", "zero", "offset", "g_idx"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A linear weight stored packed (see the module docstring)."""

    planes: tuple  # each [..., words_p, out] uint32
    scale: jax.Array  # [..., G, out] float16 | bfloat16 | float32
    zero: jax.Array | None  # [..., G, out] uint8, or None (then layout.shift)
    offset: jax.Array | None  # [..., G, out] float, or None
    g_idx: jax.Array | None  # [..., in] int32 group of each row, or None (row // group)
    layout: PackedLayout

    @property
    def rows(self) -> int:
        """Input rows held: `layout.rows`, or a device's share of them inside a per-device
        computation (shard_map) that split the planes."""
        return min(self.layout.rows, self.planes[0].shape[-2] * (32 // self.layout.bits[0]))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight's shape [..., in, out]."""
        return (*self.scale.shape[:-2], self.rows, self.scale.shape[-1])

    @property
    def dtype(self) -> str:
        """What the weights came from (`layout.fmt`): the storage "dtype" reported."""
        return self.layout.fmt

    def map_arrays(self, fn) -> "PackedWeight":
        """The same weight with `fn` applied to every array (planes, scale, ...), e.g. an
        index into the leading (layer, expert) axes they all share."""
        opt = (lambda x: None if x is None else fn(x))
        return PackedWeight(tuple(fn(p) for p in self.planes), fn(self.scale), opt(self.zero),
                            opt(self.offset), opt(self.g_idx), self.layout)

    def map_columns(self, fn) -> "PackedWeight":
        """`fn` applied along the output axis of every array but `g_idx` (which has none):
        `fn(x)` gets `[..., n, out]` and returns `[..., n, out']`."""
        opt = (lambda x: None if x is None else fn(x))
        return PackedWeight(tuple(fn(p) for p in self.planes), fn(self.scale), opt(self.zero),
                            opt(self.offset), self.g_idx, self.layout)

    def codes(self) -> jax.Array:
        """The unsigned codes u [..., in, out] int32."""
        u, low = None, 0
        for plane, bits in zip(self.planes, self.layout.bits):
            part = unpack_plane(plane, bits) << low
            u, low = (part if u is None else u | part), low + bits
        return u[..., :self.rows, :].astype(jnp.int32)

    def expand(self, x: jax.Array) -> jax.Array:
        """A per-group array [..., G, out] repeated to every row: [..., in, out]."""
        if self.g_idx is not None:
            return jnp.take_along_axis(x, self.g_idx[..., :, None], axis=-2)
        g, out, group = x.shape[-2], x.shape[-1], self.layout.group
        full = jnp.broadcast_to(x[..., :, None, :], (*x.shape[:-2], g, group, out))
        return full.reshape(*x.shape[:-2], g * group, out)[..., :self.rows, :]

    def dequantize(self, dtype) -> jax.Array:
        """scale * (u - zero) + offset in float32, cast to `dtype`. [..., in, out]"""
        q = self.codes()
        q = q - (self.expand(self.zero.astype(jnp.int32)) if self.zero is not None
                 else self.layout.shift)
        w = self.expand(self.scale.astype(jnp.float32)) * q.astype(jnp.float32)
        if self.offset is not None:
            w = w + self.expand(self.offset.astype(jnp.float32))
        return w.astype(dtype)

    def columns(self, ids: jax.Array, dtype) -> jax.Array:
        """Columns `ids` [T] dequantized: [..., in, T] (a packed embedding's token rows,
        transposed). Only those columns are unpacked."""
        return self.map_columns(lambda x: jnp.take(x, ids, axis=-1)).dequantize(dtype)

    def leaf_axes(self, axes: tuple, degree=None) -> "PackedWeight":
        """The logical axes of each array given the weight's `axes` ([..., in, out]).

        Every array follows the leading and output axes. Along the input axis the planes
        split when each plane's words split evenly over `degree(axis)` devices (`degree`:
        the mesh's; None: no split) and hold no padding rows; the per-group arrays split
        with them when each device's rows are whole groups (without `g_idx`). An array
        that does not split stays whole along it: the jitted step's (GSPMD's) global view
        is the same either way; `splits_rows` says whether every device holds exactly its
        own rows' arrays (what a per-device computation needs).
        """
        lead, ax_in, ax_out = tuple(axes[:-2]), axes[-2], axes[-1]
        d = 1 if degree is None or ax_in is None else degree(ax_in)
        lay, groups = self.layout, self.scale.shape[-2]
        planes_split = ax_in is not None and all(
            p.shape[-2] % d == 0 and p.shape[-2] * (32 // b) == lay.rows
            for p, b in zip(self.planes, lay.bits))
        groups_split = (planes_split and self.g_idx is None and groups % d == 0
                        and (lay.rows // d) % lay.group == 0)
        row_axis = ax_in if planes_split else None
        per_group = (*lead, ax_in if groups_split else None, ax_out)
        opt = (lambda x: None if x is None else per_group)
        return PackedWeight(tuple((*lead, row_axis, ax_out) for _ in self.planes), per_group,
                            opt(self.zero), opt(self.offset),
                            None if self.g_idx is None else (*lead, row_axis), self.layout)

    def splits_rows(self, degree: int) -> bool:
        """Whether the input axis splits over `degree` devices with every device holding
        exactly its rows' planes and scales (groups whole on one device, or `g_idx` rows
        reading whole scales)."""
        axes = self.leaf_axes((*(None,) * (len(self.shape) - 2), "in", None),
                              lambda _: degree)
        return axes.planes[0][-2] is not None and (axes.scale[-2] is not None
                                                   or self.g_idx is not None)


def w4a16_layout(w: PackedWeight) -> bool:
    """Whether `w` (one matrix or a stack of them) is in the W4A16 kernel's layout: one
    4-bit plane in group order (no g_idx), no padding rows (AWQ, GPTQ without act-order,
    4-bit compressed-tensors, GGUF Q4_0 / Q4_1 / Q4_K)."""
    return (w.layout.bits == (4,) and w.g_idx is None
            and w.planes[0].shape[-2] * 8 == w.layout.rows)


def w4a16_operands(w: PackedWeight) -> dict | None:
    """The operands of `pallas_kernels.w4a16.w4a16_matmul` for one matrix [in, out] in
    its layout (`w4a16_layout`): qweight, scale, zero, offset, group, shift; None for any
    other packed weight (those take `dequantize`)."""
    lay = w.layout
    if len(w.shape) != 2 or not w4a16_layout(w):
        return None
    return dict(qweight=w.planes[0], scale=w.scale, zero=w.zero, offset=w.offset,
                group=lay.group, shift=lay.shift)


def unpack_plane(plane: jax.Array, bits: int) -> jax.Array:
    """Plane words [..., W, out] uint32 -> values [..., W * 32 / bits, out] uint32."""
    per = 32 // bits
    shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
    mask = jnp.uint32((1 << bits) - 1)
    v = (plane.astype(jnp.uint32)[..., :, None, :] >> shifts[:, None]) & mask  # [.., W, n, out]
    return v.reshape(*plane.shape[:-2], plane.shape[-2] * per, plane.shape[-1])


def pack_codes(codes: np.ndarray, code_bits: int) -> tuple[np.ndarray, ...]:
    """Host packing: codes [..., in, out] (unsigned, < 2**code_bits) -> the planes of
    `PLANES[code_bits]`, each uint32 [..., ceil(in / n), out] (rows past `in`: zero)."""
    codes = np.asarray(codes, np.uint32)
    rows = codes.shape[-2]
    planes, low = [], 0
    for bits in PLANES[code_bits]:
        per = 32 // bits
        part = (codes >> np.uint32(low)) & np.uint32((1 << bits) - 1)
        pad = -rows % per
        if pad:
            part = np.concatenate([part, np.zeros((*part.shape[:-2], pad, part.shape[-1]),
                                                  np.uint32)], axis=-2)
        part = part.reshape(*part.shape[:-2], part.shape[-2] // per, per, part.shape[-1])
        shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))[:, None]
        planes.append(np.bitwise_or.reduce(part << shifts, axis=-2).astype(np.uint32))
        low += bits
    return tuple(planes)


def host_packed(codes: np.ndarray, scale: np.ndarray, *, fmt: str, group: int,
                zero: np.ndarray | None = None, offset: np.ndarray | None = None,
                g_idx: np.ndarray | None = None, shift: int = 0,
                code_bits: int | None = None) -> PackedWeight:
    """A `PackedWeight` of numpy arrays from codes [..., in, out] and per-group arrays
    [..., G, out] (the formats' readers build theirs with it)."""
    if code_bits is None:
        code_bits = next(b for b in sorted(PLANES) if int(np.max(codes, initial=0)) < 1 << b)
    layout = PackedLayout(fmt, PLANES[code_bits], group, codes.shape[-2], shift)
    return PackedWeight(pack_codes(codes, code_bits), scale, zero, offset,
                        None if g_idx is None else np.asarray(g_idx, np.int32), layout)


def stack_packed(weights: list[PackedWeight], lead: tuple[int, ...]) -> PackedWeight | None:
    """Host weights of one layout stacked on new leading axes `lead` (row-major), or None
    when their layouts or array shapes differ."""
    first = weights[0]
    like = jax.tree.structure(first)
    if any(jax.tree.structure(w) != like or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(first))) for w in weights):
        return None

    def stack(*xs):
        out = np.stack(xs)
        return out.reshape(*lead, *out.shape[1:])

    return jax.tree.map(stack, *weights)
