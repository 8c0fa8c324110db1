"""Float Hugging Face safetensors checkpoints <-> the arcjax params pytree, on the devices.
The config and the tensor names are `hf_layout.py`'s, shared with the other formats.

1. `load_hf(model_dir, dtype)` reads config.json, then every tensor of
   model.safetensors (or the shards listed in model.safetensors.index.json) through
   `safetensors.safe_open` (memory-mapped, validated by the library: truncated files and
   absurd headers are refused), converts it once into its slot of the stacked params
   tree (no second full copy in host memory), and moves it to the device.
   With `shardings` (a tree of shardings for the params, derived by the caller: the model
   package never imports the parallel one), every array is built in its shards instead
   (`jax.make_array_from_callback`): each device's block is read straight from the file
   through `get_slice` (only that block's bytes), so no device and no host buffer ever
   holds the whole model; each KV head is stored `kv_repeat` times.
2. With `cache_dir`, the converted params are saved with orbax-checkpoint under a
   key of (files, sizes, mtimes, dtype) and restored from there next time.
3. `save_hf(params, cfg, out_dir)` writes config.json + model.safetensors with
   Hugging Face tensor names, so transformers loads arcjax-trained models.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors needs)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from arcjax.errors import WeightsError
from arcjax.model.formats import fused_experts
from arcjax.model.formats.hf_layout import (TOP_NAMES, HostModel, assemble_host, hf_entries,
                                            layer_names, layer_stacks, read_config, tree_at)
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import Params, is_spec, param_specs


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except SafetensorError as e:
        raise WeightsError(path, f"not a readable safetensors file ({e})") from e
    except OSError as e:
        raise WeightsError(path, f"cannot open ({e})") from e


def _open_checkpoint(model_dir: Path) -> dict[str, tuple[Path, object]]:
    """Maps each tensor name to (file, open safe_open handle) that holds it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise WeightsError(index, f"not a valid safetensors index ({e!r})") from e
        files = {}
        for fname in sorted(set(weight_map.values())):
            if not (model_dir / fname).is_file():
                raise WeightsError(model_dir / fname, f"shard listed in {index.name} is missing")
            files[fname] = (model_dir / fname, _open(model_dir / fname))
        out = {}
        for name, fname in weight_map.items():
            path, handle = files[fname]
            if name not in handle.keys():
                raise WeightsError(path, f"tensor {name} listed in {index.name} is not in the shard")
            out[name] = files[fname]
        return out
    if single.is_file():
        handle = _open(single)
        return {name: (single, handle) for name in handle.keys()}
    raise WeightsError(model_dir, "no model.safetensors or model.safetensors.index.json")


def _read_tensor(path: Path, handle, name: str) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, TypeError, ValueError) as e:
        raise WeightsError(path, f"tensor {name} cannot be read ({e})") from e


def load_hf(model_dir: str | os.PathLike, dtype=jnp.float32,
            cache_dir: str | os.PathLike | None = None, *, shardings=None,
            kv_repeat: int = 1) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face model directory into (config, params on device).

    Args:
      model_dir: directory with config.json and safetensors weights.
      dtype: the params' dtype (converted once, tensor by tensor).
      cache_dir: if set, converted params are cached there with orbax-checkpoint (single
        device only; ignored with `shardings`).
      shardings: a tree of shardings, one per array of `param_specs(cfg.with_kv_repeat(
        kv_repeat))` (e.g. `arcjax.parallel.TensorParallel.param_shardings`): load straight
        into those shards. The returned config is then the file's `with_kv_repeat`.
      kv_repeat: how many times each KV head is stored (with `shardings` only).

    Raises:
      ModelConfigError: config.json is missing or malformed.
      WeightsError: a weight file is missing, truncated or inconsistent with config.json.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    if shardings is not None:
        return _load_sharded(model_dir, cfg, dtype, shardings, kv_repeat)
    key = None
    if cache_dir is not None:
        key = _cache_key(model_dir, dtype)
        restored = _restore_cached(Path(cache_dir) / key, cfg, dtype)
        if restored is not None:
            return cfg, restored
    params = jax.tree.map(jnp.asarray, _assemble(model_dir, cfg, dtype))
    if key is not None:
        _save_cached(Path(cache_dir) / key, params)
    return cfg, params


