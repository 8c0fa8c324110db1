"""What a DeepSeek-V2/V3 config.json (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`)
means beyond the Llama core.

`fields(d, arch, rope_scaling)` returns the `ModelConfig` fields ({} for other families),
`hf_fields(cfg)` writes them back.

- Multi-head latent attention (`MLAConfig`): `q_lora_rank` (null: none), `kv_lora_rank`,
  `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave` (V3's key; V2's
  complex-number rope rotates the same interleaved pairs). `head_dim` is the query/key
  width `qk_nope + qk_rope`; the softmax scale is its `** -0.5` times YaRN's
  `mscale(factor, mscale_all_dim) ** 2` (`sm_scale_factor`), and the rope dims' cos/sin
  carry YaRN's attention factor (`rope_scaling`, read by `families`).
- The mixture of experts: `n_routed_experts` of width `moe_intermediate_size`,
  `num_experts_per_tok`, `n_shared_experts` always-on experts (one MLP of width
  `n_shared_experts * moe_intermediate_size`, ungated), dense layers (width
  `intermediate_size`) before `first_k_dense_replace`, and the router
  (`routing.RouterConfig`): V2 softmax scores with `topk_method` greedy or
  group_limited_greedy (group score: its best expert); V3 sigmoid scores with noaux_tc
  (`e_score_correction_bias` moves the choice, the group score is its best two, weights
  renormalized with `norm_topk_prob`); `routed_scaling_factor` scales the weights.

Refused with a `ModelConfigError` naming the field: `attention_bias`, `moe_layer_freq`
other than 1, a V2 `norm_topk_prob` of true (the original code then skips the routed
scale, vLLM applies both and transformers neither: no reference to be exact against),
scoring or top-k methods other than each version's own. Not read: the multi-token
prediction layers (`num_nextn_predict_layers`; their weights are skipped at load).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from arcjax.errors import ModelConfigError
from arcjax.model.families import yarn_mscale
from arcjax.model.routing import RouterConfig

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
TOPK_METHODS = {"DeepseekV2ForCausalLM": ("greedy", "group_limited_greedy"),
                "DeepseekV3ForCausalLM": ("noaux_tc",)}
SCORING = {"DeepseekV2ForCausalLM": "softmax", "DeepseekV3ForCausalLM": "sigmoid"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): what the layer's projections are.

    Query: `x @ wq` [Hq * (nope + rope)], or with `q_lora_rank`, through a rank-r
    bottleneck with its RMSNorm. Keys and values: `x @ wkv_a` = [latent (kv_lora_rank),
    k_pe (rope)]; the latent is RMS-normed and cached with the roped k_pe; head h's key is
    `[W_uk_h latent, k_pe]`, its value `W_uv_h latent` (`wkv_b` holds both).
    """

    q_lora_rank: int | None  # None: no query bottleneck (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError("config.json", f"{name} must be an int >= 1, "
                                                      f"got {value!r}")
        rope = self.qk_rope_head_dim
        if not isinstance(rope, int) or isinstance(rope, bool) or rope < 2 or rope % 2:
            raise ModelConfigError("config.json", "qk_rope_head_dim must be an even int >= 2, "
                                                  f"got {rope!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise ModelConfigError("config.json", "q_lora_rank must be null or an int >= 1, "
                                                  f"got {self.q_lora_rank!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim



def _int(d: Mapping, name: str, default=None, low: int = 1) -> int:
    value = d.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ModelConfigError("config.json", f"{name} must be an int >= {low}, got {value!r}")
    return value


def _router(d: Mapping, arch: str, num_experts: int) -> RouterConfig:
    method = d.get("topk_method", TOPK_METHODS[arch][0])
    if method not in TOPK_METHODS[arch]:
        raise ModelConfigError("config.json", f"topk_method {method!r} is not supported for "
                               f"{arch}; supported: {', '.join(TOPK_METHODS[arch])}")
    scoring = d.get("scoring_func", SCORING[arch])
    if scoring != SCORING[arch]:
        raise ModelConfigError("config.json", f"scoring_func {scoring!r} is not supported for "
                               f"{arch}; supported: {SCORING[arch]}")
    grouped = method != "greedy"
    n_group = _int(d, "n_group", 1) if grouped and d.get("n_group") else 1
    topk_group = _int(d, "topk_group", n_group) if n_group > 1 else 1
    if topk_group > n_group or num_experts % n_group:
        raise ModelConfigError("config.json", f"topk_group ({topk_group}) must be <= n_group "
                               f"({n_group}) and n_group must divide n_routed_experts "
                               f"({num_experts})")
    factor = d.get("routed_scaling_factor", 1.0)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ModelConfigError("config.json", f"routed_scaling_factor must be a number > 0, "
                                              f"got {factor!r}")
    v3 = arch == "DeepseekV3ForCausalLM"
    return RouterConfig(scoring=scoring, correction_bias=v3, n_group=n_group,
                        topk_group=topk_group, group_score="top2_sum" if v3 else "max",
                        routed_scaling_factor=float(factor), renormalize_eps=1e-20 if v3 else 0.0)


def _experts(d: Mapping, arch: str, num_layers: int) -> dict:
    count = _int(d, "n_routed_experts", d.get("num_experts"))
    top_k = _int(d, "num_experts_per_tok")
    if top_k > count:
        raise ModelConfigError("config.json", f"num_experts_per_tok ({top_k}) exceeds "
                                              f"n_routed_experts ({count})")
    if d.get("moe_layer_freq", 1) != 1:
        raise ModelConfigError("config.json", f"moe_layer_freq={d.get('moe_layer_freq')} is "
                               "not supported (transformers reads only first_k_dense_replace)")
    first_dense = _int(d, "first_k_dense_replace", 0, low=0)
    if first_dense >= num_layers:
        raise ModelConfigError("config.json", f"first_k_dense_replace ({first_dense}) leaves "
                               f"no expert layer of {num_layers}")
    renormalize = bool(d.get("norm_topk_prob", arch == "DeepseekV3ForCausalLM"))
    if renormalize and arch == "DeepseekV2ForCausalLM":
        raise ModelConfigError("config.json", "norm_topk_prob=true is not supported for "
                               "DeepseekV2ForCausalLM (the original code, vLLM and "
                               "transformers disagree on it)")
    width = _int(d, "moe_intermediate_size")
    shared = _int(d, "n_shared_experts", 0, low=0) * width
    return {"num_experts": count, "num_experts_per_tok": top_k, "norm_topk_prob": renormalize,
            "moe_intermediate_size": width, "shared_expert_intermediate_size": shared,
            "moe_layers": tuple(i >= first_dense for i in range(num_layers)) if first_dense
            else (), "router": _router(d, arch, count)}


def fields(d: Mapping, arch: str, rope_scaling: tuple | None) -> dict:
    """DeepSeek's `ModelConfig` fields ({} for another architecture); `rope_scaling` as
    `families.rope` parsed it (YaRN's mscale_all_dim sets the softmax scale)."""
    if arch not in ARCHITECTURES:
        return {}
    if d.get("attention_bias"):
        raise ModelConfigError("config.json", f"attention_bias=true is not supported for {arch}")
    mla = MLAConfig(q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d.get("kv_lora_rank"),
                    qk_nope_head_dim=d.get("qk_nope_head_dim"),
                    qk_rope_head_dim=d.get("qk_rope_head_dim"),
                    v_head_dim=d.get("v_head_dim"),
                    # V2's complex-number rope always rotates interleaved pairs
                    rope_interleave=arch == "DeepseekV2ForCausalLM"
                    or bool(d.get("rope_interleave", True)))
    scale = 1.0
    if rope_scaling is not None and rope_scaling[0] == "yarn" and rope_scaling[8]:
        scale = yarn_mscale(rope_scaling[1], rope_scaling[8]) ** 2
    heads = d["num_attention_heads"]
    return {"mla": mla, "head_dim": mla.qk_head_dim, "num_kv_heads": heads,
            "sm_scale_factor": scale, "qkv_bias": False, "o_bias": False,
            **_experts(d, arch, d["num_hidden_layers"])}


def hf_fields(cfg) -> dict:
    """The config.json fields `fields` reads (inverse; {} for another architecture)."""
    if cfg.architecture not in ARCHITECTURES:
        return {}
    mla, router = cfg.mla, cfg.router
    first_dense = sum(not m for m in cfg.moe_layers)
    out = {"q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
           "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
           "v_head_dim": mla.v_head_dim, "rope_interleave": mla.rope_interleave,
           "head_dim": mla.qk_rope_head_dim, "n_routed_experts": cfg.num_experts,
           "n_shared_experts": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
           "first_k_dense_replace": first_dense, "moe_layer_freq": 1,
           "routed_scaling_factor": router.routed_scaling_factor,
           "n_group": router.n_group, "topk_group": router.topk_group,
           "scoring_func": router.scoring, "norm_topk_prob": cfg.norm_topk_prob,
           "attention_bias": False}
    if cfg.architecture == "DeepseekV2ForCausalLM":
        out["topk_method"] = "group_limited_greedy" if router.grouped else "greedy"
    else:
        out["topk_method"] = "noaux_tc"
    return out
