"""How a mixture of experts picks each token's experts and weights them: the router variants.

`RouterConfig` (frozen; part of `ModelConfig`) names what a family's router does and
`select` runs it on router logits `[T, E]` (float32), in this order:

  1. scores: "softmax" over all experts (Mixtral, Qwen-MoE, DeepSeek-V2), "sigmoid" per
     expert (DeepSeek-V3), or "topk_softmax" (gpt-oss: the top-k *logits* are chosen, then
     a softmax over those k alone). The router's own bias (gpt-oss) is added to the logits
     before any of them.
  2. the choice: top-k over the scores, plus DeepSeek-V3's `noaux_tc` score correction
     bias (`e_score_correction_bias`), which moves the choice but never the weights; with
     `n_group > 1`, only experts of the `topk_group` best groups of `E / n_group` may be
     chosen (a group's score: its best expert, "max", DeepSeek-V2's group_limited_greedy,
     or the sum of its best two, "top2_sum", V3's noaux_tc).
  3. the weights: the chosen experts' scores, renormalized to sum to 1 when asked
     (`norm_topk_prob`; DeepSeek-V3 adds 1e-20 to the sum), then times
     `routed_scaling_factor`.

Ties break toward the lower expert id everywhere (`jax.lax.top_k`'s order, as torch.topk
on the CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("max", "top2_sum")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """What a router does beyond plain softmax top-k (see the module docstring)."""

    scoring: str = "softmax"
    bias: bool = False  # the router linear has a bias [E] (gpt-oss)
    correction_bias: bool = False  # noaux_tc's e_score_correction_bias [E] (DeepSeek-V3)
    n_group: int = 1  # expert groups (1: no group limit)
    topk_group: int = 1  # groups a token may choose from
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    renormalize_eps: float = 0.0  # added to the renormalizing sum (DeepSeek-V3: 1e-20)

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, "
                             f"got {self.group_score!r}")
        if not (1 <= self.topk_group <= self.n_group):
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], "
                             f"got {self.topk_group}")

    @property
    def grouped(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group


def _group_mask(choice: jax.Array, cfg: RouterConfig) -> jax.Array:
    """[T, E] bool: experts in the `topk_group` best groups of each token."""
    t, e = choice.shape
    groups = choice.reshape(t, cfg.n_group, e // cfg.n_group)  # [T, G, E/G]
    if cfg.group_score == "max":
        group_scores = jnp.max(groups, axis=-1)
    else:
        group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
    keep = jnp.zeros((t, cfg.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.repeat(keep, e // cfg.n_group, axis=1)


def select(logits: jax.Array, top_k: int, renormalize: bool, cfg: RouterConfig,
           bias: jax.Array | None = None, correction: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and their weights.

    Args:
      logits: [T, E] float32 router logits (before the router's bias).
      top_k: experts per token.
      renormalize: scale the chosen weights to sum to 1 (`norm_topk_prob`).
      cfg: the router's variant.
      bias: [E] the router's bias (`cfg.bias`), or None.
      correction: [E] the noaux_tc correction bias (`cfg.correction_bias`), or None.

    Returns:
      (weights [T, k] float32, experts [T, k] int32), best (by the choice) first.
    """
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if cfg.scoring == "topk_softmax":
        top, experts = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1) * cfg.routed_scaling_factor, experts.astype(jnp.int32)
    scores = jax.nn.sigmoid(logits) if cfg.scoring == "sigmoid" else jax.nn.softmax(logits, -1)
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    if cfg.grouped:
        # Masked experts get -inf (V3) / 0 (V2's masked_fill with 0.0 on softmax scores):
        # either way never above a kept expert's non-negative score.
        choice = jnp.where(_group_mask(choice, cfg), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # the scores, never the choice
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + cfg.renormalize_eps)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)
