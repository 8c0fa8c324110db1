"""The Hugging Face layout every format reads into: config.json, and the Hugging Face
tensor names <-> the arcjax params tree. It imports no format; every format imports it.

1. `read_config(model_dir)`: config.json as a `ModelConfig` (`read_config_json`: the raw
   JSON object, for what a format reads beside the config, such as its
   `quantization_config`).
2. The name tables: each params array's Hugging Face tensor name per layer (and expert),
   and whether it is stored transposed (Hugging Face linear weights are [out, in], ours
   [in, out]); `hf_layer_name`, `layer_names`, `TOP_NAMES`, `hf_entries` read them.
3. `assemble_host(cfg, read, dtype, where)` fills the params tree in host memory from any
   reader of tensors by Hugging Face name (safetensors files, GGUF tensors renamed, a
   quantized checkpoint's float tensors); a format returns it as a `HostModel`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.errors import ModelConfigError, WeightsError
from arcjax.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from arcjax.model.specs import Params, is_spec, param_specs

# arcjax name -> (Hugging Face name pattern, transpose). "{i}" is the layer index, "{e}" the
# expert's (expert weights are stacked [L, E, ...] from one tensor per layer and expert).
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
    # Qwen2-MoE / Qwen3-MoE
    "router": ("model.layers.{i}.mlp.gate.weight", True),
    "we_gate": ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", True),
    "we_up": ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", True),
    "we_down": ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", True),
    "ws_gate": ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", True),
    "ws_up": ("model.layers.{i}.mlp.shared_expert.up_proj.weight", True),
    "ws_down": ("model.layers.{i}.mlp.shared_expert.down_proj.weight", True),
    "ws_router": ("model.layers.{i}.mlp.shared_expert_gate.weight", True),
}
# gpt-oss stores each layer's experts fused: "<tensor>@<part>" names one expert's part of
# one (`fused_name`), which `formats/fused_experts.py`'s reader answers: `gate.{e}` and
# `up.{e}` the even and odd columns of expert e's gate_up, `{e}` expert e's row.
FUSED = "@"
_EXPERTS = "model.layers.{i}.mlp.experts."
GPT_OSS_LAYER_NAMES = {
    "sinks": ("model.layers.{i}.self_attn.sinks", False),
    "router": ("model.layers.{i}.mlp.router.weight", True),
    "router_bias": ("model.layers.{i}.mlp.router.bias", False),
    "we_gate": (_EXPERTS + "gate_up_proj@gate.{e}", False),
    "we_up": (_EXPERTS + "gate_up_proj@up.{e}", False),
    "we_down": (_EXPERTS + "down_proj@{e}", False),
    "be_gate": (_EXPERTS + "gate_up_proj_bias@gate.{e}", False),
    "be_up": (_EXPERTS + "gate_up_proj_bias@up.{e}", False),
    "be_down": (_EXPERTS + "down_proj_bias@{e}", False),
}


def fused_name(name: str) -> str:
    """The checkpoint tensor a layer name is read from: the fused tensor of a
    `GPT_OSS_LAYER_NAMES` part, the name itself otherwise."""
    return name.split(FUSED, 1)[0]


# DeepSeek-V2/V3: latent attention's projections (`arcjax.model.mla_layers`), the router
# and its noaux_tc correction, experts one tensor each, the ungated shared experts.
_DEEPSEEK_ATTN = "model.layers.{i}.self_attn."
DEEPSEEK_LAYER_NAMES = {
    "wq_a": (_DEEPSEEK_ATTN + "q_a_proj.weight", True),
    "q_a_norm": (_DEEPSEEK_ATTN + "q_a_layernorm.weight", False),
    "wq_b": (_DEEPSEEK_ATTN + "q_b_proj.weight", True),
    "wkv_a": (_DEEPSEEK_ATTN + "kv_a_proj_with_mqa.weight", True),
    "kv_a_norm": (_DEEPSEEK_ATTN + "kv_a_layernorm.weight", False),
    "wkv_b": (_DEEPSEEK_ATTN + "kv_b_proj.weight", True),
    "router_correction": ("model.layers.{i}.mlp.gate.e_score_correction_bias", False),
    "ws_gate": ("model.layers.{i}.mlp.shared_experts.gate_proj.weight", True),
    "ws_up": ("model.layers.{i}.mlp.shared_experts.up_proj.weight", True),
    "ws_down": ("model.layers.{i}.mlp.shared_experts.down_proj.weight", True),
}

# Where an architecture names a weight differently.
_ARCH_LAYER_NAMES = {
    "DeepseekV2ForCausalLM": DEEPSEEK_LAYER_NAMES,
    "DeepseekV3ForCausalLM": DEEPSEEK_LAYER_NAMES,
    "MixtralForCausalLM": {
        "router": ("model.layers.{i}.block_sparse_moe.gate.weight", True),
        "we_gate": ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", True),
        "we_up": ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", True),
        "we_down": ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", True),
    },
    # Gemma: post_attention_layernorm normalizes the attention output; the MLP's input norm
    # is pre_feedforward_layernorm.
    **{arch: {
        "mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", False),
        "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
        "post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", False),
    } for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")},
    # gpt-oss: sinks, a biased router, experts fused per layer (`GPT_OSS_LAYER_NAMES`).
    "GptOssForCausalLM": GPT_OSS_LAYER_NAMES,
}
# Top-level arrays: arcjax name -> (Hugging Face name, transpose).
TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


@dataclasses.dataclass(frozen=True)
class HostModel:
    """What a format reads for the loader to place.

    Attributes:
      cfg: the model config (as the files say: one copy of each KV head).
      params: the params tree in host memory (numpy arrays; a weight stored quantized is a
        `QuantizedWeight` of numpy arrays).
      kv_scales: [2, L] float32 (K and V scale per layer) from the checkpoint, or None.
    """

    cfg: ModelConfig
    params: Params
    kv_scales: np.ndarray | None = None


def read_config_json(model_dir: str | os.PathLike) -> dict:
    """The model's config.json as a JSON object.

    Raises:
      ModelConfigError: missing, unparsable or not a JSON object.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(path, "config.json not found (supported architectures: "
                                     f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(path, f"not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelConfigError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The model's config.json as a ModelConfig.

    Raises:
      ModelConfigError: missing, unparsable, not a JSON object, missing fields or
        unsupported.
    """
    data = read_config_json(model_dir)
    path = Path(model_dir) / "config.json"
    try:
        cfg = ModelConfig.from_hf_dict(data)
    except ModelConfigError as e:
        raise ModelConfigError(path, e.reason) from e
    except KeyError as e:
        raise ModelConfigError(path, f"required field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise ModelConfigError(path, f"a field has the wrong type ({e})") from e
    return cfg


def layer_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Layer weight ("wq", ...) -> (Hugging Face name pattern, transpose) for `cfg`'s
    architecture; the pattern's "{i}" is the layer, "{e}" the expert."""
    return {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(cfg.architecture, {})}


def hf_layer_name(cfg: ModelConfig, key: str, layer: int, expert: int = 0) -> str:
    """The Hugging Face tensor name of layer weight `key` ("wq", "we_gate", ...) of one
    layer (and expert, for stacked expert weights) of `cfg`'s architecture."""
    return layer_names(cfg)[key][0].format(i=layer, e=expert)


def layer_stacks(cfg: ModelConfig) -> dict[str, int]:
    """Each stack of layer parameters in the params tree -> the model layer it starts at:
    {"layers": 0}, or {"dense_layers": 0, "layers": K} for a model whose first K layers
    are dense (`ModelConfig.num_dense_layers`)."""
    dense = cfg.num_dense_layers
    return {"dense_layers": 0, "layers": dense} if dense else {"layers": 0}


def hf_entries(cfg: ModelConfig):
    """Yields (path in params tree, index into that array, HF name, transpose): index is
    () for a top-level array, (layer,) or (layer, expert) for stacked ones (the layer
    counted in its stack, `layer_stacks`)."""
    specs = param_specs(cfg)
    names = layer_names(cfg)
    stacks = layer_stacks(cfg)
    for key in specs:
        if key in stacks:
            first = stacks[key]
            for lkey, spec in specs[key].items():
                pattern, t = names[lkey]
                experts = spec.axes[1] == "expert"
                for i in range(spec.shape[0]):
                    layer = first + i
                    if experts:
                        for e in range(cfg.num_experts):
                            yield (key, lkey), (i, e), pattern.format(i=layer, e=e), t
                    else:
                        yield (key, lkey), (i,), pattern.format(i=layer), t
        else:
            name, t = TOP_NAMES[key]
            yield (key,), (), name, t


def tree_at(tree, path: tuple[str, ...]):
    """The subtree (or array) of `tree` at `path` (a path from `hf_entries`)."""
    for p in path:
        tree = tree[p]
    return tree


def assemble_host(cfg: ModelConfig, read, dtype, where, skip: tuple[str, ...] = ()) -> Params:
    """The params tree in host memory, one tensor at a time.

    Args:
      cfg: the model config.
      read: `read(hf_name) -> np.ndarray | None`, a tensor in Hugging Face layout
        (linear weights [out, in]); None when the checkpoint lacks it. gpt-oss's fused
        expert parts (`GPT_OSS_LAYER_NAMES`) too: `fused_experts.reader` wraps a reader.
      dtype: the params' dtype.
      where: `where(hf_name)`: the file errors about that tensor name.
      skip: weights ("wq", ..., or top-level "embed", "lm_head") left out of the tree
        (the caller fills them).

    Raises:
      WeightsError: a tensor is missing or its shape disagrees with the config.
    """
    np_dtype = np.dtype(jnp.dtype(dtype))
    specs = param_specs(cfg)
    specs = {k: v for k, v in specs.items() if k not in skip}
    for stack in layer_stacks(cfg):
        specs[stack] = {k: v for k, v in specs[stack].items() if k not in skip}
    host = jax.tree.map(lambda s: np.empty(s.shape, np_dtype), specs, is_leaf=is_spec)
    for path, index, name, transpose in hf_entries(cfg):
        if path[-1] in skip:
            continue
        arr = read(name)
        if arr is None:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            name = fused_name(name)
            raise WeightsError(where(name), f"tensor {name} is missing from the checkpoint "
                                       f"(architecture {cfg.architecture})")
        arr = arr.T if transpose else arr
        dst = tree_at(host, path)
        want = dst.shape[len(index):]
        if tuple(arr.shape) != tuple(want):
            hf_shape = tuple(arr.shape[::-1]) if transpose else tuple(arr.shape)
            implied = tuple(want[::-1]) if transpose else tuple(want)
            raise WeightsError(where(fused_name(name)),
                               f"tensor {name} has shape {hf_shape}, the config implies "
                               f"{implied}")
        dst[index] = arr
    return host
