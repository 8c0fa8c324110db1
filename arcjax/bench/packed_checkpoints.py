"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints written from a float
checkpoint by a numpy reference of each published layout (see
arcjax/model/formats/packed_layouts.py for the layouts and the tools they follow), beside a
float checkpoint of the same weights dequantized in float32: the reference a packed
checkpoint must reproduce (tests/test_quant4_*.py against transformers on it, and
scripts/bench_quant.py's random mixture of experts with 4-bit experts). Round-to-nearest
min-max quantization, not AWQ's or GPTQ's search: the layouts are what is under test.

`packed_checkpoint(src, method, bits=4, group=32, symmetric=..., desc_act=...)` returns
(packed dir, dequantized dir). Every linear projection is quantized (the experts' too); the
embedding, norms, routers and the LM head stay float, as the tools leave them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Hugging Face linear modules the tools quantize (Mixtral's experts: w1, w2, w3).
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)"
                    r"\.weight$")


def pack_along_last(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes [..., n] -> int32 words [..., ceil(n * bits / 32)], element i at bit
    i * bits (compressed-tensors' `pack_to_int32` order; GPTQ's along its axis)."""
    per = 32 // bits
    n = codes.shape[-1]
    pad = -n % per
    c = np.concatenate([codes.astype(np.uint64), np.zeros((*codes.shape[:-1], pad),
                                                           np.uint64)], axis=-1)
    c = c.reshape(*codes.shape[:-1], -1, per) << (np.arange(per, dtype=np.uint64) * bits)
    return c.sum(axis=-1).astype(np.uint32).view(np.int32)


def _quantize(w: np.ndarray, bits: int, groups: np.ndarray, n_groups: int, symmetric: bool,
              scale_dtype, zero_min: int):
    """w [out, in] quantized per (row group of the input axis, output).

    Returns (codes [out, in] unsigned, scale [G, out] scale_dtype, zero [G, out] int,
    dequantized [out, in] float32): w ~ (codes - zero) * scale.
    """
    qmax = (1 << bits) - 1
    out_dim = w.shape[0]
    scale = np.zeros((n_groups, out_dim), np.float32)
    zero = np.zeros((n_groups, out_dim), np.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]  # [out, rows of group g]
        if symmetric:
            amax = np.abs(cols).max(axis=1)
            scale[g] = np.where(amax > 0, amax / (qmax // 2), 1.0)
            zero[g] = (qmax + 1) // 2
        else:
            lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
            scale[g] = np.where(hi > lo, (hi - lo) / qmax, 1.0)
            zero[g] = np.clip(np.round(-lo / scale[g]), zero_min, qmax)
    scale = scale.astype(scale_dtype)
    s_rows, z_rows = scale[groups].T.astype(np.float32), zero[groups].T  # [out, in]
    codes = np.clip(np.round(w / s_rows) + z_rows, 0, qmax).astype(np.int64)
    deq = ((codes - z_rows).astype(np.float32) * s_rows).astype(np.float32)
    return codes, scale, zero, deq


def _group_index(n_in: int, group: int | None, desc_act: bool, seed: int) -> np.ndarray:
    """Each input row's group: row // group, or (act-order) a random permutation's."""
    size = group or n_in
    if not desc_act:
        return np.arange(n_in) // size
    order = np.random.default_rng(seed).permutation(n_in)  # rows in quantization order
    g_idx = np.empty(n_in, np.int64)
    g_idx[order] = np.arange(n_in) // size
    return g_idx


def _tensors(base: str, w: np.ndarray, method: str, bits: int, group: int | None,
             symmetric: bool, desc_act: bool, gptq_v1: bool, seed: int):
    """(packed tensors of one linear layer, its dequantized float32 weight [out, in])."""
    out_dim, n_in = w.shape
    groups = _group_index(n_in, group, desc_act, seed)
    n_groups = int(groups.max()) + 1
    scale_dtype = np.float32 if method == "pack-quantized" else np.float16
    zero_min = 1 if method == "gptq" and gptq_v1 else 0  # v1 stores zero - 1 (>= 0)
    codes, scale, zero, deq = _quantize(w, bits, groups, n_groups, symmetric, scale_dtype,
                                        zero_min)
    codes_io = codes.T  # [in, out]
    if method == "awq":
        def awq_pack(x):  # [n, out] -> [n, out / 8], AutoAWQ's column order
            x = x.reshape(x.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
            return pack_along_last(x.reshape(x.shape[0], -1), 4)
        return {f"{base}.qweight": awq_pack(codes_io), f"{base}.qzeros": awq_pack(zero),
                f"{base}.scales": scale}, deq
    if method == "gptq":
        stored_zero = zero - 1 if gptq_v1 else zero
        return {f"{base}.qweight": pack_along_last(codes_io.T, bits).T.copy(),  # along in
                f"{base}.qzeros": pack_along_last(stored_zero, bits),
                f"{base}.scales": scale, f"{base}.g_idx": groups.astype(np.int32)}, deq
    # compressed-tensors stores signed values + 2**(bits - 1): our unsigned codes, zeros
    tensors = {f"{base}.weight_packed": pack_along_last(codes, bits),
               f"{base}.weight_scale": np.ascontiguousarray(scale.T),
               f"{base}.weight_shape": np.array([out_dim, n_in], np.int64)}
    if not symmetric:  # [G, out] packed along out, stored [out * bits / 32, G]
        tensors[f"{base}.weight_zero_point"] = np.ascontiguousarray(
            pack_along_last(zero, bits).T)
    if desc_act:
        tensors[f"{base}.weight_g_idx"] = groups.astype(np.int32)
    return tensors, deq


def _config(method: str, bits: int, group: int | None, symmetric: bool, desc_act: bool,
            gptq_v1: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group or -1,
                "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group or -1,
                "desc_act": desc_act, "sym": symmetric, "static_groups": False,
                "checkpoint_format": "gptq" if gptq_v1 else "gptq_v2"}
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group else "channel", "group_size": group,
               "dynamic": False, "actorder": "group" if desc_act else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


@functools.lru_cache(maxsize=None)
def packed_checkpoint(src: str, method: str, bits: int = 4, group: int | None = 32,
                      symmetric: bool = False, desc_act: bool = False,
                      gptq_v1: bool = True) -> tuple[str, str]:
    """(packed checkpoint dir, float dir of the same weights dequantized) of the float
    model `src` in `method` ("awq" | "gptq" | "pack-quantized"); group None: one scale
    per output channel; desc_act: rows in a random group order (g_idx)."""
    from safetensors.numpy import load_file, save_file

    state = load_file(os.path.join(src, "model.safetensors"))
    qdir = tempfile.mkdtemp(prefix=f"arcjax-{method}-")
    fdir = tempfile.mkdtemp(prefix=f"arcjax-{method}-deq-")
    packed, dequantized = {}, {}
    for i, (name, w) in enumerate(sorted(state.items())):
        if LINEAR.search(name):
            tensors, deq = _tensors(name[:-len(".weight")], w.astype(np.float32), method,
                                    bits, group, symmetric, desc_act, gptq_v1, seed=i)
            packed.update(tensors)
            dequantized[name] = deq
        else:
            packed[name] = dequantized[name] = w.astype(np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in packed.items()},
              os.path.join(qdir, "model.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in dequantized.items()},
              os.path.join(fdir, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(fdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    cfg["quantization_config"] = _config(method, bits, group, symmetric, desc_act, gptq_v1)
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return qdir, fdir
