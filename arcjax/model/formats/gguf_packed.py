"""GGUF quant blocks into packed device weights, without going through float.

`decode_blocks(raw, type_name)` splits each GGML block into its integer codes and its
per-group scale (and min), mirroring `gguf.quants`' own dequantization step by step but
stopping before the float math; `packed_tensor` turns a tensor's rows into a
`PackedWeight` of its transpose ([in = ne0, out = rows]: a linear weight's orientation, a
tied embedding's LM head orientation). On the device, `scale * (u - shift) + offset` in
float32 gives `gguf`'s float32 values bit for bit (the products are exact in float32; see
`arcjax.model.packed`).

Device layout per type (bits per weight, the file's in parentheses):

  Q4_0  4-bit codes, shift 8,  fp16 scale / 32            4.5 (4.5)
  Q4_1  4-bit codes,           fp16 scale + fp16 min / 32  5.0 (5.0)
  Q5_0  4 + 1-bit planes, shift 16, fp16 scale / 32        5.5 (5.5)
  Q5_1  4 + 1-bit planes,      fp16 scale + fp16 min / 32  6.0 (6.0)
  Q8_0  8-bit codes, shift 128, fp16 scale / 32            8.5 (8.5)
  Q2_K  2-bit codes,           fp32 scale + fp32 min / 16  6.0 (2.625)
  Q3_K  2 + 1-bit planes, shift 4, fp32 scale / 16         5.0 (3.4375)
  Q4_K  4-bit codes,           fp32 scale + fp32 min / 32  6.0 (4.5)
  Q5_K  4 + 1-bit planes,      fp32 scale + fp32 min / 32  7.0 (5.5)
  Q6_K  4 + 2-bit planes, shift 32, fp32 scale / 16        8.0 (6.5625)

A K-quant's group scale is the product of its super-block's fp16 scale and a 6- or 8-bit
sub-scale, which fp16 cannot hold exactly: it is stored as the float32 product gguf
computes. Tensors of one weight whose layers mix types (Q4_K_M's attn_v / ffn_down mix
Q4_K and Q6_K) are brought to one layout (`common_layout`, `to_common`: the widest codes,
the finest groups, float32 scales and mins with each shift folded into the min: still
exact), since a layer stack scans one layout.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arcjax.model.packed import PLANES, PackedWeight, host_packed

QK_K = 256
# GGML type name -> (elements per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144),
          "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}
PACKED_TYPES = tuple(BLOCKS)


@dataclasses.dataclass(frozen=True)
class BlockCodes:
    """One tensor's blocks split into integers and per-group floats (host, numpy).

    Attributes:
      codes: [n, block] uint8 unsigned codes.
      scale: [n, block / group] float16 | float32.
      offset: [n, block / group] added after scaling, or None.
      shift: subtracted from every code before scaling.
      group: elements per scale.
      code_bits: bits per code.
    """

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    shift: int
    group: int
    code_bits: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """Bytes [n, 2] -> [n, 1] float16 (a block's d or m, as stored)."""
    return np.ascontiguousarray(raw).view(np.float16)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """gguf's nibble order: each run of `width` bytes gives its low nibbles, then its
    high ones. qs [n, m] -> [n, 2m]."""
    n = qs.shape[0]
    out = qs.reshape(n, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (out & np.uint8(0x0F)).reshape(n, -1)


def _bits(raw: np.ndarray, shifts, width: int) -> np.ndarray:
    """Each run of `width` bytes read at every shift in turn: [n, m] -> [n, m * len]."""
    n = raw.shape[0]
    shifts = np.asarray(shifts, np.uint8).reshape(1, 1, -1, 1)
    return (raw.reshape(n, -1, 1, width) >> shifts).reshape(n, -1)


def _high_bit(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: one little-endian uint32 of fifth bits -> [n, 32] (bit j: element j)."""
    words = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and mins (gguf's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_blocks(raw: np.ndarray, type_name: str) -> BlockCodes:
    """A tensor's blocks `raw` [n, bytes per block] uint8 of GGML type `type_name` as
    integer codes and per-group floats (`PACKED_TYPES`)."""
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(raw[:, :2])
        has_min = type_name.endswith("_1")
        m = _f16(raw[:, 2:4]) if has_min else None
        rest = raw[:, 4:] if has_min else raw[:, 2:]
        if type_name.startswith("Q5"):
            codes = _nibbles(rest[:, 4:], 16) | (_high_bit(rest[:, :4]) << np.uint8(4))
        else:
            codes = _nibbles(rest, 16)
        bits = 5 if type_name.startswith("Q5") else 4
        shift = 0 if has_min else 1 << (bits - 1)
        return BlockCodes(codes, d, m, shift, 32, bits)
    if type_name == "Q8_0":
        codes = (raw[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockCodes(codes, _f16(raw[:, :2]), None, 128, 32, 8)
    if type_name == "Q2_K":
        scales, qs = raw[:, :16], raw[:, 16:80]
        d, dmin = _f16(raw[:, 80:82]).astype(np.float32), _f16(raw[:, 82:84]).astype(np.float32)
        scale = d * (scales & 0xF).astype(np.float32)  # [n, 16], gguf's dl
        offset = -dmin * (scales >> 4).astype(np.float32)  # -ml
        codes = _bits(qs, [0, 2, 4, 6], 32) & np.uint8(3)
        return BlockCodes(codes, scale, offset, 0, 16, 2)
    if type_name == "Q3_K":
        hmask, qs, sc = raw[:, :32], raw[:, 32:96], raw[:, 96:108]
        d = _f16(raw[:, 108:110]).astype(np.float32)
        low = _bits(sc[:, :8], [0, 4], 8) & np.uint8(0x0F)
        high = _bits(sc[:, 8:], [0, 2, 4, 6], 4) & np.uint8(0x03)
        sub = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
        ql = _bits(qs, [0, 2, 4, 6], 32) & np.uint8(3)
        qh = _bits(hmask, range(8), 32) & np.uint8(1)  # 1: no -4 offset
        return BlockCodes(ql | (qh << np.uint8(2)), d * sub, None, 4, 16, 3)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw[:, :2]).astype(np.float32), _f16(raw[:, 2:4]).astype(np.float32)
        sc, mn = _scale_min_k4(raw[:, 4:16])
        scale, offset = d * sc.astype(np.float32), -dmin * mn.astype(np.float32)
        if type_name == "Q4_K":
            return BlockCodes(_nibbles(raw[:, 16:], 32), scale, offset, 0, 32, 4)
        qh = _bits(raw[:, 16:48], range(8), 32) & np.uint8(1)
        codes = _nibbles(raw[:, 48:], 32) | (qh << np.uint8(4))
        return BlockCodes(codes, scale, offset, 0, 32, 5)
    if type_name == "Q6_K":
        ql, qh, sc = raw[:, :128], raw[:, 128:192], raw[:, 192:208]
        d = _f16(raw[:, 208:210]).astype(np.float32)
        scale = d * sc.view(np.int8).astype(np.float32)  # [n, 16]
        codes = _nibbles(ql, 64) | ((_bits(qh, [0, 2, 4, 6], 32) & np.uint8(3)) << np.uint8(4))
        return BlockCodes(codes, scale, None, 32, 16, 6)
    raise KeyError(type_name)


# GGML type -> (elements per scale, bits per code) of its device layout
LAYOUTS = {"Q4_0": (32, 4), "Q4_1": (32, 4), "Q5_0": (32, 5), "Q5_1": (32, 5), "Q8_0": (32, 8),
           "Q2_K": (16, 2), "Q3_K": (16, 3), "Q4_K": (32, 4), "Q5_K": (32, 5), "Q6_K": (16, 6)}


def common_layout(type_names) -> tuple[int, int] | None:
    """(group, code bits) that tensors of all `type_names` can share, or None when they
    are of one type (kept as it is)."""
    names = set(type_names)
    if len(names) == 1:
        return None
    group = min(LAYOUTS[n][0] for n in names)
    bits = max(LAYOUTS[n][1] for n in names)
    return group, next(b for b in sorted(PLANES) if b >= bits)


def to_common(codes: BlockCodes, layout: tuple[int, int]) -> BlockCodes:
    """Blocks in a shared layout (`common_layout`): float32 scales repeated to the finer
    group, and the shift folded into a float32 min (`scale * (u - s) + m == scale * u +
    (m - s * scale)`: exact, since `s * scale` and the sum are exact in float32 for these
    types)."""
    group, bits = layout
    rep = codes.group // group
    scale = np.repeat(codes.scale.astype(np.float32), rep, axis=-1)
    offset = (np.zeros_like(scale) if codes.offset is None
              else np.repeat(codes.offset.astype(np.float32), rep, axis=-1))
    return BlockCodes(codes.codes, scale, offset - np.float32(codes.shift) * scale, 0, group,
                      bits)


def permute_rows(codes: BlockCodes, ne0: int, permute) -> BlockCodes:
    """`codes` with the tensor's rows reordered by `permute(x [rows, ...]) -> same`
    (llama.cpp's rotary permutation undone on q/k)."""
    def rows(x, width):
        return permute(x.reshape(-1, width)).reshape(x.shape)

    per_row = ne0 // codes.group
    return dataclasses.replace(
        codes, codes=rows(codes.codes, ne0), scale=rows(codes.scale, per_row),
        offset=None if codes.offset is None else rows(codes.offset, per_row))


def packed_tensor(codes: BlockCodes, shape: tuple[int, ...], fmt: str) -> PackedWeight:
    """A tensor's decoded blocks as the `PackedWeight` of its transpose: `shape` is its
    numpy shape [..., rows, ne0]; the weight is [..., ne0, rows] (host arrays)."""
    *lead, rows, ne0 = shape
    per_row = ne0 // codes.group

    def transposed(x, width):
        return np.ascontiguousarray(np.swapaxes(x.reshape(*lead, rows, width), -1, -2))

    return host_packed(transposed(codes.codes, ne0), transposed(codes.scale, per_row),
                       fmt=fmt, group=codes.group, shift=codes.shift,
                       offset=None if codes.offset is None else transposed(codes.offset,
                                                                            per_row),
                       code_bits=codes.code_bits)
