"""The mixture-of-experts MLP: route, group tokens by expert, one grouped GEMM per weight.

Dataflow of one layer (`moe_mlp`), T tokens, E experts, k experts per token, A = T * k:

  1. `route`: router logits [T, E] (float32) -> the family's router (`routing.select`:
     softmax, sigmoid or gpt-oss's top-k-then-softmax; router bias, noaux_tc correction,
     group-limited choice, renormalization, routed scaling). Padding tokens are routed
     nowhere.
  2. `group`: the A (token, expert) assignments sorted by expert with ONE stable argsort of
     their expert ids (padding assignments carry id E and sort last); `sizes[e]` counts
     expert e's assignments. Row r of the packed layout is token `order[r] // k`.
  3. `expert_ffn.experts_ffn`: gather the packed rows, then gate/up/down as grouped GEMMs
     over the `sizes` groups (`jax.lax.ragged_dot`, or the tiled loop), the gated
     activation (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU with its gate/up biases), scale
     each row by its router weight and scatter-add it back to its token (float32); the
     experts' down biases (gpt-oss), weighted alike, join once (`down_bias_sum`).
  4. With a mesh (`parallel.experts_map`), step 3 runs per device on its own experts (and
     its slice of their width) and the partial outputs are summed across devices; steps 1-2
     run replicated (every device holds every token after attention's all-reduce).
  5. Shared experts: Qwen2-MoE's sigmoid-gated one, DeepSeek's ungated ones (one MLP of
     `n_shared_experts` widths), added to every token.

`tokens per expert` (sizes over real tokens) come back per layer for the trace.

NOTE: expert weights stay stacked over layers, [L, E, ...], and are indexed by (layer,
expert) where they are read (`EXPERT_WEIGHTS`, passed beside the layer scan rather than
through it): a scan over stacked weights hands each layer its slice, which XLA:CPU copies
whole — all E experts' matrices every layer every step, though a decode row reads only k.

NOTE: `jax.lax.ragged_dot` lowers on XLA:CPU (and on CUDA in jaxlib 0.10.2 unless cuDNN's
grouped-GEMM fusion takes it) to a dense product over ALL experts with a mask: E times the
FLOPs of the routed work. The "tiled" grouped GEMM pads each expert's group to whole row
tiles and loops over the live tiles only (one expert's weights per tile), so its cost
follows the routed rows. "auto" takes the tiled loop on CPU and ragged_dot elsewhere
(scripts/bench_moe.py, RESULTS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arcjax.model.expert_ffn import ExpertAct, activation, dense_ffn, down_bias_sum, experts_ffn
from arcjax.model.quant import PACKED, QuantizedWeight, dense, weight_axes
from arcjax.model.routing import RouterConfig, select

IMPLS = ("auto", "ragged_dot", "tiled", "dense")
# The stacked [L, E, ...] expert weights, read by (layer, expert) (see the NOTE above), and
# gpt-oss's stacked expert biases ([L, E, I] gate and up, [L, E, H] down).
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")
EXPERT_BIASES = ("be_gate", "be_up", "be_down")


def route(h: jax.Array, router: jax.Array, top_k: int, renormalize: bool,
          cfg: RouterConfig = RouterConfig(), bias: jax.Array | None = None,
          correction: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router weights and experts of each token.

    Args:
      h: [T, H] normalized hidden states.
      router: [H, E] router weights.
      top_k: experts per token.
      renormalize: scale the chosen weights to sum to 1.
      cfg: the family's router (`routing.RouterConfig`; default: softmax top-k).
      bias, correction: [E] the router's bias and the noaux_tc correction, or None.

    Returns:
      (weights [T, k] float32, experts [T, k] int32), best expert first.
    """
    if cfg.scoring == "sigmoid":  # DeepSeek-V3's router runs in float32 whatever the dtype
        logits = h.astype(jnp.float32) @ router.astype(jnp.float32)
    else:
        logits = (h @ router.astype(h.dtype)).astype(jnp.float32)  # [T, E]
    return select(logits, top_k, renormalize, cfg, bias, correction)


def group(experts: jax.Array, valid: jax.Array, num_experts: int
          ) -> tuple[jax.Array, jax.Array]:
    """Sorts the assignments by expert (one argsort).

    Args:
      experts: [T, k] int32 chosen experts.
      valid: [T] bool, real tokens (padding rows go to no expert).
      num_experts: E.

    Returns:
      (order [A] int32: assignment `t * k + j` of packed row r is order[r];
       sizes [E] int32: assignments per expert, real tokens only).
    """
    ids = jnp.where(valid[:, None], experts, num_experts).reshape(-1)  # [A]
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    sizes = jnp.zeros(num_experts + 1, jnp.int32).at[ids].add(1)[:num_experts]
    return order, sizes


def _shardable(w, dtype, width_split: bool, row_split: int = 1):
    """An expert weight as `experts_map` may split it. `width_split`: each expert's width
    is split; `row_split`: devices the weight's input axis splits over (we_down's input
    axis is the width; gate's and up's is not). A quantized weight stays quantized when its
    scales split with its values: one scale per column (or per tensor) when only columns
    split, one per channel (or per tensor) when rows split too; a packed one when each
    device's rows keep their groups' scales (`splits_rows`: `PackedWeight`'s, MXFP4's whole
    blocks). Others are
    dequantized first (GSPMD). A split by expert alone keeps every matrix whole."""
    if isinstance(w, PACKED):
        return w if row_split == 1 or w.splits_rows(row_split) else dense(w, dtype)
    if not isinstance(w, QuantizedWeight) or not width_split:
        return w
    per_column = w.scale.shape[-1] == 1 or w.block[1] == 1
    if per_column and (row_split == 1 or w.scale.shape[-2] == 1):
        return w
    return dense(w, dtype)


