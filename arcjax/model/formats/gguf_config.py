"""The `ModelConfig` of a GGUF file, from its metadata (`{arch}.block_count`, ...) and from
which tensors exist, read the way llama.cpp reads them.

- llama, qwen2, qwen3: tied embeddings (no `output.weight`), biases, q/k norms, llama3's
  per-frequency `rope_freqs`, linear rope scaling.
- Mixtral is llama.cpp's `llama` with `expert_count` > 0; `qwen2moe` (plus its gated
  shared expert) and `qwen3moe`: expert count, experts per token, their width
  (`expert_feed_forward_length`, Mixtral's `feed_forward_length`), shared width. Top-k
  renormalization follows `expert_weights_norm` when written, else llama.cpp's fixed
  choice per architecture (Mixtral and Qwen3-MoE renormalize, Qwen2-MoE does not).
- gemma2, gemma3: (1 + w) norms, sandwich norms, scaled embeddings, GeGLU; soft-caps
  (Gemma 2; llama.cpp's 50 / 30 when absent); sliding windows in llama.cpp's pattern
  (`attention.sliding_window_pattern`, else every 2nd / 6th layer global); Gemma 3's local
  rope base (`rope.freq_base_swa`, else 10000). GGUF has no `query_pre_attn_scalar`: the
  query scale is `attention.scale` when written, else llama.cpp's rule (head_dim, or
  hidden / heads for the 27B models: 46-layer Gemma 2, 62-layer Gemma 3).

- deepseek2 (DeepSeek-V2/V3 as llama.cpp's converter writes them): latent attention
  (`attention.q_lora_rank`, absent or 0: no query bottleneck; `attention.kv_lora_rank`;
  the per-head widths from `attention.key_length_mla` / `value_length_mla`, or in files
  from before the MQA rewrite `attention.key_length` / `value_length`; the rope width
  `rope.dimension_count`), `leading_dense_block_count` dense layers, the experts
  (`expert_shared_count`, `expert_weights_scale`, `expert_weights_norm`, groups
  `expert_group_count` / `expert_group_used_count`), V3 told from V2 by
  `expert_gating_func` (2, sigmoid: V3's noaux_tc router; 1 or absent, softmax: V2, as
  llama.cpp defaults), YaRN with `rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim
  (llama.cpp's cos/sin carry no attention factor, as transformers' do when mscale equals
  mscale_all_dim). Read into a config.json and through `ModelConfig.from_hf_dict`, so the
  checks of `deepseek_config` apply.

Sliding windows are read for Gemma only: llama.cpp ignores a window on the other
architectures, so a GGUF Mixtral attends fully (as llama.cpp runs it).
"""

from __future__ import annotations

import numpy as np

from arcjax.errors import ModelConfigError
from arcjax.model.model_config import ModelConfig
from arcjax.model.families import GEMMA_ARCHITECTURES, MOE_ARCHITECTURES

# general.architecture -> (our architecture, q/k permuted by llama.cpp's converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),  # MixtralForCausalLM when it has experts
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
    "deepseek2": ("DeepseekV2ForCausalLM", False),  # V3 by its gating function (`_deepseek`)
}
# llama.cpp renormalizes the top-k router weights per architecture (no metadata key).
_NORM_TOPK = {"MixtralForCausalLM": True, "Qwen2MoeForCausalLM": False,
              "Qwen3MoeForCausalLM": True}
_SLIDING_PERIOD = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}  # every n-th layer global
_LAYERS_27B = {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}


def _field(f, key: str, default=None, required: bool = True):
    full = f"{f.architecture}.{key}"
    if full in f.metadata:
        return f.metadata[full]
    if required and default is None:
        raise ModelConfigError(f.path, f"GGUF metadata {full} is missing")
    return default


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not
    9.99999997e-07), so the config equals the source model's and shares its compiles."""
    return float(str(np.float32(x)))


def _rope_scaling(f, head_dim: int):
    kind = str(_field(f, "rope.scaling.type", "none", required=False))
    scaling = None
    if kind == "linear":
        scaling = ("linear", _f32(_field(f, "rope.scaling.factor")))
    elif kind not in ("none", ""):
        raise ModelConfigError(f.path, f"rope scaling {kind!r} is not supported (linear, "
                                       "llama3 rope_freqs)")
    if "rope_freqs.weight" in f.tensors:  # llama3 scaling, stored as a divisor per frequency
        factors = f.read("rope_freqs.weight").reshape(-1)
        if factors.shape[0] != head_dim // 2:
            raise ModelConfigError(f.path, f"rope_freqs has {factors.shape[0]} entries, "
                                           f"head_dim {head_dim} needs {head_dim // 2}")
        scaling = ("freq_factors", *(float(x) for x in factors))
    return scaling


