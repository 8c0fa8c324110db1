"""What a gpt-oss config.json (`GptOssForCausalLM`) means beyond the Llama core.

`fields(d, arch)` returns the `ModelConfig` fields gpt-oss sets ({} for other families),
`hf_fields(cfg)` writes them back. Windows (`sliding_window`, `layer_types`: sliding and
full layers alternate, sliding first) and YaRN rope are read by `families`; attention
biases by the shared `attention_bias` (q, k, v and o).

- attention sinks: a learned logit per query head in every softmax denominator
  (`self_attn.sinks`);
- the router: a linear layer with a bias; the top-k *logits* are chosen and softmaxed
  among themselves (`RouterConfig(scoring="topk_softmax", bias=True)`);
- the experts (`num_local_experts` of width `intermediate_size`; there is no dense MLP):
  gate and up projections interleaved in one matrix (split at load), biases on gate, up
  and down, and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).

Refused: `num_experts_per_tok` above the expert count, non-positive SwiGLU settings.
"""

from __future__ import annotations

from typing import Mapping

from arcjax.errors import ModelConfigError
from arcjax.model.routing import RouterConfig

ARCHITECTURE = "GptOssForCausalLM"


def _positive(d: Mapping, name: str, default) -> float:
    value = d.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError("config.json", f"{name} must be a number > 0, got {value!r}")
    return float(value)


def fields(d: Mapping, arch: str) -> dict:
    """gpt-oss's `ModelConfig` fields ({} for another architecture)."""
    if arch != ARCHITECTURE:
        return {}
    count = d.get("num_local_experts", d.get("num_experts"))
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ModelConfigError("config.json", f"num_local_experts must be an int >= 1, "
                                              f"got {count!r}")
    top_k = d.get("num_experts_per_tok", 4)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= count:
        raise ModelConfigError("config.json", f"num_experts_per_tok must be an int in [1, "
                                              f"num_local_experts={count}], got {top_k!r}")
    return {"attention_sinks": True, "num_experts": count, "num_experts_per_tok": top_k,
            "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": False,
            "router": RouterConfig(scoring="topk_softmax", bias=True), "expert_bias": True,
            "swiglu_alpha": _positive(d, "swiglu_alpha", 1.702),
            "swiglu_limit": _positive(d, "swiglu_limit", 7.0)}


def hf_fields(cfg) -> dict:
    """The config.json fields `fields` reads (inverse; {} for another architecture)."""
    if cfg.architecture != ARCHITECTURE:
        return {}
    return {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "intermediate_size": cfg.moe_intermediate_size, "swiglu_alpha": cfg.swiglu_alpha,
            "swiglu_limit": cfg.swiglu_limit, "attention_bias": cfg.qkv_bias}
