"""The decoder: pure functions over a params pytree.

Two entry points share every layer's code and differ only in attention:

1. `forward(params, cache, batch, cfg=..., attn_impl=...)`: the engine's step. A flat
   ragged batch of T tokens from S sequences (decode rows and prompt chunks mixed),
   K/V written into the paged cache through `batch.slot_mapping`, attention through
   `pallas_kernels.ragged_paged_attention` (bottom-right causal), logits only for
   `batch.logits_rows`.
2. `forward_dense(params, cfg, token_ids)`: plain causal attention over whole
   sequences `[B, L]`, for training and as an independent check.

Params and cache layouts are declared once in `arcjax.model.specs`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels
from arcjax.model.config import ModelConfig, rope_inv_freq
from arcjax.model.quant import dense
from arcjax.model.specs import CACHE_AXES, Cache, Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Device inputs of one engine step, padded to a (T, S) bucket."""

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, absolute position of each token
    slot_mapping: jax.Array  # [T] int32, cache slot per token; padding: out of range
    cu_seqlens_q: jax.Array  # [S+1] int32
    kv_lens: jax.Array  # [S] int32, keys per sequence, this step's included
    block_tables: jax.Array  # [S, max_blocks] int32
    num_seqs: jax.Array  # [] int32, real sequences (the rest is padding)
    logits_rows: jax.Array  # [S] int32, token row whose logits sequence s needs


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotary embedding, Hugging Face's rotate-half layout. x: [..., T, Hx, D]."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _qkv(lp: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """Projections, q/k norm and rope. x: [..., T, H] -> q [..., T, Hq, D], k/v [..., T, Hkv, D]."""
    dt = x.dtype
    # dense(): a quantized weight (FP8/INT8) is dequantized here, inside the step.
    q, k, v = x @ dense(lp["wq"], dt), x @ dense(lp["wk"], dt), x @ dense(lp["wv"], dt)
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"].astype(dt), k + lp["bk"].astype(dt), v + lp["bv"].astype(dt)
    lead = x.shape[:-1]
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return rope(q, positions, cfg), rope(k, positions, cfg), v


def _block(lp: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig, attend):
    """One decoder layer. `attend(q, k, v) -> ([..., T, Hq, D], aux)` is the only difference
    between the paged and dense modes."""
    dt = x.dtype
    with jax.named_scope("qkv"):
        q, k, v = _qkv(lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions, cfg)
    with jax.named_scope("attention"):
        attn, aux = attend(q, k, v)
    with jax.named_scope("o_proj"):
        out = attn.reshape(*attn.shape[:-2], -1) @ dense(lp["wo"], dt)
        if cfg.o_bias:
            out = out + lp["bo"].astype(dt)
        x = x + out
    with jax.named_scope("mlp"):
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        h = jax.nn.silu(h @ dense(lp["w_gate"], dt)) * (h @ dense(lp["w_up"], dt))
        x = x + h @ dense(lp["w_down"], dt)
    return x, aux


def _lm_head(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h @ w.astype(h.dtype)).astype(jnp.float32)


def forward(params: Params, cache: Cache, batch: StepBatch, *, cfg: ModelConfig,
            attn_impl: str = "auto", dtype=jnp.float32,
            max_q_len: int | None = None, parallel=None) -> tuple[jax.Array, Cache]:
    """One ragged step over the paged cache.

    `max_q_len` (static) bounds every sequence's chunk length in this batch (1 for a
    decode-only bucket); it lets the attention kernel size its query tiles.
    `parallel` (static; an `arcjax.parallel.TensorParallel` or None): with it, `write_kv`
    and attention run under `shard_map` over the KV-head axis (a Pallas kernel cannot be
    partitioned by GSPMD), and the logits are gathered to every device.

    Returns:
      logits [S, V] float32 at `batch.logits_rows`, and the updated cache.
    """
    x = params["embed"][batch.token_ids].astype(dtype)  # [T, H]
    block_size = cache["k"].shape[1]
    num_blocks = cache["k"].shape[0] // cfg.num_layers  # blocks per layer
    layer_slots = num_blocks * block_size
    valid_slot = batch.slot_mapping < layer_slots  # padding rows carry an out-of-range slot

    scaled = "k_scale" in cache  # FP8 pages: one K and one V scale per layer

    def layer(carry, xs):
        x, k_cache, v_cache = carry
        lp, l = xs
        slots = jnp.where(valid_slot, batch.slot_mapping + l * layer_slots,
                          cfg.num_layers * layer_slots)  # [T]; still out of range if padding
        tables = batch.block_tables + l * num_blocks  # [S, max_blocks]
        # [] float32 each, or None: quantized on write, upcast inside attention.
        k_scale = cache["k_scale"][l] if scaled else None
        v_scale = cache["v_scale"][l] if scaled else None

        def paged(q, k, v, kc, vc, slots, tables, kv_lens, cu_seqlens_q, num_seqs, k_scale,
                  v_scale):
            kc, vc = pallas_kernels.write_kv(kc, vc, k, v, slots, k_scale=k_scale,
                                             v_scale=v_scale)
            out = pallas_kernels.ragged_paged_attention(
                q, kc, vc, tables, kv_lens, cu_seqlens_q, num_seqs, impl=attn_impl,
                max_q_len=max_q_len, k_scale=k_scale, v_scale=v_scale)
            return out.astype(q.dtype), kc, vc

        if parallel is not None:  # per device: its heads, its KV heads, its cache shard
            paged = parallel.attention_map(paged, (None, "heads", None),
                                           (None, "kv_heads", None), CACHE_AXES, num_rest=7)

        def attend(q, k, v):
            out, kc, vc = paged(q, k, v, k_cache, v_cache, slots, tables, batch.kv_lens,
                                batch.cu_seqlens_q, batch.num_seqs, k_scale, v_scale)
            return out, (kc, vc)

        x, (k_cache, v_cache) = _block(lp, x, batch.positions, cfg, attend)
        return (x, k_cache, v_cache), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, k_new, v_new), _ = jax.lax.scan(layer, (x, cache["k"], cache["v"]),
                                        (params["layers"], layer_ids))
    logits = _lm_head(params, cfg, x[batch.logits_rows])  # [S, V]
    if parallel is not None:
        # Keep the projection split by vocabulary (else GSPMD may all-gather a tied
        # embedding's whole table), then gather the rows: sampling reads whole rows.
        logits = jax.lax.with_sharding_constraint(logits, parallel.sharding((None, "vocab")))
        logits = jax.lax.with_sharding_constraint(logits, parallel.replicated)
    return logits, {**cache, "k": k_new, "v": v_new}


def forward_dense(params: Params, cfg: ModelConfig, token_ids: jax.Array,
                  dtype=jnp.float32) -> jax.Array:
    """Causal full-sequence forward. token_ids [B, L] -> logits [B, L, V] float32."""
    B, L = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    x = params["embed"][token_ids].astype(dtype)  # [B, L, H]
    causal = jnp.tril(jnp.ones((L, L), bool))

    def attend(q, k, v):  # q [B, L, Hq, D], k/v [B, L, Hkv, D]
        k = jnp.repeat(k, cfg.q_per_kv, axis=2)
        v = jnp.repeat(v, cfg.q_per_kv, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        s = jnp.where(causal, s * cfg.head_dim ** -0.5, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), None

    def layer(x, lp):
        x, _ = _block(lp, x, positions, cfg, attend)
        return x, None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return _lm_head(params, cfg, x)
