"""Model configuration read from a Hugging Face `config.json`.

`ModelConfig` is frozen and hashable so it can be a `jax.jit` static argument.
It covers the decoder family arcjax runs: Llama, Mistral, Qwen2 (bias on q/k/v)
and Qwen3 (RMSNorm on q and k), with GQA, explicit `head_dim`, rope scaling of
type `llama3`, `linear` and `yarn`, and tied embeddings; the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE; Gemma 2 and Gemma 3 (text); per-layer sliding windows; gpt-oss
(attention sinks, a biased router, experts with biases and a clamped SwiGLU) and
DeepSeek-V2/V3 (multi-head latent attention, `MLAConfig`; grouped and corrected routing,
`routing.RouterConfig`; shared experts; dense layers before the expert layers).
What each family's fields mean is read in `arcjax.model.families` (and its family modules).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from arcjax.errors import ModelConfigError
from arcjax.model import deepseek_config, families, gpt_oss_config
from arcjax.model.deepseek_config import MLAConfig
from arcjax.model.routing import RouterConfig

SUPPORTED_ARCHITECTURES = tuple(families.MODEL_TYPES)
# The window a global layer of a mixed local/global model passes to attention: longer than
# any position, so one executable serves both kinds of layer.
GLOBAL_WINDOW = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_pos) or
    # ("linear", factor) or ("freq_factors", f_0, ..., f_{D/2-1}) (a divisor per frequency,
    # as GGUF files store llama3 scaling) or None. A tuple, not a dict, so the config
    # stays hashable.
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma)
    # Sliding windows: a sliding layer's query at position p sees keys in (p - window, p].
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # one per layer; () = no layer slides
    # Gemma 3: the sliding layers' own rope (None: every layer uses rope_theta/rope_scaling).
    local_rope_theta: float | None = None
    local_rope_scaling: tuple | None = None
    # Mixture of experts (num_experts == 0: a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert
    # Gemma
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # norms after attention and after the MLP too
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # gpt-oss
    attention_sinks: bool = False  # a learned logit per head in every softmax denominator
    expert_bias: bool = False  # biases on every expert's gate, up and down projections
    # The clamped SwiGLU of gpt-oss's experts (None: the experts use hidden_act):
    # gate = min(gate, limit), up = clip(up, -limit, limit),
    # out = (up + 1) * gate * sigmoid(alpha * gate).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek-V2/V3
    mla: MLAConfig | None = None  # multi-head latent attention (None: per-head K/V)
    sm_scale_factor: float = 1.0  # times head_dim ** -0.5 (YaRN's mscale_all_dim ** 2)
    # Which layers are mixtures of experts when dense layers mix in (DeepSeek's
    # first_k_dense_replace); () = every layer is of the model's kind.
    moe_layers: tuple[bool, ...] = ()
    shared_expert_gate: bool = False  # Qwen2-MoE gates its shared expert by a sigmoid
    router: RouterConfig = RouterConfig()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError("config.json", f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                "config.json",
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                "config.json",
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.moe_layers and (len(self.moe_layers) != self.num_layers or not self.is_moe
                                or not any(self.moe_layers)
                                or list(self.moe_layers) != sorted(self.moe_layers)):
            raise ModelConfigError("config.json", f"moe_layers must give each of the "
                                   f"{self.num_layers} layers a kind, dense layers first "
                                   "then an expert layer at least, and only for a mixture "
                                   "of experts")
        if self.router.grouped and (self.num_experts % self.router.n_group or (
                self.router.topk_group * self.num_experts // self.router.n_group
                < self.num_experts_per_tok)):
            raise ModelConfigError("config.json", f"n_group ({self.router.n_group}) must "
                                   f"divide n_routed_experts ({self.num_experts}) and "
                                   f"topk_group ({self.router.topk_group}) groups must hold "
                                   f"num_experts_per_tok ({self.num_experts_per_tok}) experts")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ModelConfigError("config.json", f"hidden_act {self.hidden_act!r} is not "
                                                  "supported; supported: silu, gelu_tanh")
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ModelConfigError("config.json", "sliding_window and sliding_layers must be "
                                                  "set together")
        if self.sliding_layers and (len(self.sliding_layers) != self.num_layers
                                    or not any(self.sliding_layers) or self.sliding_window < 1):
            raise ModelConfigError("config.json", f"sliding_layers must give each of the "
                                   f"{self.num_layers} layers a kind, one sliding at least, "
                                   f"and sliding_window must be >= 1 (got "
                                   f"{self.sliding_window})")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise ModelConfigError("config.json", f"num_experts_per_tok must be in [1, "
                                   f"num_experts={self.num_experts}] and moe_intermediate_size "
                                   ">= 1")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def all_sliding(self) -> bool:
        """Every layer slides with the same window: KV older than it is never read again."""
        return bool(self.sliding_layers) and all(self.sliding_layers)

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def mixed_layers(self) -> bool:
        """Dense and expert layers mix (`moe_layers`)."""
        return bool(self.moe_layers) and not all(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        """Dense layers before the expert layers (DeepSeek's first_k_dense_replace; 0 when
        every layer is of the model's kind)."""
        return self.moe_layers.count(False) if self.moe_layers else 0

    @property
    def expert_act(self) -> str:
        """The experts' activation: "swiglu_oai" (gpt-oss's clamped SwiGLU) or hidden_act."""
        return "swiglu_oai" if self.swiglu_limit is not None else self.hidden_act

    @property
    def rope_dim(self) -> int:
        """Dimensions rope rotates per head: head_dim, or MLA's qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def sm_scale(self) -> float:
        """The attention softmax scale."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * self.sm_scale_factor

    def kv_values_per_token(self) -> int:
        """Cache values one token holds per layer: MLA's latent and rope key, else a key
        and a value per KV head (what sizes the cache, next to `per_head_kv_values`)."""
        return self.mla.cache_width if self.mla is not None else self.per_head_kv_values()

    def per_head_kv_values(self) -> int:
        """Values per token and layer were keys and values stored per head (for MLA: the
        16 * (192 + 128) of DeepSeek-V2-Lite's expanded heads)."""
        if self.mla is not None:
            return self.num_kv_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        return 2 * self.num_kv_heads * self.head_dim

    def layer_windows(self) -> tuple[int, ...] | None:
        """Each layer's attention window (`GLOBAL_WINDOW` for a full-attention layer of a
        mixed model), or None when no layer slides."""
        if not self.sliding_layers:
            return None
        return tuple(self.sliding_window if s else GLOBAL_WINDOW for s in self.sliding_layers)

    def with_kv_repeat(self, repeat: int) -> "ModelConfig":
        """The model with each KV head stored `repeat` times (what a device holds when
        tensor parallelism splits more ways than there are KV heads)."""
        if repeat == 1:
            return self
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads * repeat)

    @classmethod
    def from_hf_dict(cls, d: Mapping) -> "ModelConfig":
        """Builds the config from a parsed Hugging Face config.json."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(d.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                "config.json",
                f"architecture {arch or d.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = bool(d.get("attention_bias", False))
        if d.get("mlp_bias"):
            raise ModelConfigError("config.json", "mlp_bias=True is not supported")
        num_layers = d["num_hidden_layers"]
        qkv_bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        gemma = families.gemma(d, arch)
        fields = dict(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", bool(gemma))),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=not qkv_bias and attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=families.activation(d, arch),
        )
        fields |= families.rope(d, arch)
        fields |= families.windows(d, arch, num_layers)
        fields |= families.experts(d, arch, num_layers)
        fields |= gemma
        fields |= gpt_oss_config.fields(d, arch)
        fields |= deepseek_config.fields(d, arch, fields["rope_scaling"])
        return cls(**fields)

    def to_hf_dict(self) -> dict:
        """The Hugging Face config.json for this model."""
        gemma = self.architecture in families.GEMMA_ARCHITECTURES
        d = {
            "architectures": [self.architecture],
            "model_type": families.MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_activation" if gemma else "hidden_act":
                "gelu_pytorch_tanh" if self.hidden_act == "gelu_tanh" else "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.o_bias,
            "torch_dtype": "float32",
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                 else list(self.eos_token_ids))
        d |= families.hf_rope(self.architecture, self.rope_theta, self.rope_scaling,
                              self.local_rope_theta, self.local_rope_scaling)
        if self.sliding_layers:
            d |= {"sliding_window": self.sliding_window, "use_sliding_window": True,
                  "layer_types": ["sliding_attention" if s else "full_attention"
                                  for s in self.sliding_layers]}
        if self.is_moe:
            d |= {"num_experts": self.num_experts, "num_local_experts": self.num_experts,
                  "num_experts_per_tok": self.num_experts_per_tok,
                  "moe_intermediate_size": self.moe_intermediate_size,
                  "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": 1,
                  "mlp_only_layers": [],
                  "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        if gemma:
            d |= {"query_pre_attn_scalar": self.query_pre_attn_scalar,
                  "attn_logit_softcapping": self.attn_logit_softcap,
                  "final_logit_softcapping": self.final_logit_softcap}
        d |= gpt_oss_config.hf_fields(self)
        d |= deepseek_config.hf_fields(self)
        return d


_ARCH_BY_MODEL_TYPE = {v: k for k, v in families.MODEL_TYPES.items()}


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> list[float]:
    """Inverse frequencies [head_dim // 2] after rope scaling (host floats); `local`: of the
    sliding layers' own rope (Gemma 3), where the model has one."""
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    if local and cfg.local_rope_theta is not None:
        theta, scaling = cfg.local_rope_theta, cfg.local_rope_scaling
    d = cfg.rope_dim
    inv = [1.0 / (theta ** (i / d)) for i in range(0, d, 2)]
    if scaling is None:
        return inv
    if scaling[0] == "linear":
        return [f / scaling[1] for f in inv]
    if scaling[0] == "freq_factors":
        return [f / float(s) for f, s in zip(inv, scaling[1:], strict=True)]
    if scaling[0] == "yarn":
        return _yarn_inv_freq(inv, d, theta, scaling)
    _, factor, low, high, orig = scaling
    low_wavelen, high_wavelen = orig / low, orig / high
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _yarn_inv_freq(inv: list[float], dim: int, theta: float, scaling: tuple) -> list[float]:
    """YaRN: each frequency between extrapolation (kept) and interpolation (/ factor) by a
    linear ramp over the dims whose rotations at the original context fall between
    beta_slow and beta_fast (transformers' `_compute_yarn_parameters`)."""
    _, factor, orig, beta_fast, beta_slow, _, truncate, _, _ = scaling

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1 - ramp
        out.append(f / factor * (1 - extrapolation) + f * extrapolation)
    return out


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What rope's cos and sin are multiplied by (YaRN's attention factor; 1 otherwise):
    both q's and k's rotated dims scale by it."""
    scaling = cfg.rope_scaling
    return scaling[5] if scaling is not None and scaling[0] == "yarn" else 1.0
