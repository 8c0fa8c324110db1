"""What each architecture's config.json means beyond the Llama core, as `ModelConfig` fields.

`model_config.ModelConfig.from_hf_dict` reads the shared fields and asks this module for the
rest, family by family:

  windows   `sliding_window` and `layer_types` as transformers writes them (Mistral and
            Mixtral: every layer slides; Qwen: only with `use_sliding_window`; Gemma 2/3:
            alternating local and global layers), with transformers' defaults when a config
            predates `layer_types`.
  rope      one (theta, scaling) pair, or a pair per layer type (Gemma 3's local and global
            bases), from `rope_parameters` or the legacy `rope_theta` / `rope_scaling` /
            `rope_local_base_freq` fields; scalings `linear`, `llama3` and `yarn` (with its
            attention factor from `mscale` / `mscale_all_dim`, as transformers computes it).
  experts   Mixtral, Qwen2-MoE (with its gated shared expert) and Qwen3-MoE: expert count,
            experts per token, their width, and whether the top-k weights are renormalized.
  gemma     (1 + w) RMSNorm, pre/post norms around attention and MLP, sqrt(hidden) embedding
            scale, GeGLU, `query_pre_attn_scalar`, soft-capping (Gemma 2).

gpt-oss (`gpt_oss_config`) and DeepSeek-V2/V3 (`deepseek_config`) read their own fields
(sinks, the clamped SwiGLU, MLA, the router variants, mixed dense and expert layers).

Every refusal is a `ModelConfigError` naming the field.
"""

from __future__ import annotations

import math
from typing import Mapping

from arcjax.errors import ModelConfigError

# Architecture -> the `model_type` transformers writes for it.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# transformers' `default_theta` where it is not 1e4 (a config.json without rope_theta).
DEFAULT_THETA = {"GptOssForCausalLM": 150000.0}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# hidden_act names -> the activation arcjax computes ("gelu_tanh": tanh-approximated GELU).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}


def _positive_int(d: Mapping, name: str, default=None) -> int:
    value = d.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError("config.json", f"{name} must be an int >= 1, got {value!r}")
    return value