def hf_host(model_dir: str | os.PathLike, dtype, mxfp4_packed: bool = False) -> HostModel:
    """The whole checkpoint in host memory, in the params' dtype (gpt-oss: its fused experts,
    `fused_experts`), for the loader to place on one device or in shards. MXFP4 experts
    stay as stored (`Mxfp4Weight`s: `fused_experts.packed_experts`) with `mxfp4_packed`,
    else they are decoded into the params' dtype.

    Raises:
      ModelConfigError, WeightsError: as `load_hf`.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    return HostModel(cfg, _assemble(model_dir, cfg, dtype, mxfp4_packed))


def _assemble(model_dir: Path, cfg: ModelConfig, dtype, mxfp4_packed: bool = False) -> Params:
    """The params tree in host memory (`hf_layout.assemble_host` over the checkpoint)."""
    tensors = _open_checkpoint(model_dir)

    def read(name: str) -> np.ndarray | None:
        if name not in tensors:
            return None
        file, handle = tensors[name]
        return _read_tensor(file, handle, name)

    def where(name: str):
        return tensors[name][0] if name in tensors else model_dir

    packed = {}
    if cfg.architecture == fused_experts.ARCHITECTURE:
        if mxfp4_packed:
            packed = fused_experts.packed_experts(cfg, read, where)
        read = fused_experts.reader(read)
    skip = tuple(k for stack in packed.values() for k in stack)
    host = assemble_host(cfg, read, dtype, where, skip=skip)
    for stack, weights in packed.items():
        host[stack].update(weights)
    return host


def _load_sharded(model_dir: Path, cfg: ModelConfig, dtype, shardings, repeat: int):
    tensors = _open_checkpoint(model_dir)
    np_dtype = np.dtype(jnp.dtype(dtype))
    scfg = cfg.with_kv_repeat(repeat)
    specs, orig_specs = param_specs(scfg), param_specs(cfg)
    names_of = layer_names(cfg)
    stacks = layer_stacks(cfg)  # {"layers": 0} or {"dense_layers": 0, "layers": K}
    out = {}
    for key in specs:
        if key in stacks:
            out[key] = {}
            for lkey, spec in specs[key].items():
                pattern, t = names_of[lkey]
                layers = range(stacks[key], stacks[key] + spec.shape[0])  # model layers
                if spec.axes[1] == "expert":
                    names = np.array([[pattern.format(i=i, e=e) for e in range(cfg.num_experts)]
                                      for i in layers], dtype=object)
                else:
                    names = np.array([pattern.format(i=i) for i in layers], dtype=object)
                out[key][lkey] = _sharded_array(
                    model_dir, tensors, names, t, spec, orig_specs[key][lkey],
                    shardings[key][lkey], np_dtype, repeat, cfg)
        else:
            name, t = TOP_NAMES[key]
            out[key] = _sharded_array(model_dir, tensors, np.array(name, dtype=object), t,
                                      specs[key], orig_specs[key], shardings[key], np_dtype,
                                      repeat, cfg)
    return scfg, out


def _sharded_array(model_dir, tensors, names: np.ndarray, transpose, spec, orig_spec,
                   sharding, np_dtype, repeat, cfg):
    """One params array built shard by shard from its HF tensors.

    `names` holds one tensor name per entry of the array's leading (stacked) axes: shape ()
    for a top-level array, [L] per layer, [L, E] per layer and expert.
    """
    lead = names.ndim
    want = orig_spec.shape[lead:]  # [in, out] of one tensor
    for name in names.flat:
        if name not in tensors:
            raise WeightsError(model_dir, f"tensor {name} is missing from the checkpoint "
                                          f"(architecture {cfg.architecture})")
        file, handle = tensors[name]
        try:
            shape = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, TypeError, ValueError) as e:
            raise WeightsError(file, f"tensor {name} cannot be read ({e})") from e
        hf_want = tuple(want[::-1]) if transpose else tuple(want)
        if shape != hf_want:
            raise WeightsError(file, f"tensor {name} has shape {shape}, config.json implies "
                                     f"{hf_want}")
    axes = spec.axes[lead:]
    head_dim = cfg.head_dim

    def source_index(dim: int, sl: slice) -> np.ndarray:
        """Indices into the file's tensor for a slice of our (possibly repeated) axis."""
        idx = np.arange(spec.shape[dim + lead])[sl]
        if axes[dim] == "kv_heads" and repeat > 1:  # column c of repeated head c // D
            idx = (idx // head_dim // repeat) * head_dim + idx % head_dim
        return idx

    def read(name: str, index: tuple) -> np.ndarray:
        file, handle = tensors[name]
        ours = [source_index(d, sl) for d, sl in enumerate(index)]
        theirs = ours[::-1] if transpose else ours
        bounds = tuple(slice(int(i.min()), int(i.max()) + 1) for i in theirs)
        try:
            block = handle.get_slice(name)[bounds]
        except (SafetensorError, TypeError, ValueError) as e:
            raise WeightsError(file, f"tensor {name} cannot be read ({e})") from e
        block = block[np.ix_(*[i - i.min() for i in theirs])]
        return (block.T if transpose else block).astype(np_dtype)

    def callback(index):
        index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
        # the tensors this shard's stacked entries come from (0-d for a top-level array)
        chosen = np.asarray(names[index[:lead]], dtype=object)
        return np.stack([read(n, index[lead:]) for n in chosen.flat]).reshape(
            chosen.shape + tuple(len(source_index(d, sl)) for d, sl in enumerate(index[lead:])))

    return jax.make_array_from_callback(spec.shape, sharding, callback)


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

    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)),
                          param_specs(cfg), is_leaf=is_spec)
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
    for path, index, name, transpose in hf_entries(cfg):
        arr = np.asarray(tree_at(params, path))[index]
        tensors[name] = np.ascontiguousarray((arr.T if transpose else arr).astype(np_dtype))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
