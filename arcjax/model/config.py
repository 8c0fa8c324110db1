"""Model configuration read from a Hugging Face `config.json`.

`ModelConfig` is frozen and hashable so it can be a `jax.jit` static argument.
It covers the decoder family arcjax runs: Llama, Mistral, Qwen2 (bias on q/k/v)
and Qwen3 (RMSNorm on q and k), with GQA, explicit `head_dim`, rope scaling of
type `llama3` and `linear`, and tied embeddings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from arcjax.errors import ModelConfigError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


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
    # ("linear", factor) or None. A tuple, not a dict, so the config stays hashable.
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError("config.json", f"hidden_act {act!r} is not supported; only 'silu'")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {**legacy, **{k: v for k, v in rope.items() if k != "rope_theta"}}
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = bool(d.get("attention_bias", False))
        if d.get("mlp_bias"):
            raise ModelConfigError("config.json", "mlp_bias=True is not supported")
        if arch == "MistralForCausalLM" and d.get("sliding_window") and d.get(
                "use_sliding_window", True) and d["sliding_window"] < d.get(
                    "max_position_embeddings", 0):
            # NOTE: sliding-window attention is not implemented; contexts are
            # capped at the window so results stay exact.
            max_pos = int(d["sliding_window"])
        else:
            max_pos = int(d.get("max_position_embeddings", 2048))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=_parse_rope_scaling(scaling),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=max_pos,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict:
        """The Hugging Face config.json for this model."""
        d = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPE[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
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
        if self.rope_scaling is not None:
            kind = self.rope_scaling[0]
            if kind == "linear":
                d["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling[1]}
            else:
                _, factor, low, high, orig = self.rope_scaling
                d["rope_scaling"] = {"rope_type": "llama3", "factor": factor,
                                     "low_freq_factor": low, "high_freq_factor": high,
                                     "original_max_position_embeddings": orig}
        return d


_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_MODEL_TYPE = {v: k for k, v in _MODEL_TYPE.items()}


def _parse_rope_scaling(s: Mapping) -> tuple | None:
    kind = s.get("rope_type", s.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return ("linear", float(s["factor"]))
    if kind == "llama3":
        return ("llama3", float(s["factor"]), float(s["low_freq_factor"]),
                float(s["high_freq_factor"]), int(s["original_max_position_embeddings"]))
    raise ModelConfigError("config.json", f"rope_scaling type {kind!r} is not supported; "
                           "supported: default, linear, llama3")


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse frequencies [head_dim // 2] after rope scaling (host floats)."""
    d = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / d)) for i in range(0, d, 2)]
    if cfg.rope_scaling is None:
        return inv
    if cfg.rope_scaling[0] == "linear":
        return [f / cfg.rope_scaling[1] for f in inv]
    _, factor, low, high, orig = cfg.rope_scaling
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