def activation(d: Mapping, arch: str) -> str:
    """The MLP activation ("silu" or "gelu_tanh")."""
    name = "hidden_activation" if arch in GEMMA_ARCHITECTURES else "hidden_act"
    raw = d.get(name) or d.get("hidden_act") or ("gelu_pytorch_tanh" if arch in GEMMA_ARCHITECTURES
                                                 else "silu")
    if raw not in ACTIVATIONS:
        raise ModelConfigError("config.json", f"{name} {raw!r} is not supported; supported: "
                                              f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[raw]


# ---- sliding windows -----------------------------------------------------------------------

def _default_layer_types(d: Mapping, arch: str, num_layers: int) -> list[bool]:
    """transformers' per-layer default when config.json has no `layer_types`."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = d.get("max_window_layers", 28)
        return [i >= first for i in range(num_layers)]
    if arch == "Qwen2MoeForCausalLM":
        last = d.get("max_window_layers", 28)
        return [bool((i + 1) % 2) and i < last for i in range(num_layers)]
    if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):  # sliding, full, sliding, ...
        return [bool((i + 1) % 2) for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = _positive_int(d, "sliding_window_pattern", 6)
        return [bool((i + 1) % pattern) for i in range(num_layers)]
    return [True] * num_layers  # Mistral, Mixtral, Qwen3-MoE: the window applies everywhere


def windows(d: Mapping, arch: str, num_layers: int) -> dict:
    """`sliding_window` and `sliding_layers` (one bool per layer; () when none slides)."""
    window = d.get("sliding_window")
    if d.get("use_sliding_window") is False or not window:  # Qwen writes 0 or null when off
        return {"sliding_window": None, "sliding_layers": ()}
    window = _positive_int(d, "sliding_window")
    types = d.get("layer_types")
    if types is None:
        sliding = _default_layer_types(d, arch, num_layers)
    else:
        if not isinstance(types, (list, tuple)) or len(types) != num_layers:
            raise ModelConfigError("config.json", f"layer_types must list one type per layer "
                                                  f"({num_layers}), got {types!r}")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ModelConfigError("config.json", f"layer_types {unknown} are not supported; "
                                                  "supported: sliding_attention, full_attention")
        sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return {"sliding_window": None, "sliding_layers": ()}
    return {"sliding_window": window, "sliding_layers": tuple(sliding)}


# ---- rope ----------------------------------------------------------------------------------

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(s: Mapping, name: str, default=None) -> float | None:
    value = s.get(name, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError("config.json", f"rope_scaling {name} must be a number > 0, "
                                              f"got {value!r}")
    return float(value)


def _yarn(s: Mapping, max_positions: int) -> tuple:
    """("yarn", factor, original_max_positions, beta_fast, beta_slow, attention_factor,
    truncate, mscale, mscale_all_dim): transformers' `_compute_yarn_parameters` inputs, the
    attention factor (what cos and sin are multiplied by) computed as it does."""
    orig = s.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
        raise ModelConfigError("config.json", "rope_scaling original_max_position_embeddings "
                                              f"must be an int >= 1, got {orig!r}")
    factor = _number(s, "factor")
    if factor is None:  # DeepSeek-V3's convention: the context ratio
        factor = max_positions / orig
    mscale, mscale_all = _number(s, "mscale"), _number(s, "mscale_all_dim")
    attention = _number(s, "attention_factor")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    return ("yarn", factor, orig, _number(s, "beta_fast") or 32.0,
            _number(s, "beta_slow") or 1.0, attention, bool(s.get("truncate", True)),
            mscale or 0.0, mscale_all or 0.0)


def _parse_rope_scaling(s: Mapping, max_positions: int) -> tuple | None:
    kind = s.get("rope_type", s.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return ("linear", float(s["factor"]))
    if kind == "llama3":
        return ("llama3", float(s["factor"]), float(s["low_freq_factor"]),
                float(s["high_freq_factor"]), int(s["original_max_position_embeddings"]))
    if kind == "yarn":
        return _yarn(s, max_positions)
    raise ModelConfigError("config.json", f"rope_scaling type {kind!r} is not supported; "
                           "supported: default, linear, llama3, yarn")


def _rope_pair(params: Mapping, legacy: Mapping, theta: float,
               max_positions: int) -> tuple[float, tuple | None]:
    theta = float(params.get("rope_theta", theta))
    scaling = {**legacy, **{k: v for k, v in params.items() if k != "rope_theta"}}
    return theta, _parse_rope_scaling(scaling, max_positions)


def rope(d: Mapping, arch: str) -> dict:
    """`rope_theta`, `rope_scaling`, and for Gemma 3 the local layers' `local_rope_theta` /
    `local_rope_scaling` (None elsewhere: every layer shares one rope)."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    per_type = "full_attention" in params or "sliding_attention" in params
    positions = int(d.get("max_position_embeddings", 2048))
    if arch != "Gemma3ForCausalLM":
        if per_type:
            raise ModelConfigError("config.json", "rope_parameters per layer type are only "
                                                  "supported for Gemma3ForCausalLM")
        theta, scaling = _rope_pair(params, legacy,
                                    float(d.get("rope_theta", DEFAULT_THETA.get(arch, 1e4))),
                                    positions)
        return {"rope_theta": theta, "rope_scaling": scaling,
                "local_rope_theta": None, "local_rope_scaling": None}
    full = params.get("full_attention", {} if per_type else params) or {}
    local = params.get("sliding_attention") or {}
    theta, scaling = _rope_pair(full, {} if per_type else legacy,
                                float(d.get("rope_theta", 1_000_000.0)), positions)
    local_theta, local_scaling = _rope_pair(local, {}, float(d.get("rope_local_base_freq",
                                                                   10_000.0)), positions)
    return {"rope_theta": theta, "rope_scaling": scaling,
            "local_rope_theta": local_theta, "local_rope_scaling": local_scaling}


# ---- mixture of experts --------------------------------------------------------------------

def experts(d: Mapping, arch: str, num_layers: int) -> dict:
    """Expert fields (all zero for a dense architecture)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    count = d.get("num_experts", d.get("num_local_experts"))
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ModelConfigError("config.json", f"num_experts must be an int >= 1, got {count!r}")
    top_k = _positive_int(d, "num_experts_per_tok")
    if top_k > count:
        raise ModelConfigError("config.json", f"num_experts_per_tok ({top_k}) exceeds "
                                              f"num_experts ({count})")
    if arch == "MixtralForCausalLM":
        return {"num_experts": count, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": _positive_int(d, "intermediate_size")}
    step = d.get("decoder_sparse_step", 1)
    dense = d.get("mlp_only_layers") or []
    if step != 1 or dense:
        # NOTE: the layer loop is one `lax.scan` over stacked weights, so every layer has
        # the same MLP kind; a model mixing dense and expert layers is refused, not guessed.
        raise ModelConfigError("config.json", f"decoder_sparse_step={step} / mlp_only_layers="
                               f"{dense}: models mixing dense and expert layers are not "
                               "supported (every layer must be a mixture of experts)")
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = d.get("shared_expert_intermediate_size", 0) or 0
        if not isinstance(shared, int) or shared < 0:
            raise ModelConfigError("config.json", "shared_expert_intermediate_size must be an "
                                                  f"int >= 0, got {shared!r}")
    return {"num_experts": count, "num_experts_per_tok": top_k,
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "moe_intermediate_size": _positive_int(d, "moe_intermediate_size"),
            "shared_expert_intermediate_size": shared, "shared_expert_gate": bool(shared)}


# ---- Gemma ---------------------------------------------------------------------------------

def _cap(d: Mapping, name: str) -> float | None:
    value = d.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError("config.json", f"{name} must be a number > 0 or null, "
                                              f"got {value!r}")
    return float(value)


def gemma(d: Mapping, arch: str) -> dict:
    """Gemma's norms, embedding scale, query scale and soft-caps ({} for other families)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    scalar = d.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise ModelConfigError("config.json", f"query_pre_attn_scalar must be > 0, got {scalar!r}")
    if d.get("use_bidirectional_attention"):
        raise ModelConfigError("config.json", "use_bidirectional_attention=True is not "
                                              "supported (causal decoding only)")
    return {
        "norm_unit_offset": True, "sandwich_norms": True, "scale_embeddings": True,
        "query_pre_attn_scalar": float(scalar),
        # Gemma 3 ignores attn_logit_softcapping (transformers never passes it to attention).
        "attn_logit_softcap": _cap(d, "attn_logit_softcapping") if arch == "Gemma2ForCausalLM"
        else None,
        "final_logit_softcap": _cap(d, "final_logit_softcapping"),
        "qk_norm": arch == "Gemma3ForCausalLM",
    }


def _scaling_dict(scaling: tuple | None) -> dict:
    if scaling is None:
        return {"rope_type": "default"}
    if scaling[0] == "linear":
        return {"rope_type": "linear", "factor": scaling[1]}
    if scaling[0] == "freq_factors":
        raise ModelConfigError("rope_scaling", "per-frequency rope factors (from a GGUF file) "
                               "have no config.json spelling")
    if scaling[0] == "yarn":
        _, factor, orig, fast, slow, attention, truncate, mscale, mscale_all = scaling
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
               "beta_fast": fast, "beta_slow": slow, "truncate": truncate}
        out |= {k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all)) if v}
        return out if mscale and mscale_all else out | {"attention_factor": attention}
    _, factor, low, high, orig = scaling
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}


def hf_rope(arch: str, theta: float, scaling: tuple | None, local_theta: float | None,
            local_scaling: tuple | None) -> dict:
    """The rope fields of a config.json (inverse of `rope`)."""
    if arch == "Gemma3ForCausalLM":
        local = {"rope_theta": local_theta if local_theta is not None else theta,
                 **_scaling_dict(local_scaling if local_theta is not None else scaling)}
        return {"rope_parameters": {"full_attention": {"rope_theta": theta,
                                                       **_scaling_dict(scaling)},
                                    "sliding_attention": local}}
    out = {"rope_theta": theta}
    if scaling is not None:
        out["rope_scaling"] = _scaling_dict(scaling)
    return out
