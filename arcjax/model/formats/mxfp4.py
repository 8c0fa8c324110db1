"""MXFP4 weights as gpt-oss checkpoints publish them (OCP microscaling FP4).

config.json says `"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
[...]}` and each layer's experts are stored as

    model.layers.{i}.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H / 32, 16]
    model.layers.{i}.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H / 32]
    model.layers.{i}.mlp.experts.down_proj_blocks     uint8 [E, H, I / 32, 16]
    model.layers.{i}.mlp.experts.down_proj_scales     uint8 [E, H, I / 32]

(the biases, attention, router, embeddings and head stay bf16). Per output row (`2I` of
gate_up, `H` of down) and block of 32 input values: 16 bytes of FP4 e2m1 codes, two per
byte, the low nibble first (input 2j in bits 0-3, 2j + 1 in bits 4-7), and one e8m0 scale
byte: the block's values are `FP4_VALUES[code] * 2 ** (scale - 127)`. gate_up's output
rows interleave gate and up (row 2j is gate j, row 2j + 1 is up j), as the bf16
checkpoints' `gate_up_proj` [E, H, 2I] columns do.

`decode` is transformers' `convert_moe_packed_tensors` (bit-exact; the products are exact
in float32) through `arcjax.model.mxfp4_weight.block_values`, the decoding the step runs
on the device too (where the experts stay packed: `Mxfp4Weight`, built per layer by
`fused_experts.packed_experts`); `encode` its inverse for a weight the format can hold
and the nearest FP4 value otherwise (what tests use to write a checkpoint in the
published layout), `codes` / `exponents` the raw fields, `split_gate_up` the
de-interleave.
"""

from __future__ import annotations

import numpy as np

from arcjax.errors import WeightsError
from arcjax.model.mxfp4_weight import (BLOCK, E8M0_BIAS, FMT, FP4_VALUES, block_values,
                                       unpack_codes)

FP4_MAX = 6.0
QUANT_METHOD = FMT
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def check(blocks: np.ndarray, scales: np.ndarray, name: str) -> None:
    """Refuses blocks and scales that are not uint8 `[..., G, 16]` and `[..., G]`, and the
    NaN scale byte 0xFF (e8m0 has no other special value)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise WeightsError(name, f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} "
                                 f"and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise WeightsError(name, f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not "
                                 f"match ([..., G, {BLOCK // 2}] and [..., G])")
    if np.any(scales == 0xFF):
        raise WeightsError(name, "MXFP4 scale 0xFF (NaN) in the checkpoint")


def codes(blocks: np.ndarray, name: str = "mxfp4") -> np.ndarray:
    """uint8 [..., G, 16] blocks -> uint8 [..., G * 32] e2m1 codes (low nibble first)."""
    check(blocks, np.zeros(blocks.shape[:-1], np.uint8), name)
    return unpack_codes(blocks).reshape(*blocks.shape[:-2], -1)


def exponents(scales: np.ndarray) -> np.ndarray:
    """e8m0 scale bytes [..., G] -> int32 powers of two (`scale - 127`)."""
    return scales.astype(np.int32) - E8M0_BIAS


def decode(blocks: np.ndarray, scales: np.ndarray, name: str = "mxfp4") -> np.ndarray:
    """float32 [..., G * 32]: the values of `blocks` [..., G, 16] scaled by `scales` [..., G]."""
    check(blocks, scales, name)
    return block_values(blocks, scales)


def encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The MXFP4 blocks [..., N / 32, 16] and scales [..., N / 32] of `w` [..., N]: each
    block's scale the smallest power of two that puts its largest |value| within 6, each
    value the nearest FP4 value (ties toward the smaller magnitude). N must be a multiple
    of 32."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"encode: the last axis ({w.shape[-1]}) is not a multiple of {BLOCK}")
    blocks = w.reshape(*w.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = np.max(np.abs(blocks), axis=-1)  # [..., G]
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / FP4_MAX)), 0)
    exp = np.clip(exp, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1), exp)[..., None]
    magnitudes = np.asarray(FP4_VALUES[:8], np.float32)
    nearest = np.argmin(np.abs(np.abs(scaled)[..., None] - magnitudes), axis=-1)  # first: even
    code = (nearest | np.where(np.signbit(scaled), 8, 0)).astype(np.uint8)  # [..., G, 32]
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    # C order: a strided view (of a transposed weight) would be written wrong by writers that
    # take the buffer as it is (safetensors)
    return (np.ascontiguousarray(packed, np.uint8),
            np.ascontiguousarray(exp + E8M0_BIAS, np.uint8))


def split_gate_up(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The gate and up halves of an interleaved gate_up array along `axis` (even and odd)."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, None, 2)
    gate = x[tuple(index)]
    index[axis] = slice(1, None, 2)
    return gate, x[tuple(index)]
