"""The mixture-of-experts MLP: route, group tokens by expert, one grouped GEMM per weight.

Dataflow of one layer (`moe_mlp`), T tokens, E experts, k experts per token, A = T * k:

  1. `route`: router logits [T, E] -> softmax (float32) -> top-k -> optionally renormalized
     (`norm_topk_prob`; Mixtral always). Padding tokens are routed nowhere.
  2. `group`: the A (token, expert) assignments sorted by expert with ONE stable argsort of
     their expert ids (padding assignments carry id E and sort last); `sizes[e]` counts
     expert e's assignments. Row r of the packed layout is token `order[r] // k`.
  3. `experts_ffn`: gather the packed rows, then gate/up/down as grouped GEMMs over the
     `sizes` groups (`grouped_matmul`: `jax.lax.ragged_dot`, or the tiled loop below), scale
     each row by its router weight and scatter-add it back to its token (float32).
  4. With a mesh (`parallel.experts_map`), step 3 runs per device on its own experts (and
     its slice of their width) and the partial outputs are summed across devices; steps 1-2
     run replicated (every device holds every token after attention's all-reduce).

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

from arcjax.model.packed import PackedWeight
from arcjax.model.quant import QuantizedWeight, dense, dense_at, weight_axes

IMPLS = ("auto", "ragged_dot", "tiled", "dense")
# The stacked [L, E, ...] expert weights, read by (layer, expert) (see the NOTE above).
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")
MAX_TILE = 128  # packed rows per tile of the tiled grouped GEMM
MIN_TILE = 8


def activation(x: jax.Array, kind: str) -> jax.Array:
    """The gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    return jax.nn.silu(x) if kind == "silu" else jax.nn.gelu(x, approximate=True)


