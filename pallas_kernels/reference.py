"""The oracle: ragged paged attention as a plain loop over sequences.

Obviously right, float32 math, no tricks. It reads concrete values on the host
and does the per-sequence math in numpy (eager jnp would compile afresh for
every new ragged shape, which makes property tests crawl). It is for tests and
debugging, never for `jax.jit`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention_inputs import AttentionInputs


def ragged_paged_attention_reference(inputs: AttentionInputs) -> jax.Array:  # [T, Hq, D]
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(inputs)):
        raise TypeError('impl="reference" reads concrete values on the host; '
                        "it cannot run under jit")
    q, sliding_window, logit_softcap = inputs.q, inputs.sliding_window, inputs.logit_softcap
    k_scale, v_scale, sm_scale = inputs.k_scale, inputs.v_scale, np.float32(inputs.sm_scale)
    t, hq, d = q.shape
    block_size, hkv = inputs.block_size, inputs.num_kv_heads
    group = hq // hkv
    q_host = np.asarray(q.astype(jnp.float32))
    k_host = np.asarray(inputs.k_pages.astype(jnp.float32))
    v_host = np.asarray(inputs.v_pages.astype(jnp.float32))
    if k_scale is not None:  # quantized pages hold value / scale
        k_host = k_host * np.float32(k_scale)
    if v_scale is not None:
        v_host = v_host * np.float32(v_scale)
    # [Hq] sink logits: one more term of every row's softmax denominator, no value.
    sinks = None if inputs.sinks is None else np.asarray(inputs.sinks, np.float32)
    block_tables = np.asarray(inputs.block_tables)
    kv_lens = np.asarray(inputs.kv_lens)
    cu = np.asarray(inputs.cu_seqlens_q)
    out = np.zeros((t, hq, d), np.float32)
    for s in range(int(inputs.num_seqs)):
        q_start, q_end = int(cu[s]), int(cu[s + 1])
        q_len, kv_len = q_end - q_start, int(kv_lens[s])
        if q_len == 0:
            continue
        # Keys older than row 0's window are never seen (later rows' windows start later).
        first = 0 if sliding_window is None else max(0, kv_len - q_len - int(sliding_window) + 1)
        keys = np.arange(first, kv_len)
        pages = block_tables[s, keys // block_size]
        k = np.repeat(k_host[pages, keys % block_size], group, axis=1)  # [K, Hq, D]
        v = np.repeat(v_host[pages, keys % block_size], group, axis=1)  # [K, Hq, D]
        scores = np.einsum("qhd,khd->hqk", q_host[q_start:q_end], k) * sm_scale
        if logit_softcap is not None:
            scores = np.float32(logit_softcap) * np.tanh(scores / np.float32(logit_softcap))
        # Bottom-right causal: row i sits at absolute position kv_len - q_len + i.
        positions = kv_len - q_len + np.arange(q_len)
        allowed = keys[None, :] <= positions[:, None]  # [q_len, K]
        if sliding_window is not None:  # keys in (position - window, position]
            allowed &= keys[None, :] > positions[:, None] - int(sliding_window)
        scores = np.where(allowed[None], scores, -np.inf)  # [Hq, q_len, K]
        top = scores.max(axis=-1, keepdims=True)  # [Hq, q_len, 1]
        if sinks is not None:
            top = np.maximum(top, sinks[:, None, None])
        probs = np.exp(scores - top)
        den = probs.sum(axis=-1, keepdims=True)
        if sinks is not None:
            den = den + np.exp(sinks[:, None, None] - top)
        probs /= den
        out[q_start:q_end] = np.einsum("hqk,khd->qhd", probs, v)
    return jnp.asarray(out).astype(q.dtype)