def _width(f, tensor: str, key: str) -> int:
    """A width from metadata `key`, else from the tensor's shape (GGUF order: ne1)."""
    value = _field(f, key, 0, required=False)
    if not value and tensor in f.tensors:
        value = f.tensors[tensor].shape[1]
    return int(value or 0)


def _experts(f, arch: str, count: int) -> dict:
    if arch not in MOE_ARCHITECTURES:
        return {}
    if count < 1:
        raise ModelConfigError(f.path, f"GGUF metadata {f.architecture}.expert_count is "
                                       "missing or 0")
    width = _width(f, "blk.0.ffn_gate_exps.weight", "expert_feed_forward_length")
    if not width:  # Mixtral's converter writes the experts' width as feed_forward_length
        width = int(_field(f, "feed_forward_length"))
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = _width(f, "blk.0.ffn_gate_shexp.weight", "expert_shared_feed_forward_length")
    norm = _field(f, "expert_weights_norm", _NORM_TOPK[arch], required=False)
    return {"num_experts": count, "num_experts_per_tok": int(_field(f, "expert_used_count")),
            "moe_intermediate_size": width, "shared_expert_intermediate_size": shared,
            "shared_expert_gate": bool(shared), "norm_topk_prob": bool(norm)}


def _gemma(f, arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    scale = _field(f, "attention.scale", 0.0, required=False)
    if scale:
        scalar = float(scale) ** -2
    elif layers == _LAYERS_27B[arch]:
        scalar = hidden // heads
    else:
        scalar = head_dim
    gemma2 = arch == "Gemma2ForCausalLM"
    return {
        "hidden_act": "gelu_tanh", "norm_unit_offset": True, "sandwich_norms": True,
        "scale_embeddings": True, "query_pre_attn_scalar": float(scalar),
        "attn_logit_softcap": _f32(_field(f, "attn_logit_softcapping", 50.0, required=False))
        if gemma2 else None,
        "final_logit_softcap": _f32(_field(f, "final_logit_softcapping", 30.0, required=False))
        if gemma2 else None,
    }


def _windows(f, arch: str, layers: int) -> dict:
    window = int(_field(f, "attention.sliding_window", 0, required=False) or 0)
    if arch not in GEMMA_ARCHITECTURES or window < 1:
        return {}
    pattern = _field(f, "attention.sliding_window_pattern", None, required=False)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelConfigError(f.path, f"attention.sliding_window_pattern has "
                                           f"{len(pattern)} entries for {layers} layers")
        sliding = tuple(bool(x) for x in pattern)
    else:
        period = int(pattern or _SLIDING_PERIOD[arch])  # llama.cpp: il % n < n - 1 slides
        sliding = tuple(i % period < period - 1 for i in range(layers))
    if not any(sliding):
        return {}
    out = {"sliding_window": window, "sliding_layers": sliding}
    if arch == "Gemma3ForCausalLM":
        out |= {"local_rope_theta": _f32(_field(f, "rope.freq_base_swa", 10000.0,
                                                required=False)),
                "local_rope_scaling": None}
    return out


def _deepseek_rope(f) -> dict | None:
    kind = str(_field(f, "rope.scaling.type", "none", required=False))
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_field(f, "rope.scaling.factor"))}
    if kind != "yarn":
        raise ModelConfigError(f.path, f"rope scaling {kind!r} is not supported for "
                                       "deepseek2 (linear, yarn)")
    out = {"rope_type": "yarn", "factor": _f32(_field(f, "rope.scaling.factor")),
           "original_max_position_embeddings": int(_field(
               f, "rope.scaling.original_context_length")), "attention_factor": 1.0}
    for key in ("beta_fast", "beta_slow"):
        value = _field(f, f"rope.scaling.yarn_{key}", 0.0, required=False)
        if value:
            out[key] = _f32(value)
    log_mul = float(_field(f, "rope.scaling.yarn_log_multiplier", 0.0, required=False))
    if log_mul:
        out["mscale"] = out["mscale_all_dim"] = _f32(np.float32(log_mul) / 0.1)
    return out


