"""`load_model(source, ...)`: any supported checkpoint into (config, params on the devices).

The loader picks the format and asks that format's module for the model; each module reads
its own files completely (the config.json and tensor-name layout they share is
`hf_layout.py`'s, which imports no format):

1. A GGUF file: `gguf_file.gguf_host` reads it into host params, the linear weights,
   embedding and LM head of GGUF's quant types kept packed (`PackedWeight`s; the other
   tensors dequantized), then `_place`.
2. A Hugging Face directory whose config.json has a `quantization_config` (FP8 / INT8,
   AWQ, GPTQ, compressed-tensors; `quant_config.checkpoint_quantization`, whose typed
   errors come before any weight loads): `quantized_checkpoint.quantized_host` reads
   linear weights (experts' too) as stored (values + scales, or packed codes + group
   scales) and the rest in the compute dtype, with the KV-cache scales when the
   checkpoint has them; then `_place`.
3. gpt-oss's MXFP4 checkpoints (`quant_method: "mxfp4"`), and gpt-oss under tensor or
   expert parallelism: `hf_checkpoint.hf_host` reads the whole checkpoint into host memory
   (its experts fused per layer read per expert: `fused_experts`), then `_place`. MXFP4
   experts stay MXFP4 on the devices (`Mxfp4Weight`, dequantized inside the grouped
   GEMMs); `quantization="dequantize"` decodes them at load into the compute dtype.
4. Any other Hugging Face directory: `hf_checkpoint.load_hf` returns params already on the
   devices (its orbax cache, and its sharded reads with tensor parallelism: the shardings
   come from `parallel` here).
5. `quantization="fp8" | "int8"` then quantizes the float linear weights (experts' too,
   per expert and output channel) on the devices
   (`quant.quantize_params`), in their shardings; a GGUF file is dequantized at load
   first. `quantization="dequantize"` stores every weight in the compute dtype instead
   (a GGUF file dequantized at load, a quantized checkpoint's weights dequantized once on
   the devices): the baseline packed and quantized weights are compared with.

Placing host params on several devices (`_place`) repeats KV heads as many times as the
`parallel` object passed in says (`kv_repeat`; for a quantized weight, its scale columns
too). The model package never imports the parallel one: the caller passes it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.errors import EngineConfigError
from arcjax.model.formats.gguf_config import gguf_config
from arcjax.model.formats.gguf_file import GGUFFile, gguf_host
from arcjax.model.formats import fused_experts, mxfp4
from arcjax.model.formats.hf_checkpoint import hf_host, load_hf
from arcjax.model.formats.hf_layout import HostModel, read_config
from arcjax.model.formats.hub import ModelSource
from arcjax.model.formats.quant_config import checkpoint_quantization
from arcjax.model.formats.quantized_checkpoint import quantized_host
from arcjax.model.model_config import ModelConfig
from arcjax.model.packed import PackedWeight
from arcjax.model.quant import (LINEAR_WEIGHTS, PACKED, QuantizedWeight, dense, quantize,
                                quantize_params, quantized_specs)
from arcjax.model.specs import Params, param_specs


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What `load_model` returns.

    Attributes:
      cfg: the model config (the sharded one with tensor parallelism).
      params: the params on the devices.
      kv_scales: [2, L] float32 (K and V scale per layer) from the checkpoint, or None.
      gguf_file: the opened GGUF file (its tokenizer and template live there), or None.
    """

    cfg: ModelConfig
    params: Params
    kv_scales: np.ndarray | None = None
    gguf_file: GGUFFile | None = None


def model_config(source: ModelSource) -> ModelConfig:
    """The model's config without loading weights."""
    if source.is_gguf:
        return gguf_config(GGUFFile(source.path))
    return read_config(source.path)


