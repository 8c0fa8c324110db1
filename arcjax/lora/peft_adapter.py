"""PEFT LoRA adapters as people publish them, read and validated into host weights.

1. `resolve_adapter(request)`: `lora_path` is a local directory, or a Hugging Face Hub id
   fetched through the engine's Hub resolution (`arcjax.model.formats.hub`: the adapter's
   files only).
2. `load_peft_adapter(request, cfg, max_rank=...)`: reads `adapter_config.json` (`r`,
   `lora_alpha`, `use_rslora`, `target_modules` as names or a regex, `exclude_modules`,
   `layers_to_transform`, `rank_pattern`, `alpha_pattern`) and `adapter_model.safetensors`
   (or `.bin`, through torch), checks every tensor against the served model, and returns a
   `PeftAdapter`: per projection of the decoder, A [L, in, r] and B [L, r, out] (float32,
   the scale folded into B; zeros in layers it does not adapt).

Supported projections: q/k/v/o (`self_attn`) and gate/up/down (`mlp`, dense models; a
mixture of experts' expert weights are not). Every refusal is a `LoRAAdapterError` naming
the adapter and the field: a missing file, an option this engine does not implement
(DoRA, biases, `modules_to_save`, ...), a rank above `max_lora_rank`, a target the model
lacks, a tensor of the wrong shape or name, and a base model it was not trained for where
the config says so (`auto_mapping.base_model_class`, or a local `base_model_name_or_path`
whose config.json differs in shape).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from arcjax.errors import LoRAAdapterError, ModelFileError
from arcjax.lora.lora_request import LoRARequest
from arcjax.model.formats import hub
from arcjax.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ADAPTER_PATTERNS = (CONFIG_FILE, *WEIGHT_FILES)
# Hugging Face projection name -> (its parent module, the decoder's params key).
PROJECTIONS = {"q_proj": ("self_attn", "wq"), "k_proj": ("self_attn", "wk"),
               "v_proj": ("self_attn", "wv"), "o_proj": ("self_attn", "wo"),
               "gate_proj": ("mlp", "w_gate"), "up_proj": ("mlp", "w_up"),
               "down_proj": ("mlp", "w_down")}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Options that change what the adapter computes and that this engine does not implement:
# each must be absent, or false / empty. (Initialization options, dropout and
# init_lora_weights change nothing at inference.)
REFUSED_OPTIONS = ("use_dora", "use_qalora", "use_bdlora", "fan_in_fan_out", "lora_bias",
                   "modules_to_save", "layer_replication", "target_parameters",
                   "trainable_token_indices", "alora_invocation_tokens", "megatron_config")
# config.json fields a base model's shape is read from, for `base_model_name_or_path`.
SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "vocab_size")
_TENSOR = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                     r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\."
                     r"lora_([AB])(?:\.default)?\.weight$")


@dataclasses.dataclass(frozen=True, eq=False)
class PeftAdapter:
    """One adapter's weights on the host.

    Attributes:
      name: the request's `lora_name`.
      lora_int_id: its identity.
      path: the adapter directory read.
      rank: the largest rank of its projections (what a device slot must hold).
      weights: params key ("wq", ...) -> (A [L, in, r], B [L, r, out]) float32, the scale
        folded into B; layers it does not adapt are zeros.
    """

    name: str
    lora_int_id: int
    path: Path
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection an adapter may target on `cfg` (the file's config, KV
    heads not repeated), by Hugging Face name."""
    H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H)}
    if not cfg.is_moe:
        I = cfg.intermediate_size
        shapes |= {"gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    return shapes


def resolve_adapter(request: LoRARequest) -> Path:
    """The adapter's directory: `lora_path` itself, or its Hub snapshot (adapter files only).

    Raises:
      LoRAAdapterError (field "lora_request.lora_path"): neither exists.
    """
    name, path = request.lora_name, Path(request.lora_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoRAAdapterError(name, "lora_request.lora_path",
                                   f"{path} is a file; a PEFT adapter is a directory")
        return path
    try:
        return Path(hub.snapshot(request.lora_path, None, ADAPTER_PATTERNS))
    except ModelFileError as e:
        raise LoRAAdapterError(name, "lora_request.lora_path",
                               f"no such directory, and not a Hub adapter: {e}") from None


def load_peft_adapter(request: LoRARequest, cfg: ModelConfig, *, max_rank: int,
                      base_model: str | None = None) -> PeftAdapter:
    """Reads and validates the adapter of `request` for the served model `cfg`.

    Args:
      cfg: the served model's config (as its file says: KV heads not repeated).
      max_rank: the engine's `max_lora_rank`.
      base_model: what the engine was asked to serve (a path or a Hub id), which the
        adapter's `base_model_name_or_path` may name.

    Raises:
      LoRAAdapterError: see the module docstring.
    """
    name = request.lora_name
    path = resolve_adapter(request)
    config = _read_config(name, path)
    _check_options(name, config)
    _check_base_model(name, config, cfg, base_model)
    targeted = _targets(name, config, cfg)
    tensors = _read_tensors(name, path)
    shapes = projection_shapes(cfg)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoRAAdapterError(name, f"{_weights_name(path)}:{key}",
                                   "not a LoRA A/B weight of a q/k/v/o/gate/up/down "
                                   "projection of a decoder layer")
        layer, parent, proj, which = int(match[1]), match[2], match[3], match[4]
        if PROJECTIONS[proj][0] != parent or proj not in shapes:
            raise LoRAAdapterError(name, f"{_weights_name(path)}:{key}",
                                   f"{cfg.architecture} has no {parent}.{proj} to adapt")
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(name, f"{_weights_name(path)}:{key}",
                                   f"layer {layer}: the model has {cfg.num_layers} layers",
                                   limit=cfg.num_layers)
        found.setdefault((layer, proj), {})[which] = value
    if set(found) != targeted:
        missing = sorted(targeted - set(found))
        extra = sorted(set(found) - targeted)
        what = (f"no weights for layer {missing[0][0]} {missing[0][1]}" if missing else
                f"weights for layer {extra[0][0]} {extra[0][1]}, which target_modules "
                "does not name")
        raise LoRAAdapterError(name, f"{_weights_name(path)}", f"{what} "
                               f"(target_modules {config.get('target_modules')!r})")
    weights, rank = _stack(name, path, config, cfg, found, shapes, max_rank)
    return PeftAdapter(name=name, lora_int_id=request.lora_int_id, path=path, rank=rank,
                       weights=weights)


def _read_config(name: str, path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(name, CONFIG_FILE, f"missing in {path}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(name, CONFIG_FILE, f"cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(name, CONFIG_FILE, "must hold a JSON object")
    return config


def _field(name: str, key: str, message: str, **kw) -> LoRAAdapterError:
    return LoRAAdapterError(name, f"{CONFIG_FILE}:{key}", message, **kw)


def _check_options(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise _field(name, "peft_type", f"must be 'LORA', got {config['peft_type']!r}")
    for key in REFUSED_OPTIONS:
        if config.get(key):
            raise _field(name, key, f"{config[key]!r} is not supported (only plain LoRA "
                                    "on q/k/v/o/gate/up/down projections)")
    if config.get("bias", "none") != "none":
        raise _field(name, "bias", f"must be 'none' (trained biases are not supported), got "
                                   f"{config['bias']!r}")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _field(name, "r", f"must be an int >= 1, got {r!r}", limit=1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _field(name, "lora_alpha", f"must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise _field(name, key, f"must be an object, got {config[key]!r}")


def _check_base_model(name: str, config: dict, cfg: ModelConfig, base_model: str | None) -> None:
    """The base model the adapter names, where its config says which: the class PEFT saw,
    and a local base model directory's shape."""
    declared = (config.get("auto_mapping") or {}).get("base_model_class")
    if declared and declared != cfg.architecture:
        raise _field(name, "auto_mapping.base_model_class", f"trained for {declared}; the "
                                                            f"served model is {cfg.architecture}")
    base = config.get("base_model_name_or_path")
    if not base or not isinstance(base, str) or base == base_model:
        return
    file = Path(base).expanduser() / "config.json"
    if not file.is_file():
        return  # a Hub id, or a path of another machine: the tensors' shapes are checked
    try:
        theirs = ModelConfig.from_hf_dict(json.loads(file.read_text()))
    except (OSError, ValueError) as e:
        raise _field(name, "base_model_name_or_path", f"{file} cannot be read ({e})") from None
    for key in SHAPE_FIELDS:
        if getattr(theirs, key) != getattr(cfg, key):
            raise _field(name, "base_model_name_or_path",
                         f"trained for {base} ({key} {getattr(theirs, key)}); the served model "
                         f"has {key} {getattr(cfg, key)}")


def _matches(patterns, path: str) -> bool:
    """PEFT's rule: a regex must match the whole module path; a list entry must equal the
    path or end it after a dot."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, path) is not None
    return any(path == p or path.endswith(f".{p}") for p in patterns)


def _targets(name: str, config: dict, cfg: ModelConfig) -> set[tuple[int, str]]:
    """The (layer, projection) pairs the config adapts, on the served model."""
    targets = config.get("target_modules")
    exclude = config.get("exclude_modules") or ()
    for key, value in (("target_modules", targets), ("exclude_modules", exclude)):
        if not (isinstance(value, str) or (isinstance(value, (list, tuple))
                                           and all(isinstance(v, str) for v in value))):
            raise _field(name, key, f"must be a list of module names or a regex, got {value!r}")
    layers = config.get("layers_to_transform")
    if isinstance(targets, str):
        layers = None  # PEFT applies layer indices to a list of names only (a regex says it)
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(
            isinstance(i, int) and 0 <= i < cfg.num_layers for i in layers)):
        raise _field(name, "layers_to_transform", f"must be layer indices below "
                                                  f"{cfg.num_layers}, got {layers!r}")
    shapes = projection_shapes(cfg)
    if not isinstance(targets, str):
        for entry in targets:
            proj = entry.rsplit(".", 1)[-1]
            if proj not in PROJECTIONS:
                raise _field(name, "target_modules", f"{entry!r}: {cfg.architecture} has no "
                             f"such projection to adapt (supported: {sorted(shapes)})")
            if proj not in shapes:
                raise _field(name, "target_modules", f"{entry!r}: {cfg.architecture}'s MLP is "
                             "a mixture of experts; LoRA on experts is not supported")
    out = set()
    for layer in range(cfg.num_layers):
        if layers and layer not in layers:
            continue
        for proj in shapes:
            path = f"model.layers.{layer}.{PROJECTIONS[proj][0]}.{proj}"
            if _matches(targets, path) and not (exclude and _matches(exclude, path)):
                out.add((layer, proj))
    if not out:
        raise _field(name, "target_modules", f"{targets!r} matches no projection of "
                                             f"{cfg.architecture} (supported: {sorted(shapes)})")
    return out


def _weights_name(path: Path) -> str:
    return next((f for f in WEIGHT_FILES if (path / f).is_file()), WEIGHT_FILES[0])


def _read_tensors(name: str, path: Path) -> dict[str, np.ndarray]:
    safetensors, bin_file = (path / f for f in WEIGHT_FILES)
    try:
        if safetensors.is_file():
            from safetensors import safe_open

            with safe_open(str(safetensors), framework="numpy") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        if bin_file.is_file():
            return _read_bin(name, bin_file)
    except LoRAAdapterError:
        raise
    except Exception as e:  # noqa: BLE001  a truncated or foreign file: name it
        raise LoRAAdapterError(name, _weights_name(path), f"cannot be read ({e})") from None
    raise LoRAAdapterError(name, WEIGHT_FILES[0], f"missing in {path} (nor {WEIGHT_FILES[1]})")


def _read_bin(name: str, file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise LoRAAdapterError(name, file.name, "a PyTorch pickle needs torch to read; "
                               "install torch or convert it to safetensors") from None
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {k: v.float().numpy() for k, v in state.items()}


def _pattern(patterns: dict, path: str, default):
    """`rank_pattern` / `alpha_pattern` lookup, PEFT's rule: the first key that ends the
    module path (after a dot)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _stack(name: str, path: Path, config: dict, cfg: ModelConfig, found: dict,
           shapes: dict, max_rank: int) -> tuple[dict, int]:
    """Per projection: A [L, in, r] and scaled B [L, r, out], and the largest rank."""
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r0, alpha0, rs = config["r"], config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    file = _weights_name(path)
    per_proj: dict[str, list] = {}
    rank = 0
    for (layer, proj), pair in sorted(found.items()):
        module = f"model.layers.{layer}.{PROJECTIONS[proj][0]}.{proj}"
        r = _pattern(rank_pattern, module, r0)
        alpha = _pattern(alpha_pattern, module, alpha0)
        d_in, d_out = shapes[proj]
        for which, shape in (("A", (r, d_in)), ("B", (d_out, r))):
            tensor = pair.get(which)
            key = f"{file}:base_model.model.{module}.lora_{which}.weight"
            if tensor is None:
                raise LoRAAdapterError(name, key, "missing")
            if tuple(tensor.shape) != shape:
                raise LoRAAdapterError(name, key, f"shape {tuple(tensor.shape)}, expected "
                                       f"{shape} (r {r}, {proj} {d_in} -> {d_out})")
        if r > max_rank:
            raise LoRAAdapterError(name, f"{CONFIG_FILE}:r", f"rank {r} ({module}) exceeds "
                                   f"max_lora_rank {max_rank}", limit=max_rank)
        scale = alpha / math.sqrt(r) if rs else alpha / r
        a = np.asarray(pair["A"], np.float32).T  # [in, r]
        b = np.asarray(pair["B"], np.float32).T * np.float32(scale)  # [r, out]
        per_proj.setdefault(proj, []).append((layer, a, b))
        rank = max(rank, r)
    weights = {}
    for proj, entries in per_proj.items():
        d_in, d_out = shapes[proj]
        a_all = np.zeros((cfg.num_layers, d_in, rank), np.float32)
        b_all = np.zeros((cfg.num_layers, rank, d_out), np.float32)
        for layer, a, b in entries:
            a_all[layer, :, :a.shape[1]] = a
            b_all[layer, :b.shape[0]] = b
        weights[PROJECTIONS[proj][1]] = (a_all, b_all)
    return weights, rank