def _deepseek(f) -> dict:
    """The config.json of a `deepseek2` file (DeepSeek-V2 or V3), for `from_hf_dict`."""
    gating = int(_field(f, "expert_gating_func", 1, required=False))
    if gating not in (1, 2):  # gguf.ExpertGatingFuncType: SOFTMAX, SIGMOID
        raise ModelConfigError(f.path, f"GGUF metadata {f.architecture}.expert_gating_func "
                                       f"{gating} is not supported (1 softmax: DeepSeek-V2, "
                                       "2 sigmoid: DeepSeek-V3)")
    v3 = gating == 2
    rope = int(_field(f, "rope.dimension_count"))
    qk = _field(f, "attention.key_length_mla", 0, required=False) or _field(
        f, "attention.key_length")
    v = _field(f, "attention.value_length_mla", 0, required=False) or _field(
        f, "attention.value_length")
    groups = int(_field(f, "expert_group_count", 1, required=False) or 1)
    width = int(_field(f, "expert_feed_forward_length"))
    eos = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "vocab_size": int(f.tensors["token_embd.weight"].shape[1]),
        "hidden_size": int(_field(f, "embedding_length")),
        "intermediate_size": int(_field(f, "feed_forward_length", width, required=False)),
        "num_hidden_layers": int(_field(f, "block_count")),
        "num_attention_heads": int(_field(f, "attention.head_count")),
        "rms_norm_eps": _f32(_field(f, "attention.layer_norm_rms_epsilon", 1e-6,
                                    required=False)),
        "rope_theta": _f32(_field(f, "rope.freq_base", 10000.0, required=False)),
        "rope_scaling": _deepseek_rope(f),
        "max_position_embeddings": int(_field(f, "context_length", 2048, required=False)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(i) for i in eos if i is not None)),
        "q_lora_rank": int(_field(f, "attention.q_lora_rank", 0, required=False)) or None,
        "kv_lora_rank": int(_field(f, "attention.kv_lora_rank")),
        "qk_nope_head_dim": int(qk) - rope, "qk_rope_head_dim": rope, "v_head_dim": int(v),
        "n_routed_experts": int(_field(f, "expert_count")),
        "num_experts_per_tok": int(_field(f, "expert_used_count")),
        "moe_intermediate_size": width,
        "n_shared_experts": int(_field(f, "expert_shared_count", 0, required=False)),
        "first_k_dense_replace": int(_field(f, "leading_dense_block_count", 0,
                                            required=False)),
        # llama.cpp: no scale, no renormalization when the keys are absent
        "routed_scaling_factor": _f32(_field(f, "expert_weights_scale", 1.0, required=False)),
        "norm_topk_prob": bool(_field(f, "expert_weights_norm", False, required=False)),
        "n_group": groups,
        "topk_group": int(_field(f, "expert_group_used_count", groups, required=False)),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1
        else "greedy",
    }


def gguf_config(f) -> ModelConfig:
    """The model configuration of `f` (an `arcjax.model.formats.gguf_file.GGUFFile`).

    Raises:
      ModelConfigError: an unsupported architecture, missing or inconsistent metadata.
    """
    if f.architecture not in ARCHITECTURES:
        raise ModelConfigError(f.path, f"GGUF architecture {f.architecture!r} is not "
                                       f"supported; supported: {', '.join(ARCHITECTURES)}")
    if "token_embd.weight" not in f.tensors:
        raise ModelConfigError(f.path, "tensor token_embd.weight is missing")
    if f.architecture == "deepseek2":
        try:
            return ModelConfig.from_hf_dict(_deepseek(f))
        except ModelConfigError as e:
            raise ModelConfigError(f.path, e.reason) from e
    arch = ARCHITECTURES[f.architecture][0]
    experts = int(_field(f, "expert_count", 0, required=False))
    if arch == "LlamaForCausalLM" and experts > 0:
        arch = "MixtralForCausalLM"
    elif experts > 0 and arch not in MOE_ARCHITECTURES:
        raise ModelConfigError(f.path, f"GGUF architecture {f.architecture!r} with experts "
                                       "is not supported")
    hidden = int(_field(f, "embedding_length"))
    heads = int(_field(f, "attention.head_count"))
    head_dim = int(_field(f, "attention.key_length", hidden // heads, required=False))
    layers = int(_field(f, "block_count"))
    eos = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
    bos = f.get("tokenizer.ggml.bos_token_id")
    moe = _experts(f, arch, experts)
    theta = 1e6 if arch == "Gemma3ForCausalLM" else 10000.0
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(f.tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=int(_field(f, "feed_forward_length", moe.get(
                "moe_intermediate_size"), required=not moe)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(_field(f, "attention.head_count_kv", heads, required=False)),
            head_dim=head_dim,
            rope_theta=_f32(_field(f, "rope.freq_base", theta, required=False)),
            rope_scaling=_rope_scaling(f, head_dim),
            rms_norm_eps=_f32(_field(f, "attention.layer_norm_rms_epsilon", 1e-6,
                                     required=False)),
            tie_word_embeddings="output.weight" not in f.tensors,
            qkv_bias="blk.0.attn_q.bias" in f.tensors,
            o_bias="blk.0.attn_output.bias" in f.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
            max_position_embeddings=int(_field(f, "context_length", 2048, required=False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            **moe,
            **_gemma(f, arch, hidden, heads, head_dim, layers),
            **_windows(f, arch, layers),
        )
    except ModelConfigError as e:
        raise ModelConfigError(f.path, e.reason) from e
