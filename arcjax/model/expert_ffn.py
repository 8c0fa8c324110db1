"""The experts' feed-forward over tokens grouped by expert: the grouped GEMMs.

`experts_ffn` runs every held expert on its packed rows (the assignments `moe.group`
sorted by expert) and scatter-adds each row, weighted by its router weight, back to its
token; `dense_ffn` runs every expert on every token (the baseline and an independent
check). Per row: `glu(x @ gate + gate_bias, x @ up + up_bias) @ down`, the biases only for
gpt-oss (whose down bias, the same for every split of the width, the caller adds once:
`down_bias_sum`).

The gated activations (`ExpertAct`): "silu" (SwiGLU), "gelu_tanh" (GeGLU), and gpt-oss's
"swiglu_oai": `gate = min(gate, limit)`, `up = clip(up, -limit, limit)`,
`(up + 1) * gate * sigmoid(alpha * gate)`, as transformers' GptOssExperts applies it.

The two grouped GEMMs (see `moe`'s NOTE on `jax.lax.ragged_dot`): "ragged_dot", and
"tiled", each expert's group padded to whole row tiles and a loop over the live tiles only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from arcjax.model.quant import dense_at

MAX_TILE = 128  # packed rows per tile of the tiled grouped GEMM
MIN_TILE = 8
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


@dataclasses.dataclass(frozen=True)
class ExpertAct:
    """The experts' gated activation (`alpha`, `limit`: "swiglu_oai" only)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {self.kind!r}")


def activation(x: jax.Array, kind: str) -> jax.Array:
    """The gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    return jax.nn.silu(x) if kind == "silu" else jax.nn.gelu(x, approximate=True)


def glu(gate: jax.Array, up: jax.Array, act: ExpertAct) -> jax.Array:
    """The gated unit of gate and up projections [..., I]."""
    if act.kind == "swiglu_oai":
        gate = jnp.minimum(gate, act.limit)
        up = jnp.clip(up, -act.limit, act.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * act.alpha))
    return activation(gate, act.kind) * up


def down_bias_sum(weights: jax.Array, experts: jax.Array, down_bias: jax.Array,
                  layer: jax.Array, valid: jax.Array) -> jax.Array:
    """[T, H] float32: each token's chosen experts' down biases, router-weighted (the part
    of `experts_ffn`'s sum that does not depend on the input). weights, experts: [T, k];
    down_bias: [L, E, H]; valid: [T] (padding tokens get 0)."""
    b = down_bias[layer][experts].astype(jnp.float32)  # [T, k, H]
    return jnp.where(valid[:, None], jnp.sum(weights[..., None] * b, axis=1), 0.0)


def _tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about a group's expected share, a power of two in [8, 128]."""
    share = max(1, num_rows // max(1, num_groups))
    return int(min(MAX_TILE, max(MIN_TILE, 1 << (share - 1).bit_length())))


def _tiled_ffn(x: jax.Array, sizes: jax.Array, w: tuple, b: tuple | None, act: ExpertAct,
               layer: jax.Array) -> jax.Array:
    """gate/up/down over packed rows x [A, H] grouped by `sizes` [E]: each group padded to
    whole tiles; a loop over the live tiles computes each with its one expert's weights,
    `w[i][layer, expert]` (w: gate, up, down [L, E, ...]; b: their gate and up biases
    [L, E, I] or None). Rows past sum(sizes) come out 0. Returns [A, H] float32."""
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
        g, u, d = (dense_at(m, (layer, ex), x.dtype) for m in w)
        gate, up = rows @ g, rows @ u  # [tm, I]
        if b is not None:
            gate, up = gate + b[0][layer, ex].astype(x.dtype), up + b[1][layer, ex].astype(x.dtype)
        out = (glu(gate, up, act) @ d).astype(jnp.float32)  # [tm, H]
        return jax.lax.dynamic_update_slice_in_dim(y, out, i * tm, 0)

    y = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros((num_tiles * tm, hidden), jnp.float32))
    return jnp.take(y, padded, axis=0, mode="fill", fill_value=0)


def _ragged_ffn(x, sizes, w, b, act, layer):
    dt = x.dtype

    def mm(lhs, m):  # m: [L, E, in, out]; the layer's [E, in, out]
        return jax.lax.ragged_dot(lhs, dense_at(m, (layer,), dt), sizes,
                                  preferred_element_type=jnp.float32)

    gate, up = mm(x, w[0]), mm(x, w[1])  # [A, I] float32
    if b is not None:  # each packed row's expert's biases
        owner = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]),
                                             side="right"), sizes.shape[0] - 1)  # [A]
        gate = gate + b[0][layer][owner].astype(jnp.float32)
        up = up + b[1][layer][owner].astype(jnp.float32)
    return mm(glu(gate.astype(dt), up.astype(dt), act), w[2])  # [A, H] float32


