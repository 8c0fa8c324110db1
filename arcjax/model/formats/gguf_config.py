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


def gguf_config(f) -> ModelConfig:
    """The model configuration of `f` (an `arcjax.model.formats.gguf_file.GGUFFile`).

    Raises:
      ModelConfigError: an unsupported architecture, missing or inconsistent metadata.
    """
    if f.architecture not in ARCHITECTURES:
        raise ModelConfigError(f.path, f"GGUF architecture {f.architecture!r} is not "
                                       f"supported; supported: {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[f.architecture][0]
    experts = int(_field(f, "expert_count", 0, required=False))
    if arch == "LlamaForCausalLM" and experts > 0:
        arch = "MixtralForCausalLM"
    elif experts > 0 and arch not in MOE_ARCHITECTURES:
        raise ModelConfigError(f.path, f"GGUF architecture {f.architecture!r} with experts "
                                       "is not supported")
    if "token_embd.weight" not in f.tensors:
        raise ModelConfigError(f.path, "tensor token_embd.weight is missing")
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
