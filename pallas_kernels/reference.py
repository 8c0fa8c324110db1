"""The oracle: ragged paged attention as a plain loop over sequences.

Obviously right, float32 math, no tricks. It reads concrete values on the host,
so it is for tests and debugging, never for `jax.jit`.
"""

import jax
import jax.numpy as jnp
import numpy as np


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    block_tables: jax.Array,  # [S, max_blocks] int32
    kv_lens: jax.Array,  # [S] int32
    cu_seqlens_q: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array | int,  # scalar int32
    sm_scale: float,
) -> jax.Array:  # [T, Hq, D]
  t, hq, d = q.shape
  block_size, hkv = k_pages.shape[1], k_pages.shape[2]
  group = hq // hkv
  block_tables = np.asarray(block_tables)
  kv_lens = np.asarray(kv_lens)
  cu = np.asarray(cu_seqlens_q)
  out = jnp.zeros((t, hq, d), jnp.float32)
  for s in range(int(num_seqs)):
    q_start, q_end = int(cu[s]), int(cu[s + 1])
    q_len, kv_len = q_end - q_start, int(kv_lens[s])
    if q_len == 0:
      continue
    keys = np.arange(kv_len)
    pages = block_tables[s, keys // block_size]
    k = k_pages[pages, keys % block_size].astype(jnp.float32)  # [kv_len, Hkv, D]
    v = v_pages[pages, keys % block_size].astype(jnp.float32)  # [kv_len, Hkv, D]
    k = jnp.repeat(k, group, axis=1)  # [kv_len, Hq, D]
    v = jnp.repeat(v, group, axis=1)  # [kv_len, Hq, D]
    qs = q[q_start:q_end].astype(jnp.float32)  # [q_len, Hq, D]
    scores = jnp.einsum("qhd,khd->hqk", qs, k) * sm_scale  # [Hq, q_len, kv_len]
    # Bottom-right causal: row i sits at absolute position kv_len - q_len + i.
    positions = kv_len - q_len + np.arange(q_len)
    allowed = keys[None, :] <= positions[:, None]  # [q_len, kv_len]
    scores = jnp.where(allowed[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)  # [Hq, q_len, kv_len]
    out = out.at[q_start:q_end].set(jnp.einsum("hqk,khd->qhd", probs, v))
  return out.astype(q.dtype)