def experts_ffn(x: jax.Array, order: jax.Array, sizes: jax.Array, weights: jax.Array,
                w: tuple, b: tuple | None = None, *, layer: jax.Array, first: jax.Array,
                act: ExpertAct, impl: str) -> jax.Array:
    """The experts' output for every token: a sum over the experts `w_*` hold.

    Args:
      x: [T, H] normalized hidden states.
      order, sizes: from `group` (sizes over all E experts).
      weights: [T, k] float32 router weights.
      w: (gate [L, E_local, H, I], up [L, E_local, H, I], down [L, E_local, I, H]): every
        layer's experts first .. first + E_local - 1 (all of them on one device).
      b: None, or (gate, up) biases [L, E_local, I] (gpt-oss; the down bias is the
        caller's: `down_bias_sum`, so a split of the width adds it once).
      layer: scalar int32, the layer.
      first: scalar int32, the first expert held.
      act: the gated activation.
      impl: "ragged_dot" | "tiled" (see the module docstring).

    Returns:
      [T, H] float32: sum over held experts e of weight(t, e) * expert_e(x[t]).
    """
    t = x.shape[0]
    a = order.shape[0]
    k = a // t
    local = w[0].shape[1]
    local_sizes = jax.lax.dynamic_slice_in_dim(sizes, first, local)  # [E_local]
    start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
    r = jnp.arange(a)
    live = r < jnp.sum(local_sizes)  # packed rows of the held experts
    assignment = jnp.where(live, order[jnp.minimum(start + r, a - 1)], 0)  # [A]
    token = assignment // k
    xs = x[token]  # [A, H]
    ffn = _tiled_ffn if impl == "tiled" else _ragged_ffn
    y = ffn(xs, local_sizes, w, b, act, layer)  # [A, H] float32
    y = y * jnp.where(live, weights.reshape(-1)[assignment], 0.0)[:, None]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[jnp.where(live, token, t)].add(
        y, mode="drop")


def dense_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, w: tuple,
              b: tuple | None = None, *, layer: jax.Array, act: ExpertAct) -> jax.Array:
    """The per-expert loop: every expert runs on every token, weighted by its router weight
    (0 where not chosen). E / k times the routed FLOPs; the baseline of the benchmark and an
    independent check of the grouped path. w, b: as `experts_ffn`'s. Returns [T, H]
    float32."""
    num_experts = w[0].shape[1]
    gate = jnp.sum(jnp.where(experts[..., None] == jnp.arange(num_experts), weights[..., None],
                             0.0), axis=1)  # [T, E]
    dt = x.dtype

    def body(e, acc):
        g, u, d = (dense_at(m, (layer, e), dt) for m in w)
        g_in, u_in = x @ g, x @ u
        if b is not None:
            g_in, u_in = g_in + b[0][layer, e].astype(dt), u_in + b[1][layer, e].astype(dt)
        return acc + gate[:, e, None] * (glu(g_in, u_in, act) @ d).astype(jnp.float32)

    return jax.lax.fori_loop(0, num_experts, body, jnp.zeros(x.shape, jnp.float32))
