"""AWQ, GPTQ and compressed-tensors packed weights into `PackedWeight`s (host, numpy).

Each function reads one linear layer (`base`: its Hugging Face module name, "model.layers.0
.self_attn.q_proj") through `get(name) -> np.ndarray | None` and returns the packed weight
of its [in, out] matrix, codes kept packed (repacked only where the format orders them
otherwise). The published layouts, and each tool's own dequantization they match:

- AWQ GEMM (AutoAWQ `WQLinear_GEMM`): `qweight` int32 [in, out / 8] packed along the
  output in AutoAWQ's order (nibble i of word c holds column 8c + [0, 2, 4, 6, 1, 3, 5,
  7][i]), `qzeros` int32 [G, out / 8] the same, `scales` fp16 [G, out];
  w = (q - z) * s (`awq.utils.packing_utils.dequantize_gemm`).
- GPTQ (AutoGPTQ / GPTQModel `QuantLinear`): `qweight` int32 [in * bits / 32, out] packed
  along the input (row 32/bits * k + j in bits j * bits of word k: our planes as they
  are), `qzeros` int32 [G, out * bits / 32] packed along the output, `scales` [G, out],
  `g_idx` int32 [in]; w = s[g_idx] * (q - z[g_idx]), the stored zero plus one in the v1
  format AutoGPTQ writes (`checkpoint_format: gptq`).
- compressed-tensors `pack-quantized` (llm-compressor): `weight_packed` int32 [out, in *
  bits / 32] packed along the input (element i at bit i * bits), codes offset by 2**(bits
  - 1) (signed values stored unsigned), `weight_scale` [out, G] ([out, 1] per channel,
  [1] per tensor), `weight_zero_point` int32 [out * bits / 32, G] packed along the output
  (same offset) when asymmetric, `weight_shape` (out, in), optionally `weight_g_idx`;
  w = (q - z) * s (`compressed_tensors` `PackedQuantizationCompressor.decompress`).
"""

from __future__ import annotations

import numpy as np

from arcjax.errors import WeightsError
from arcjax.model.packed import PLANES, PackedLayout, PackedWeight, host_packed

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) held by nibble i of an AWQ word


