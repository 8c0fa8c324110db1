"""Hugging Face checkpoints <-> the arcjax params pytree.

1. `load_hf(model_dir, dtype)` reads config.json, then every tensor of
   model.safetensors (or the shards listed in model.safetensors.index.json) through a
   read-only memory map, converts it once into its slot of the stacked params tree
   (no second full copy in host memory), and moves it to the device.
2. With `cache_dir`, the converted params are saved with orbax-checkpoint under a
   key of (files, sizes, mtimes, dtype) and restored from there next time.
3. `save_hf(params, cfg, out_dir)` writes config.json + model.safetensors with
   Hugging Face tensor names, so transformers loads arcjax-trained models.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from arcjax.config import SUPPORTED_ARCHITECTURES, ModelConfig
from arcjax.model import ParamSpec, Params, param_specs


class WeightsError(ValueError):
    """A checkpoint arcjax cannot load; the message names the file and the tensor."""


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}

# arcjax name -> (Hugging Face name pattern, transpose). "{i}" is the layer index.
_LAYER_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "bo": ("model.layers.{i}.self_attn.o_proj.bias", False),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{path}: config.json not found (supported architectures: "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except (KeyError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: cannot read config ({e!r})") from e


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header") from e
    return header, 8 + n


class _SafetensorsFile:
    """Zero-copy tensor views over one memory-mapped safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        self.header, self.offset = _read_header(path)
        self.header.pop("__metadata__", None)
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")

    def get(self, name: str) -> np.ndarray:
        meta = self.header[name]
        if meta["dtype"] not in _ST_DTYPES:
            raise WeightsError(f"{self.path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        buf = self.mm[self.offset + start:self.offset + end]
        return buf.view(_ST_DTYPES[meta["dtype"]]).reshape(meta["shape"])


def _open_checkpoint(model_dir: Path) -> dict[str, _SafetensorsFile]:
    """Maps each tensor name to the open file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {}
        for fname in sorted(set(weight_map.values())):
            if not (model_dir / fname).is_file():
                raise WeightsError(f"{model_dir / fname}: shard listed in {index.name} is missing")
            files[fname] = _SafetensorsFile(model_dir / fname)
        out = {}
        for name, fname in weight_map.items():
            if name not in files[fname].header:
                raise WeightsError(f"{model_dir / fname}: tensor {name} listed in {index.name} "
                                   "is not in the shard")
            out[name] = files[fname]
        return out
    if single.is_file():
        f = _SafetensorsFile(single)
        return {name: f for name in f.header}
    raise WeightsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _hf_entries(cfg: ModelConfig):
    """Yields (path in params tree, layer index or None, HF name, transpose)."""
    specs = param_specs(cfg)
    for key in specs:
        if key == "layers":
            for lkey in specs["layers"]:
                pattern, t = _LAYER_NAMES[lkey]
                for i in range(cfg.num_layers):
                    yield ("layers", lkey), i, pattern.format(i=i), t
        else:
            name, t = _TOP_NAMES[key]
            yield (key,), None, name, t


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def load_hf(model_dir: str | os.PathLike, dtype=jnp.float32,
            cache_dir: str | os.PathLike | None = None) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face model directory into (config, params on device).

    Args:
      model_dir: directory with config.json and safetensors weights.
      dtype: the params' dtype (converted once, tensor by tensor).
      cache_dir: if set, converted params are cached there with orbax-checkpoint.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    key = None
    if cache_dir is not None:
        key = _cache_key(model_dir, dtype)
        restored = _restore_cached(Path(cache_dir) / key, cfg, dtype)
        if restored is not None:
            return cfg, restored
    tensors = _open_checkpoint(model_dir)
    specs = param_specs(cfg)
    np_dtype = np.dtype(jnp.dtype(dtype))
    host = jax.tree.map(lambda s: np.empty(s.shape, np_dtype), specs,
                        is_leaf=lambda x: isinstance(x, ParamSpec))
    for path, layer, name, transpose in _hf_entries(cfg):
        if name not in tensors:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise WeightsError(f"{model_dir}: tensor {name} is missing from the checkpoint "
                               f"(architecture {cfg.architecture})")
        arr = tensors[name].get(name)
        arr = arr.T if transpose else arr
        dst = _get(host, path)
        want = dst.shape[1:] if layer is not None else dst.shape
        if tuple(arr.shape) != tuple(want):
            raise WeightsError(f"{tensors[name].path}: tensor {name} has shape "
                               f"{tuple(tensors[name].get(name).shape)}, config.json implies "
                               f"{tuple(want[::-1]) if transpose else tuple(want)}")
        if layer is None:
            dst[...] = arr
        else:
            dst[layer] = arr
    params = jax.tree.map(jnp.asarray, host)
    if key is not None:
        _save_cached(Path(cache_dir) / key, params)
    return cfg, params


def _cache_key(model_dir: Path, dtype) -> str:
    h = hashlib.sha256(str(jnp.dtype(dtype)).encode())
    for f in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _restore_cached(path: Path, cfg: ModelConfig, dtype) -> Params | None:
    if not path.exists():
        return None
    import orbax.checkpoint as ocp

    specs = param_specs(cfg)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), specs,
                          is_leaf=lambda x: isinstance(x, ParamSpec))
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path.resolve(), target)


def _save_cached(path: Path, params: Params) -> None:
    import orbax.checkpoint as ocp

    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path.resolve(), params)


def save_hf(params: Params, cfg: ModelConfig, out_dir: str | os.PathLike,
            dtype=jnp.float32) -> None:
    """Writes config.json and model.safetensors (Hugging Face names) to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = str(jnp.dtype(dtype))
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    np_dtype = np.dtype(jnp.dtype(dtype))
    tensors = {}
    for path, layer, name, transpose in _hf_entries(cfg):
        arr = np.asarray(_get(params, path))
        arr = arr[layer] if layer is not None else arr
        tensors[name] = np.ascontiguousarray((arr.T if transpose else arr).astype(np_dtype))
    write_safetensors(out / "model.safetensors", tensors)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (also for bfloat16, which numpy lacks natively)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(arr.tobytes())
