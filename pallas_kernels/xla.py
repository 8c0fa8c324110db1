"""Vectorized jnp ragged paged attention: the CPU engine's path and the fallback."""

import jax
import jax.numpy as jnp


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    block_tables: jax.Array,  # [S, max_blocks] int32
    kv_lens: jax.Array,  # [S] int32
    cu_seqlens_q: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # scalar int32
    sm_scale: float,
    max_q_len: int,
) -> jax.Array:  # [T, Hq, D]
  t, hq, d = q.shape
  s_max, max_blocks = block_tables.shape
  block_size, hkv = k_pages.shape[1], k_pages.shape[2]
  group = hq // hkv
  k_max = max_blocks * block_size

  q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [S]
  live = jnp.arange(s_max) < num_seqs  # [S]
  rows = jnp.arange(max_q_len)  # [Qm]
  row_ok = live[:, None] & (rows[None, :] < q_lens[:, None])  # [S, Qm]
  row_idx = jnp.where(row_ok, cu_seqlens_q[:-1, None] + rows[None, :], t)  # [S, Qm]
  qs = q.at[row_idx].get(mode="fill", fill_value=0)  # [S, Qm, Hq, D]
  qs = qs.reshape(s_max, max_q_len, hkv, group, d).astype(jnp.float32)

  k = k_pages[block_tables].reshape(s_max, k_max, hkv, d)  # [S, K, Hkv, D]
  v = v_pages[block_tables].reshape(s_max, k_max, hkv, d)  # [S, K, Hkv, D]
  keys = jnp.arange(k_max)
  key_ok = keys[None, :] < kv_lens[:, None]  # [S, K]
  v = jnp.where(key_ok[:, :, None, None], v, 0).astype(jnp.float32)

  scores = jnp.einsum("sqhgd,skhd->shgqk", qs, k.astype(jnp.float32)) * sm_scale
  q0 = kv_lens - q_lens  # [S]
  allowed = key_ok[:, None, :] & (keys[None, None, :] <= (q0[:, None] + rows[None, :])[:, :, None])
  scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)  # [S, Hkv, G, Qm, K]
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0)
  p = jnp.exp(scores - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1)
  o = jnp.einsum("shgqk,skhd->sqhgd", p, v).reshape(s_max, max_q_len, hq, d)
  out = jnp.zeros((t, hq, d), q.dtype)
  return out.at[row_idx].set(o.astype(q.dtype), mode="drop")