def load_model(source: ModelSource, *, dtype, cache_dir=None, parallel=None,
               quantization: str | None = None) -> LoadedModel:
    """Loads `source` (see the module docstring).

    Args:
      source: a resolved model (`arcjax.model.formats.hub.resolve_model`).
      dtype: the compute dtype (float params are stored in it).
      cache_dir: the orbax cache of converted float safetensors params (else unused).
      parallel: an `arcjax.parallel.TensorParallel` (passed in: the model package never
        imports the parallel one), or None for one device.
      quantization: None (weights as stored), "fp8" or "int8" (quantize float linear
        weights at load), "dequantize" (every weight in `dtype`).

    Raises:
      ModelFileError subclasses: the model cannot be loaded.
      EngineConfigError: `quantization` contradicts the checkpoint's own format.
    """
    kv_scales = gguf_file = None
    if source.is_gguf:
        gguf_file = GGUFFile(source.path)
        cfg, params = _place(gguf_host(gguf_file, dtype, packed=quantization is None),
                             parallel)
    else:
        ckpt = checkpoint_quantization(source.path)
        if ckpt is not None and quantization not in (None, "dequantize", ckpt.fmt):
            raise EngineConfigError("quantization", f"the checkpoint is {ckpt.fmt}; "
                                    f"it cannot be loaded as {quantization}")
        fused = read_config(source.path).architecture == fused_experts.ARCHITECTURE
        if ckpt is not None and ckpt.fmt != mxfp4.QUANT_METHOD:
            host = quantized_host(source.path, ckpt, dtype)
            kv_scales = host.kv_scales
            cfg, params = _place(host, parallel)
            if quantization == "dequantize":
                params = _dequantize(params, cfg, dtype, parallel)
        elif ckpt is not None or (fused and parallel is not None):
            # MXFP4 experts kept packed (or decoded at load: "dequantize"); fused experts
            # sharded from host memory (the sharded reader reads one tensor per expert)
            packed = ckpt is not None and quantization != "dequantize"
            cfg, params = _place(hf_host(source.path, dtype, mxfp4_packed=packed), parallel)
        else:
            cfg, params = _load_safetensors(source, dtype, cache_dir, parallel)
    if quantization in ("fp8", "int8"):
        shardings = None
        if parallel is not None:
            shapes = jax.eval_shape(lambda p: quantize_params_shapes(p, quantization), params)
            shardings = parallel.shardings(quantized_specs(param_specs(cfg), shapes))
        params = quantize_params(params, quantization, shardings)
    return LoadedModel(cfg, params, kv_scales, gguf_file)


def quantize_params_shapes(params: Params, fmt: str) -> Params:
    """`quantize_params` for `jax.eval_shape` (shapes only; deletes nothing)."""
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        if name in layers and not isinstance(layers[name], (QuantizedWeight, *PACKED)):
            layers[name] = quantize(layers[name], fmt)
    return {**params, "layers": layers}


def _is_stored(x) -> bool:
    return isinstance(x, (QuantizedWeight, *PACKED))


def _dequantize(params: Params, cfg: ModelConfig, dtype, parallel) -> Params:
    """Every quantized or packed weight dequantized to `dtype` on the devices (in the
    float params' shardings with `parallel`); the stored arrays are freed."""
    out = None if parallel is None else parallel.shardings(param_specs(cfg))
    dense_params = jax.jit(lambda p: jax.tree.map(
        lambda w: dense(w, dtype) if _is_stored(w) else w, p, is_leaf=_is_stored),
        out_shardings=out)(params)
    for w in jax.tree.leaves(params, is_leaf=_is_stored):
        if _is_stored(w):
            for x in jax.tree.leaves(w):
                x.delete()
    return dense_params


def _load_safetensors(source: ModelSource, dtype, cache_dir, parallel):
    """A float safetensors directory straight onto the devices (in its shards with
    `parallel`, each KV head stored as many times as `parallel` says)."""
    shards = {}
    if parallel is not None:
        file_cfg = read_config(source.path)
        repeat = parallel.kv_repeat(file_cfg)
        shards = dict(kv_repeat=repeat,
                      shardings=parallel.param_shardings(file_cfg.with_kv_repeat(repeat)))
    return load_hf(source.path, dtype=dtype, cache_dir=cache_dir, **shards)


def _repeat_kv(x, repeat: int, head_dim: int):
    """Columns [..., Hkv * D] -> [..., Hkv * repeat * D], each head repeated in place (a
    quantized weight's scales follow their columns)."""
    if isinstance(x, PackedWeight):  # every array's columns are the weight's
        return x.map_columns(lambda a: _repeat_kv(np.asarray(a), repeat, head_dim))
    if isinstance(x, QuantizedWeight):
        (bi, bo), values = x.block, _repeat_kv(x.values, repeat, head_dim)
        if x.scale.shape[-1] == 1:  # one scale across every column
            return QuantizedWeight(values, x.scale, (bi, bo * repeat))
        per_column = np.repeat(x.scale, bo, axis=-1)[..., :x.values.shape[-1]]
        return QuantizedWeight(values, _repeat_kv(per_column, repeat, head_dim), (bi, 1))
    heads = x.shape[-1] // head_dim
    y = x.reshape(*x.shape[:-1], heads, 1, head_dim)
    return np.broadcast_to(y, (*x.shape[:-1], heads, repeat, head_dim)).reshape(
        *x.shape[:-1], heads * repeat * head_dim)


def _place(model: HostModel, parallel) -> tuple[ModelConfig, Params]:
    """Host params onto one device, or into their shards over `parallel`'s mesh."""
    cfg, host = model.cfg, model.params
    if parallel is None:
        return cfg, jax.tree.map(jnp.asarray, host)
    repeat = parallel.kv_repeat(cfg)
    if repeat > 1:
        layers = dict(host["layers"])
        for key in ("wk", "wv", "bk", "bv"):
            if key in layers:
                layers[key] = _repeat_kv(layers[key], repeat, cfg.head_dim)
        host = {**host, "layers": layers}
    cfg = cfg.with_kv_repeat(repeat)
    shardings = parallel.shardings(quantized_specs(param_specs(cfg), host, parallel.degree))

    def put(x, sharding):
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return cfg, jax.tree.map(put, host, shardings)