def unpack_last(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 words [..., W] packed along their last axis (element i at bit i * bits) ->
    uint8 [..., count]."""
    per = 32 // bits
    w = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    out = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return out.reshape(*w.shape[:-1], -1)[..., :count].astype(np.uint8)


def _require(get, name: str, where) -> np.ndarray:
    x = get(name)
    if x is None:
        raise WeightsError(where, f"tensor {name} is missing from the checkpoint")
    return x


def _groups(g_idx: np.ndarray | None, rows: int, groups: int, where, name: str):
    """(group size, g_idx or None): g_idx kept only when rows are not in group order."""
    group = -(-rows // groups)
    if g_idx is None:
        return group, None
    g_idx = np.asarray(g_idx, np.int64)
    if g_idx.shape != (rows,) or g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= groups:
        raise WeightsError(where, f"{name}: g_idx of shape {g_idx.shape} (values up to "
                                  f"{g_idx.max(initial=0)}) does not index {groups} groups "
                                  f"of {rows} rows")
    if np.array_equal(g_idx, np.arange(rows) // group):
        return group, None
    return group, g_idx.astype(np.int32)


def read_awq(get, base: str, rows: int, where) -> PackedWeight:
    """An AWQ GEMM linear layer (4 bits, zero points) of `rows` inputs."""
    qweight = _require(get, f"{base}.qweight", where)  # [in, out / 8]
    qzeros = _require(get, f"{base}.qzeros", where)  # [G, out / 8]
    scales = _require(get, f"{base}.scales", where)  # [G, out]
    out = scales.shape[-1]
    if qweight.shape != (rows, out // 8) or qzeros.shape != (scales.shape[0], out // 8):
        raise WeightsError(where, f"{base}: qweight {qweight.shape} / qzeros {qzeros.shape} "
                                  f"do not fit scales {scales.shape} and {rows} inputs")
    inverse = np.argsort(AWQ_ORDER)  # nibble holding each column

    def columns(words):  # [n, out / 8] -> [n, out] in column order
        nibbles = unpack_last(words, 4, out).reshape(words.shape[0], -1, 8)
        return nibbles[:, :, inverse].reshape(words.shape[0], out)

    group, _ = _groups(None, rows, scales.shape[0], where, base)
    return host_packed(columns(qweight), scales, fmt="awq", group=group,
                       zero=columns(qzeros), code_bits=4)


def read_gptq(get, base: str, rows: int, bits: int, zero_plus_one: bool,
              where) -> PackedWeight:
    """A GPTQ linear layer of `rows` inputs (`bits` of 2, 4, 8; g_idx read when rows are
    out of group order)."""
    qweight = _require(get, f"{base}.qweight", where)  # [in * bits / 32, out]
    qzeros = _require(get, f"{base}.qzeros", where)  # [G, out * bits / 32]
    scales = _require(get, f"{base}.scales", where)  # [G, out]
    groups, out = scales.shape
    if qweight.shape != (rows * bits // 32, out) or qzeros.shape[0] != groups:
        raise WeightsError(where, f"{base}: qweight {qweight.shape} / qzeros {qzeros.shape} "
                                  f"do not fit scales {scales.shape}, {rows} inputs of "
                                  f"{bits} bits")
    zeros = unpack_last(qzeros, bits, out).astype(np.int16) + (1 if zero_plus_one else 0)
    group, g_idx = _groups(get(f"{base}.g_idx"), rows, groups, where, base)
    layout = PackedLayout("gptq", PLANES[bits], group, rows)
    return PackedWeight((np.ascontiguousarray(qweight).view(np.uint32),), scales,
                        zeros.astype(np.uint8 if bits < 8 else np.uint16), None, g_idx, layout)


def read_pack_quantized(get, base: str, rows: int, bits: int, symmetric: bool,
                        where) -> PackedWeight:
    """A compressed-tensors pack-quantized linear layer of `rows` inputs."""
    packed = _require(get, f"{base}.weight_packed", where)  # [out, in * bits / 32]
    scale = np.asarray(_require(get, f"{base}.weight_scale", where))
    shape = get(f"{base}.weight_shape")
    out = packed.shape[0]
    if shape is not None and tuple(np.asarray(shape).tolist()) != (out, rows):
        raise WeightsError(where, f"{base}: weight_shape {np.asarray(shape).tolist()}, "
                                  f"the config implies {[out, rows]}")
    if packed.shape[1] != -(-rows * bits // 32):
        raise WeightsError(where, f"{base}: weight_packed {packed.shape} does not hold "
                                  f"{rows} inputs of {bits} bits")
    scale = scale.reshape(1, 1) if scale.size == 1 else scale  # per tensor: [1, 1]
    scale = np.ascontiguousarray(np.broadcast_to(scale, (out, scale.shape[-1])).T)  # [G, out]
    zero = None
    if not symmetric:
        zp = _require(get, f"{base}.weight_zero_point", where)  # [out * bits / 32, G]
        zero = np.ascontiguousarray(unpack_last(np.asarray(zp).T, bits, out))  # [G, out]
        if zero.shape != scale.shape:
            raise WeightsError(where, f"{base}: weight_zero_point {zp.shape} does not fit "
                                      f"weight_scale {scale.shape[::-1]}")
    group, g_idx = _groups(get(f"{base}.weight_g_idx"), rows, scale.shape[0], where, base)
    layout = PackedLayout("pack-quantized", PLANES[bits], group, rows,
                          0 if zero is not None else 1 << (bits - 1))
    planes = (np.ascontiguousarray(np.asarray(packed).T).view(np.uint32),)  # [in*b/32, out]
    return PackedWeight(planes, scale, zero, None, g_idx, layout)
