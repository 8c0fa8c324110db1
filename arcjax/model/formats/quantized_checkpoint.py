"""Quantized checkpoints as the Hub publishes them: FP8 and INT8 weights read into
`QuantizedWeight`s, AWQ / GPTQ / compressed-tensors packed weights into `PackedWeight`s.

1. `quant_config.checkpoint_quantization(model_dir)` reads config.json's
   `quantization_config` (None for a float checkpoint, which `hf_checkpoint.py` loads) and
   refuses what cannot load before any weight is read.
2. `quantized_host(model_dir, quant, dtype)` reads the whole checkpoint into host memory:
   linear weights (experts' too, one tensor per layer and expert, stacked [L, E, ...]) as
   stored (values + scales, `stack_layer_weight`; packed codes + group scales,
   `packed_layouts`), the rest in the compute dtype through `hf_layout.assemble_host`,
   and the KV-cache scales when the checkpoint has them.

The FP8 / INT8 methods and layouts read:

- `quant_method: "fp8"` (transformers' fine-grained FP8: Qwen3-*-FP8, DeepSeek-V3):
  `weight` float8_e4m3fn [out, in] + `weight_scale_inv` (a multiplier, despite the name)
  of [ceil(out / 128), ceil(in / 128)] (`weight_block_size`), or per tensor / per channel;
- `quant_method: "compressed-tensors"` (llm-compressor, RedHatAI/neuralmagic FP8 and
  W8A16 INT8): formats `float-quantized`, `naive-quantized`, `int-quantized`; `weight` FP8
  or INT8 + `weight_scale` per tensor [1], per channel [out, 1] or per block; symmetric
  only. A `kv_cache_scheme` brings `self_attn.k_scale` / `v_scale` (one per layer).

The layout of each weight is read off its scale's shape, so any of the three works in
either format. Activation scales (`input_scale`) are not used: weights are dequantized
into the compute dtype (W8A16). A layer weight stored in float in some layers and
quantized (or packed) in others (an `ignore` list naming single layers) is dequantized to
float.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from arcjax.errors import WeightsError
from arcjax.model.formats.hf_layout import (HostModel, assemble_host, hf_layer_name, layer_stacks,
                                            read_config)
from arcjax.model.formats.packed_layouts import read_awq, read_gptq, read_pack_quantized
from arcjax.model.formats.quant_config import CheckpointQuant
from arcjax.model.packed import PackedWeight, stack_packed
from arcjax.model.quant import LINEAR_WEIGHTS, QuantizedWeight
from arcjax.model.specs import param_specs

# safetensors dtype names -> numpy (ml_dtypes for the 8-bit floats numpy lacks).
_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
           "F64": np.float64, "I8": np.int8, "U8": np.uint8, "I16": np.int16,
           "I32": np.int32, "I64": np.int64}
_QUANTIZED = {np.dtype(ml_dtypes.float8_e4m3fn): "fp8", np.dtype(np.int8): "int8"}


class RawSafetensors:
    """Reads safetensors tensors of any dtype (numpy's loader lacks float8) by header."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self.header = json.loads(fh.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(path, f"not a readable safetensors file ({e})") from e
        self.header.pop("__metadata__", None)
        self._base = 8 + n

    def dtype(self, name: str):
        return np.dtype(_DTYPES[self.header[name]["dtype"]])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise WeightsError(self.path, f"tensor {name}: dtype {info['dtype']} unsupported")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - start != count * dtype.itemsize:
            raise WeightsError(self.path, f"tensor {name}: {end - start} bytes for shape "
                                          f"{info['shape']} {info['dtype']}")
        try:
            arr = np.memmap(self.path, dtype, "r", self._base + start, (count,))
        except ValueError as e:
            raise WeightsError(self.path, f"tensor {name} cannot be read ({e})") from e
        return np.asarray(arr).reshape(info["shape"])


def open_raw(model_dir: Path) -> dict[str, RawSafetensors]:
    """Tensor name -> the file holding it (model.safetensors or the index's shards)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise WeightsError(index, f"not a valid safetensors index ({e!r})") from e
    else:
        files = ["model.safetensors"]
    out = {}
    for fname in files:
        if not (model_dir / fname).is_file():
            raise WeightsError(model_dir / fname, "safetensors file is missing")
        raw = RawSafetensors(model_dir / fname)
        out.update({name: raw for name in raw.header})
    return out


def _scale_layout(scale: np.ndarray, out: int, n_in: int, block, where, name):
    """(scale [nbi, nbo] float32, block (bi, bo)) in our [in, out] orientation."""
    s = np.asarray(scale, np.float32)
    if s.size == 1:
        return s.reshape(1, 1), (n_in, out)
    if s.shape in ((out,), (out, 1)):
        return s.reshape(1, out), (n_in, 1)
    if block is None and s.ndim == 2:  # block size from the shapes when the config omits it
        bo, bi = -(-out // s.shape[0]), -(-n_in // s.shape[1])
        block = (bo, bi)
    if block is not None and s.shape == (-(-out // block[0]), -(-n_in // block[1])):
        return np.ascontiguousarray(s.T), (block[1], block[0])
    raise WeightsError(where, f"{name}: scale of shape {s.shape} fits no layout of a weight "
                              f"[{out}, {n_in}] (per tensor, per channel, blocks {block})")


def read_packed(tensors: dict, name: str, quant: CheckpointQuant, rows: int):
    """One linear weight of a packed checkpoint: a `PackedWeight` [in, out] (host), or a
    float array [in, out] for a layer the checkpoint left unquantized."""
    base = name[:-len(".weight")]
    packed_name = f"{base}.weight_packed" if quant.fmt == "pack-quantized" else f"{base}.qweight"
    if packed_name not in tensors:
        return tensors[name].get(name).T if name in tensors else None
    where = tensors[packed_name].path

    def get(n):
        return tensors[n].get(n) if n in tensors else None

    if quant.fmt == "awq":
        return read_awq(get, base, rows, where)
    if quant.fmt == "gptq":
        return read_gptq(get, base, rows, quant.bits, quant.zero_plus_one, where)
    return read_pack_quantized(get, base, rows, quant.bits, quant.symmetric, where)


def read_quantized(tensors: dict, name: str, quant: CheckpointQuant):
    """One linear weight in our [in, out] orientation: a float array, or
    (values [in, out], scale [nbi, nbo], block) when stored quantized."""
    raw = tensors[name]
    values = raw.get(name)
    if values.dtype not in _QUANTIZED:
        return values.T
    base = name[:-len(".weight")]
    scale_name = next((n for n in (f"{base}.weight_scale_inv", f"{base}.weight_scale")
                       if n in tensors), None)
    if scale_name is None:
        raise WeightsError(raw.path, f"{name} is {values.dtype} but has no weight_scale")
    if f"{base}.weight_zero_point" in tensors:
        raise WeightsError(raw.path, f"{name}: asymmetric (zero-point) quantization is not "
                                     "supported")
    out, n_in = values.shape
    scale, block = _scale_layout(tensors[scale_name].get(scale_name), out, n_in, quant.block,
                                 raw.path, name)
    return np.ascontiguousarray(values.T), scale, block


def stack_layer_weight(reads: list, np_dtype, lead: tuple[int, ...] | None = None):
    """One stacked layer weight from per-layer (or per layer and expert, in row-major
    order) `read_quantized` / `read_packed` results, shaped `lead + one matrix` (lead:
    (L,) by default, (L, E) for experts): a `QuantizedWeight` or `PackedWeight` of numpy
    arrays when every matrix is stored alike, else float."""
    lead = (len(reads),) if lead is None else tuple(lead)

    def stack(arrays):
        out = np.stack(arrays)
        return out.reshape(lead + out.shape[1:])

    if all(isinstance(r, PackedWeight) for r in reads):
        stacked = stack_packed(reads, lead)
        if stacked is not None:
            return stacked
    quantized = [r for r in reads if isinstance(r, tuple)]
    if len(quantized) == len(reads) and len({(r[0].dtype, r[1].shape, r[2])
                                             for r in reads}) == 1:
        return QuantizedWeight(stack([r[0] for r in reads]), stack([r[1] for r in reads]),
                               reads[0][2])
    out = []
    for r in reads:
        if isinstance(r, PackedWeight):
            r = np.asarray(jax.device_get(jax.jit(lambda w: w.dequantize(jnp.float32))(r)))
        elif isinstance(r, tuple):
            values, scale, (bi, bo) = r
            s = np.repeat(np.repeat(scale, bi, 0)[:values.shape[0]], bo, 1)[:, :values.shape[1]]
            r = values.astype(np.float32) * s
        out.append(r.astype(np_dtype))
    return stack(out)


def read_kv_scales(tensors: dict, num_layers: int) -> np.ndarray | None:
    """[2, L] float32 (k, v) from `self_attn.k_scale`/`v_scale` (or the older
    `k_proj.output_scale`/`v_proj.output_scale`), None unless every layer has both."""
    out = np.ones((2, num_layers), np.float32)
    for i in range(num_layers):
        for j, (new, old) in enumerate((("k_scale", "k_proj.output_scale"),
                                        ("v_scale", "v_proj.output_scale"))):
            names = [f"model.layers.{i}.self_attn.{n}" for n in (new, old)]
            name = next((n for n in names if n in tensors), None)
            if name is None:
                return None
            out[j, i] = float(np.asarray(tensors[name].get(name), np.float32).reshape(-1)[0])
    return out


def quantized_host(model_dir: Path, quant: CheckpointQuant, dtype) -> HostModel:
    """The quantized checkpoint in `model_dir` in host memory (see the module docstring).

    Raises:
      ModelConfigError: config.json is missing or malformed.
      WeightsError: a tensor is missing, unreadable or of a shape the config disagrees with.
    """
    cfg = read_config(model_dir)
    tensors = open_raw(model_dir)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def where(name):
        return tensors[name].path if name in tensors else model_dir

    def read(name):
        return tensors[name].get(name) if name in tensors else None

    all_specs = param_specs(cfg)
    keys = tuple(k for k in LINEAR_WEIGHTS if any(k in all_specs[s] for s in layer_stacks(cfg)))
    host = assemble_host(cfg, read, dtype, where, skip=keys)
    for stack, first, key in ((s, f, k) for s, f in layer_stacks(cfg).items() for k in keys
                              if k in all_specs[s]):
        specs = all_specs[stack]  # each stack counts its layers from the model's `first`
        lead = specs[key].shape[:2] if specs[key].axes[1] == "expert" else specs[key].shape[:1]
        want = specs[key].shape[len(lead):]
        reads = []
        for index in np.ndindex(*lead):  # (layer,) or (layer, expert) in the stack
            name = hf_layer_name(cfg, key, first + index[0], *index[1:])
            if quant.packed:
                r = read_packed(tensors, name, quant, want[0])
            elif name in tensors:
                r = read_quantized(tensors, name, quant)
            else:
                r = None
            if r is None:
                raise WeightsError(model_dir, f"tensor {name} is missing from the checkpoint")
            shape = tuple((r[0] if isinstance(r, tuple) else r).shape)
            if shape != tuple(want):
                raise WeightsError(where(name), f"tensor {name} has shape {shape[::-1]}, the "
                                                f"config implies {want[::-1]}")
            reads.append(r)
        host[stack][key] = stack_layer_weight(reads, np_dtype, lead)
    return HostModel(cfg, host, read_kv_scales(tensors, cfg.num_layers))
