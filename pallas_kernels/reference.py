"""The oracle: ragged paged attention as a plain loop over sequences.

Obviously right, float32 math, no tricks. It reads concrete values on the host
and does the per-sequence math in numpy (eager jnp would compile afresh for
every new ragged shape, which makes property tests crawl). It is for tests and
debugging, never for `jax.jit`.
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
    if isinstance(q, jax.core.Tracer) or isinstance(num_seqs, jax.core.Tracer):
        raise TypeError('impl="reference" reads concrete values on the host; '
                        "it cannot run under jit")
    t, hq, d = q.shape
    block_size, hkv = k_pages.shape[1], k_pages.shape[2]
    group = hq // hkv
    q_host = np.asarray(q.astype(jnp.float32))
    k_host = np.asarray(k_pages.astype(jnp.float32))
    v_host = np.asarray(v_pages.astype(jnp.float32))
    block_tables = np.asarray(block_tables)
    kv_lens = np.asarray(kv_lens)
    cu = np.asarray(cu_seqlens_q)
    out = np.zeros((t, hq, d), np.float32)
    for s in range(int(num_seqs)):
        q_start, q_end = int(cu[s]), int(cu[s + 1])
        q_len, kv_len = q_end - q_start, int(kv_lens[s])
        if q_len == 0:
            continue
        keys = np.arange(kv_len)
        pages = block_tables[s, keys // block_size]
        k = np.repeat(k_host[pages, keys % block_size], group, axis=1)  # [kv_len, Hq, D]
        v = np.repeat(v_host[pages, keys % block_size], group, axis=1)  # [kv_len, Hq, D]
        scores = np.einsum("qhd,khd->hqk", q_host[q_start:q_end], k) * np.float32(sm_scale)
        # Bottom-right causal: row i sits at absolute position kv_len - q_len + i.
        positions = kv_len - q_len + np.arange(q_len)
        allowed = keys[None, :] <= positions[:, None]  # [q_len, kv_len]
        scores = np.where(allowed[None], scores, -np.inf)  # [Hq, q_len, kv_len]
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[q_start:q_end] = np.einsum("hqk,khd->qhd", probs, v)
    return jnp.asarray(out).astype(q.dtype)
