"""Quantized checkpoints written from the tiny test models, as the quantizers that make them
would: FP8 (e4m3) or INT8 weights with per-tensor, per-channel or 128 x 128 block scales
(compressed-tensors, or block FP8's `weight_scale_inv`), optional FP8 KV-cache scales, and
gpt-oss with MXFP4 experts in the published layout (`mxfp4_twins`); each with a float twin
holding the same weights dequantized (the transformers reference)."""

from __future__ import annotations

import functools
import json
import os

import ml_dtypes
import numpy as np

from support.gguf_files import tiny_gguf_model_dir
from support.scratch import scratch_dir

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
          # DeepSeek's latent attention
          "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
KV_SCALES = (0.02, 0.02)  # checkpoint k_scale / v_scale (values up to 8.96)


def quantize_np(w: np.ndarray, layout: str, fmt: str, block: int = 128):
    """(values, scale as stored, dequantized float32) of a weight [out, in]; "block": one
    scale per `block` x `block` tile (the last row and column of tiles may be partial, as
    DeepSeek-V3's `weight_scale_inv` covers them)."""
    qmax = 448.0 if fmt == "fp8" else 127.0
    if layout == "tensor":
        scale = np.abs(w).max().reshape(1) / qmax
        full = np.broadcast_to(scale.reshape(1, 1), w.shape)
    elif layout == "channel":
        scale = np.abs(w).max(axis=1, keepdims=True) / qmax  # [out, 1]
        full = np.broadcast_to(scale, w.shape)
    else:  # block x block tiles
        o, i = w.shape
        po, pi = -(-o // block) * block, -(-i // block) * block
        padded = np.zeros((po, pi), w.dtype)
        padded[:o, :i] = np.abs(w)
        blocks = padded.reshape(po // block, block, pi // block, block).max(axis=(1, 3))
        scale = np.where(blocks > 0, blocks, 1.0) / qmax
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:o, :i]
    scale = scale.astype(np.float32)
    q = w / full
    if fmt == "fp8":
        values = np.clip(q, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn)
    else:
        values = np.clip(np.round(q), -qmax, qmax).astype(np.int8)
    return values, scale, values.astype(np.float32) * full.astype(np.float32)


def _quantization_config(layout: str, fmt: str, kv_scales: bool, block: int = 128) -> dict:
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [block, block]}
    weights = {"num_bits": 8, "type": "float" if fmt == "fp8" else "int", "symmetric": True,
               "strategy": layout, "dynamic": False}
    out = {"quant_method": "compressed-tensors",
           "format": "float-quantized" if fmt == "fp8" else "int-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
           "ignore": ["lm_head"]}
    if kv_scales:
        out["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    return out


def quantized_checkpoint(layout: str, fmt: str = "fp8", kv_scales: bool = False,
                         src: str | None = None, block: int = 128):
    """(quantized checkpoint dir, float dir of the same weights dequantized); `src`: the
    float model (a mixture of experts gets one quantized tensor per layer and expert);
    `block`: the tile of the "block" layout."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    src = src or tiny_gguf_model_dir("LlamaForCausalLM")
    state = load_file(os.path.join(src, "model.safetensors"))
    qdir, fdir = scratch_dir("arcjax-q-"), scratch_dir("arcjax-dq-")
    quantized, dequantized = {}, {}
    for name, w in state.items():
        if any(f".{p}.weight" in name for p in LINEAR):
            values, scale, deq = quantize_np(w.astype(np.float32), layout, fmt, block)
            base = name[:-len(".weight")]
            suffix = "weight_scale_inv" if layout == "block" else "weight_scale"
            quantized[name] = torch.from_numpy(values.view(np.uint8 if fmt == "fp8" else np.int8))
            if fmt == "fp8":
                quantized[name] = quantized[name].view(torch.float8_e4m3fn)
            quantized[f"{base}.{suffix}"] = torch.from_numpy(scale)
            dequantized[name] = torch.from_numpy(deq)
        else:
            quantized[name] = dequantized[name] = torch.from_numpy(w.copy())
    if kv_scales:
        for i in range(2):
            quantized[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(KV_SCALES[0])
            quantized[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(KV_SCALES[1])
    save_file(quantized, os.path.join(qdir, "model.safetensors"))
    save_file(dequantized, os.path.join(fdir, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(fdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    cfg["quantization_config"] = _quantization_config(layout, fmt, kv_scales, block)
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return qdir, fdir


@functools.lru_cache(maxsize=None)
def mxfp4_twins() -> tuple[str, str]:
    """The tiny random gpt-oss with its experts in the published MXFP4 layout
    (`quant_method: "mxfp4"`, `*_blocks` / `*_scales`), and its float twin whose experts are
    the decoded values: what transformers runs as the reference."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from arcjax.model.formats import mxfp4
    from support.hf_models import GPT_OSS, tiny_model_dir

    src = tiny_model_dir(GPT_OSS)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, decoded = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.rsplit(".", 1)[-1] in mxfp4.EXPERT_TENSORS:  # [E, in, out] -> [E, out, in]
            blocks, scales = mxfp4.encode(np.swapaxes(w, 1, 2))
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            decoded[name] = np.ascontiguousarray(
                np.swapaxes(mxfp4.decode(blocks, scales), 1, 2).astype(w.dtype))
    dirs = []
    for kind, weights in (("mxfp4", packed), ("decoded", decoded)):
        path = scratch_dir(f"arcjax-gpt-oss-{kind}-")
        shutil.copy(os.path.join(src, "config.json"), path)
        save_file(weights, os.path.join(path, "model.safetensors"))
        dirs.append(path)
    with open(os.path.join(dirs[0], "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(os.path.join(dirs[0], "config.json"), "w") as f:
        json.dump(cfg, f)
    return dirs[0], dirs[1]