def resolve_impl(impl: str) -> str:
    """"auto" -> "tiled" on CPU (ragged_dot is a dense masked product there), else
    "ragged_dot"."""
    if impl not in IMPLS:
        raise ValueError(f"moe impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    return impl


def _shared_experts(h: jax.Array, lp: dict, act: str) -> jax.Array:
    """[T, H] float32: the shared experts' MLP, sigmoid-gated when `ws_router` is given."""
    dt = h.dtype
    shared = activation(h @ dense(lp["ws_gate"], dt), act) * (h @ dense(lp["ws_up"], dt))
    shared = shared @ dense(lp["ws_down"], dt)
    if "ws_router" in lp:  # Qwen2-MoE: sigmoid(h @ gate) * shared MLP(h)
        shared = jax.nn.sigmoid(h @ lp["ws_router"].astype(dt)) * shared
    return shared.astype(jnp.float32)


def moe_mlp(h: jax.Array, lp: dict, experts: dict, layer: jax.Array, *, num_experts: int,
            top_k: int, renormalize: bool, act: str | ExpertAct, valid: jax.Array,
            impl: str = "auto", parallel=None, router: RouterConfig = RouterConfig(),
            shared_act: str | None = None) -> tuple[jax.Array, jax.Array]:
    """One layer's mixture of experts (plus its shared experts).

    Args:
      h: [T, H] normalized hidden states.
      lp: the layer's params: router [H, E]; optionally router_bias [E] (gpt-oss),
        router_correction [E] (DeepSeek-V3's e_score_correction_bias), ws_gate/ws_up
        [H, Is], ws_down [Is, H] (shared experts) and ws_router [H, 1] (Qwen2-MoE's gate).
      experts: every layer's expert weights (`EXPERT_WEIGHTS`): we_gate/we_up [L, E, H, I],
        we_down [L, E, I, H]; arrays, `QuantizedWeight`s, `PackedWeight`s or `Mxfp4Weight`s
        (scales [L, E, ...]); with `EXPERT_BIASES` (gpt-oss) be_gate/be_up [L, E, I], be_down
        [L, E, H].
      layer: scalar int32, this layer.
      num_experts, top_k, renormalize: from the model config.
      act: the experts' gated activation (a kind: "silu", "gelu_tanh"; or an ExpertAct).
      valid: [T] bool, real tokens.
      impl: "auto" | "ragged_dot" | "tiled" | "dense".
      parallel: an `arcjax.parallel.TensorParallel` or None.
      router: the family's router variant.
      shared_act: the shared experts' activation (the model's hidden_act; None: act's).

    Returns:
      (out [T, H] in h's dtype, tokens per expert [E] int32).
    """
    impl = resolve_impl(impl)
    act = act if isinstance(act, ExpertAct) else ExpertAct(act)
    weights, chosen = route(h, lp["router"], top_k, renormalize, router,
                            lp.get("router_bias"), lp.get("router_correction"))
    order, sizes = group(chosen, valid, num_experts)
    w = tuple(experts[name] for name in EXPERT_WEIGHTS)
    b = tuple(experts[name] for name in EXPERT_BIASES[:2]) if "be_gate" in experts else None
    if impl == "dense":
        out = dense_ffn(h, jnp.where(valid[:, None], weights, 0.0), chosen, w, b, layer=layer,
                        act=act)
    elif parallel is None:
        out = experts_ffn(h, order, sizes, weights, w, b, layer=layer, first=jnp.int32(0),
                          act=act, impl=impl)
    else:
        biased = b is not None

        def local(x, route_, *w_local):
            order_, sizes_, weights_, layer_ = route_
            first = parallel.expert_offset(w_local[0].shape[1])
            return experts_ffn(x, order_, sizes_, weights_, w_local[:3],
                               w_local[3:] if biased else None, layer=layer_, first=first,
                               act=act, impl=impl), sizes_

        logical = (("layers", "expert", "embed", "moe_mlp"),) * 2 + (
            ("layers", "expert", "moe_mlp", "embed"),)
        width_split = parallel.degree("moe_mlp") > 1
        w = tuple(_shardable(x, h.dtype, width_split, parallel.degree(a[-2]))
                  for x, a in zip(w, logical))
        axes = tuple(weight_axes(x, a, parallel.degree) for x, a in zip(w, logical))
        if biased:  # gate and up biases split like their weights' columns
            w, axes = w + b, axes + (("layers", "expert", "moe_mlp"),) * 2
        out, sizes = parallel.experts_map(local, axes)(h, (order, sizes, weights, layer), *w)
    if "be_down" in experts:  # gpt-oss: the chosen experts' down biases, added once
        out = out + down_bias_sum(weights, chosen, experts["be_down"], layer, valid)
    if "ws_gate" in lp:
        out = out + _shared_experts(h, lp, shared_act or act.kind)
    return out.astype(h.dtype), sizes
