"""Checks arcjax's AWQ / GPTQ / compressed-tensors layouts against the tools' own
dequantization, where the tools cannot be imported as packages.

AutoAWQ 0.2.9 and AutoGPTQ 0.7.1 do not import beside transformers 5 on a CPU (their
packages import CUDA extensions and removed transformers names), but the functions that
define their layouts are plain torch: AutoAWQ's `awq/utils/packing_utils.py`
(`dequantize_gemm`) and AutoGPTQ's `auto_gptq/nn_modules/qlinear/qlinear_cuda.py`
(`QuantLinear`, whose forward dequantizes in torch without its extension). This loads
those two files by path from the published archives and compares, for every linear layer
of a random model written by `arcjax.bench.packed_checkpoints`, the tool's dequantized
weight with the float32 weight the checkpoint's reference holds (and arcjax loads),
bit for bit. compressed-tensors imports normally: its decompressor is checked too.

  pip download --no-deps autoawq==0.2.9 auto-gptq==0.7.1 -d wheels
  (unpack both) python scripts/check_packed_layouts.py \\
      --awq_packing_utils=autoawq-0.2.9/awq/utils/packing_utils.py \\
      --gptq_qlinear=auto_gptq/nn_modules/qlinear/qlinear_cuda.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import tempfile

import numpy as np
from absl import app

from arcjax.entrypoints.flags import config_from_flags, define_flags


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig:
    awq_packing_utils: str = ""  # AutoAWQ's awq/utils/packing_utils.py
    gptq_qlinear: str = ""  # AutoGPTQ's auto_gptq/nn_modules/qlinear/qlinear_cuda.py
    hidden: int = 128


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _float_model(hidden: int) -> str:
    import jax
    import jax.numpy as jnp

    from arcjax.model.formats.hf_checkpoint import save_hf
    from arcjax.model.model_config import ModelConfig
    from arcjax.model.specs import init_params

    cfg = ModelConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=2, num_heads=hidden // 32, num_kv_heads=hidden // 64,
                      head_dim=32, max_position_embeddings=128)
    path = tempfile.mkdtemp(prefix="arcjax-layouts-")
    save_hf(init_params(cfg, jax.random.key(0), jnp.float32), cfg, path)
    return path


def _layers(qdir: str, fdir: str):
    """(module name, packed tensors, the reference's float32 weight [out, in]) per layer."""
    from safetensors.numpy import load_file

    packed = load_file(os.path.join(qdir, "model.safetensors"))
    ref = load_file(os.path.join(fdir, "model.safetensors"))
    for name, w in ref.items():
        base = name[:-len(".weight")]
        if f"{base}.qweight" in packed or f"{base}.weight_packed" in packed:
            yield base, {k[len(base) + 1:]: v for k, v in packed.items()
                         if k.startswith(base + ".")}, w


def main(_):
    import torch

    from arcjax.bench.packed_checkpoints import packed_checkpoint

    cfg = config_from_flags(CheckConfig)
    src = _float_model(cfg.hidden)
    report = {}
    if cfg.awq_packing_utils:
        awq = _load(cfg.awq_packing_utils, "awq_packing_utils")
        qdir, fdir = packed_checkpoint(src, "awq", group=32)
        report["awq"] = all(np.array_equal(awq.dequantize_gemm(
            torch.from_numpy(t["qweight"]), torch.from_numpy(t["qzeros"]),
            torch.from_numpy(t["scales"]).float(), 4, 32).numpy().T, w)
            for _, t, w in _layers(qdir, fdir))
    if cfg.gptq_qlinear:
        gptq = _load(cfg.gptq_qlinear, "gptq_qlinear")
        for bits, group, act in ((4, 32, False), (4, 32, True), (8, 32, False), (2, None, False)):
            qdir, fdir = packed_checkpoint(src, "gptq", bits=bits, group=group, desc_act=act)
            ok = True
            for _, t, w in _layers(qdir, fdir):
                out_f, in_f = w.shape
                layer = gptq.QuantLinear(bits, group or in_f, in_f, out_f, False,
                                         weight_dtype=torch.float32)
                layer.qweight, layer.qzeros = (torch.from_numpy(t["qweight"]),
                                               torch.from_numpy(t["qzeros"]))
                layer.scales = torch.from_numpy(t["scales"]).float()
                layer.g_idx = torch.from_numpy(t["g_idx"])
                with torch.no_grad():
                    ok &= np.array_equal(layer(torch.eye(in_f)).numpy().T, w)
            report[f"gptq bits={bits} group={group} desc_act={act}"] = bool(ok)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    for symmetric, group in ((True, 32), (False, 32), (False, None)):
        qdir, fdir = packed_checkpoint(src, "pack-quantized", group=group, symmetric=symmetric)
        with open(os.path.join(qdir, "config.json")) as f:
            weights = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]
        args = QuantizationArgs(**{k: v for k, v in weights.items() if k != "actorder"})
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        report[f"compressed-tensors symmetric={symmetric} group={group}"] = all(
            np.array_equal(PackedQuantizationCompressor.decompress(
                {k: torch.from_numpy(v) for k, v in t.items()}, scheme)["weight"].numpy(), w)
            for _, t, w in _layers(qdir, fdir))
    for name, ok in report.items():
        print(f"{name}: {'identical' if ok else 'DIFFERENT'}")
    if not all(report.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    define_flags(CheckConfig)
    app.run(main)