def route(h: jax.Array, router: jax.Array, top_k: int, renormalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """Router weights and experts of each token.

    Args:
      h: [T, H] normalized hidden states.
      router: [H, E] router weights.
      top_k: experts per token.
      renormalize: scale the top-k probabilities to sum to 1.

    Returns:
      (weights [T, k] float32, experts [T, k] int32), best expert first.
    """
    logits = (h @ router.astype(h.dtype)).astype(jnp.float32)  # [T, E]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


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


def _tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about a group's expected share, a power of two in [8, 128]."""
    share = max(1, num_rows // max(1, num_groups))
    return int(min(MAX_TILE, max(MIN_TILE, 1 << (share - 1).bit_length())))


def _tiled_ffn(x: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array, act: str, layer: jax.Array) -> jax.Array:
    """gate/up/down over packed rows x [A, H] grouped by `sizes` [E]: each group padded to
    whole tiles; a loop over the live tiles computes each with its one expert's weights,
    `w_*[layer, expert]` (w_*: [L, E, ...]). Rows past sum(sizes) come out 0. Returns [A, H]
    float32."""
    a, hidden = x.shape
    e = sizes.shape[0]
    tm = _tile_rows(a, e)
    tiles = (sizes + tm - 1) // tm  # [E] tiles per expert
    tile_end = jnp.cumsum(tiles)  # [E]
    num_tiles = a // tm + e + 1  # static bound: sum(cdiv(s, tm)) <= A / tm + E
    starts = jnp.cumsum(sizes) - sizes  # [E] first packed row of each group
    r = jnp.arange(a)
    owner = jnp.searchsorted(jnp.cumsum(sizes), r, side="right")  # [A] expert of row r
    owner_c = jnp.minimum(owner, e - 1)
    padded = (tile_end[owner_c] - tiles[owner_c]) * tm + r - starts[owner_c]  # [A]
    padded = jnp.where(owner < e, padded, num_tiles * tm)  # rows past the groups: dropped
    x_pad = jnp.zeros((num_tiles * tm, hidden), x.dtype).at[padded].set(x, mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"),
                              e - 1)  # [num_tiles]

    def body(i, y):
        rows = jax.lax.dynamic_slice_in_dim(x_pad, i * tm, tm)  # [tm, H]
        ex = tile_expert[i]
        g, u, d = (dense_at(w, (layer, ex), x.dtype) for w in (w_gate, w_up, w_down))
        out = (activation(rows @ g, act) * (rows @ u)) @ d  # [tm, H]
        out = out.astype(jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(y, out, i * tm, 0)

    y = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros((num_tiles * tm, hidden), jnp.float32))
    return jnp.take(y, padded, axis=0, mode="fill", fill_value=0)


def _ragged_ffn(x, sizes, w_gate, w_up, w_down, act, layer):
    dt = x.dtype

    def mm(lhs, w):  # w: [L, E, in, out]; the layer's [E, in, out]
        return jax.lax.ragged_dot(lhs, dense_at(w, (layer,), dt), sizes,
                                  preferred_element_type=jnp.float32)

    h = (activation(mm(x, w_gate), act) * mm(x, w_up)).astype(dt)
    return mm(h, w_down)  # [A, H] float32


def experts_ffn(x: jax.Array, order: jax.Array, sizes: jax.Array, weights: jax.Array,
                w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, layer: jax.Array,
                first: jax.Array, act: str, impl: str) -> jax.Array:
    """The experts' output for every token: a sum over the experts `w_*` hold.

    Args:
      x: [T, H] normalized hidden states.
      order, sizes: from `group` (sizes over all E experts).
      weights: [T, k] float32 router weights.
      w_gate, w_up: [L, E_local, H, I]; w_down: [L, E_local, I, H]: every layer's experts
        first .. first + E_local - 1 (all of them on one device).
      layer: scalar int32, the layer.
      first: scalar int32, the first expert held.
      act: "silu" | "gelu_tanh".
      impl: "ragged_dot" | "tiled" (see the module docstring).

    Returns:
      [T, H] float32: sum over held experts e of weight(t, e) * expert_e(x[t]).
    """
    t = x.shape[0]
    a = order.shape[0]
    k = a // t
    local = w_gate.shape[1]
    local_sizes = jax.lax.dynamic_slice_in_dim(sizes, first, local)  # [E_local]
    start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
    r = jnp.arange(a)
    live = r < jnp.sum(local_sizes)  # packed rows of the held experts
    assignment = jnp.where(live, order[jnp.minimum(start + r, a - 1)], 0)  # [A]
    token = assignment // k
    xs = x[token]  # [A, H]
    ffn = _tiled_ffn if impl == "tiled" else _ragged_ffn
    y = ffn(xs, local_sizes, w_gate, w_up, w_down, act, layer)  # [A, H] float32
    y = y * jnp.where(live, weights.reshape(-1)[assignment], 0.0)[:, None]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[jnp.where(live, token, t)].add(
        y, mode="drop")


def dense_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
              w_up: jax.Array, w_down: jax.Array, *, layer: jax.Array, act: str) -> jax.Array:
    """The per-expert loop: every expert runs on every token, weighted by its router weight
    (0 where not chosen). E / k times the routed FLOPs; the baseline of the benchmark and an
    independent check of the grouped path. w_*: [L, E, ...]. Returns [T, H] float32."""
    num_experts = w_gate.shape[1]
    gate = jnp.sum(jnp.where(experts[..., None] == jnp.arange(num_experts), weights[..., None],
                             0.0), axis=1)  # [T, E]
    dt = x.dtype

    def body(e, acc):
        g, u, d = (dense_at(w, (layer, e), dt) for w in (w_gate, w_up, w_down))
        h = activation(x @ g, act) * (x @ u)
        return acc + gate[:, e, None] * (h @ d).astype(jnp.float32)

    return jax.lax.fori_loop(0, num_experts, body, jnp.zeros(x.shape, jnp.float32))


def _shardable(w, dtype, width_split: bool, row_split: int = 1):
    """An expert weight as `experts_map` may split it. `width_split`: each expert's width
    is split; `row_split`: devices the weight's input axis splits over (we_down's input
    axis is the width; gate's and up's is not). A quantized weight stays quantized when its
    scales split with its values: one scale per column (or per tensor) when only columns
    split, one per channel (or per tensor) when rows split too; a packed one when each
    device's rows keep their groups' scales (`PackedWeight.splits_rows`). Others are
    dequantized first (GSPMD). A split by expert alone keeps every matrix whole."""
    if isinstance(w, PackedWeight):
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


def moe_mlp(h: jax.Array, lp: dict, experts: dict, layer: jax.Array, *, num_experts: int,
            top_k: int, renormalize: bool, act: str, valid: jax.Array, impl: str = "auto",
            parallel=None) -> tuple[jax.Array, jax.Array]:
    """One layer's mixture of experts (plus Qwen2-MoE's gated shared expert).

    Args:
      h: [T, H] normalized hidden states.
      lp: the layer's params: router [H, E]; optionally ws_gate/ws_up [H, Is], ws_down
        [Is, H], ws_router [H, 1].
      experts: every layer's expert weights (`EXPERT_WEIGHTS`): we_gate/we_up [L, E, H, I],
        we_down [L, E, I, H]; arrays, `QuantizedWeight`s or `PackedWeight`s (scales
        [L, E, ...]).
      layer: scalar int32, this layer.
      num_experts, top_k, renormalize, act: from the model config.
      valid: [T] bool, real tokens.
      impl: "auto" | "ragged_dot" | "tiled" | "dense".
      parallel: an `arcjax.parallel.TensorParallel` or None.

    Returns:
      (out [T, H] in h's dtype, tokens per expert [E] int32).
    """
    impl = resolve_impl(impl)
    weights, chosen = route(h, lp["router"], top_k, renormalize)
    order, sizes = group(chosen, valid, num_experts)
    w = tuple(experts[name] for name in EXPERT_WEIGHTS)
    if impl == "dense":
        out = dense_ffn(h, jnp.where(valid[:, None], weights, 0.0), chosen, *w, layer=layer,
                        act=act)
    elif parallel is None:
        out = experts_ffn(h, order, sizes, weights, *w, layer=layer, first=jnp.int32(0),
                          act=act, impl=impl)
    else:
        def local(x, route_, *w_local):
            order_, sizes_, weights_, layer_ = route_
            first = parallel.expert_offset(w_local[0].shape[1])
            return experts_ffn(x, order_, sizes_, weights_, *w_local, layer=layer_,
                               first=first, act=act, impl=impl), sizes_

        logical = (("layers", "expert", "embed", "moe_mlp"),) * 2 + (
            ("layers", "expert", "moe_mlp", "embed"),)
        width_split = parallel.degree("moe_mlp") > 1
        w = tuple(_shardable(x, h.dtype, width_split, parallel.degree(a[-2]))
                  for x, a in zip(w, logical))
        axes = tuple(weight_axes(x, a, parallel.degree) for x, a in zip(w, logical))
        out, sizes = parallel.experts_map(local, axes)(h, (order, sizes, weights, layer), *w)
    if "ws_gate" in lp:  # Qwen2-MoE: sigmoid(h @ gate) * shared MLP(h)
        dt = h.dtype
        shared = activation(h @ dense(lp["ws_gate"], dt), act) * (h @ dense(lp["ws_up"], dt))
        shared = shared @ dense(lp["ws_down"], dt)
        out = out + (jax.nn.sigmoid(h @ lp["ws_router"].astype(dt)) * shared).astype(jnp.float32)
    return out.astype(h.dtype), sizes
