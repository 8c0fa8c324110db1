"""The MLA oracle: absorbed latent attention as a plain loop over sequences, in float64.

Obviously right, no tricks: per sequence, gather its keys' latents and rope keys from the
pages, score every query head against them (`MLAInputs`' formula), mask bottom-right
causally, softmax, and sum the latents. It reads concrete values on the host (numpy), so
it is for tests and debugging, never for `jax.jit`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla_inputs import MLAInputs


def mla_attention_reference(inputs: MLAInputs) -> jax.Array:  # [T, Hq, Dl]
    """The oracle's output in q_latent's dtype (what `impl="reference"` returns)."""
    return jnp.asarray(mla_attention_float64(inputs).astype(np.float32)).astype(
        inputs.q_latent.dtype)


def mla_attention_float64(inputs: MLAInputs) -> np.ndarray:  # [T, Hq, Dl] float64
    """The oracle in float64 on the host (inputs upcast exactly)."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(inputs)):
        raise TypeError('impl="reference" reads concrete values on the host; '
                        "it cannot run under jit")
    f64 = np.float64
    q_lat = np.asarray(inputs.q_latent.astype(jnp.float32), f64)  # [T, Hq, Dl]
    q_rope = np.asarray(inputs.q_rope.astype(jnp.float32), f64)  # [T, Hq, Dr]
    latent = np.asarray(inputs.latent_pages.astype(jnp.float32), f64)  # [NB, bs, Dl]
    rope = np.asarray(inputs.rope_pages.astype(jnp.float32), f64)  # [NB, bs, Dr]
    tables = np.asarray(inputs.block_tables)
    kv_lens, cu = np.asarray(inputs.kv_lens), np.asarray(inputs.cu_seqlens_q)
    bs = inputs.block_size
    out = np.zeros(q_lat.shape, f64)
    for s in range(int(inputs.num_seqs)):
        q0, q1 = int(cu[s]), int(cu[s + 1])
        q_len, kv_len = q1 - q0, int(kv_lens[s])
        if q_len == 0:
            continue
        keys = np.arange(kv_len)
        pages = tables[s, keys // bs]
        c = latent[pages, keys % bs]  # [K, Dl]
        pe = rope[pages, keys % bs]  # [K, Dr]
        scores = (np.einsum("qhd,kd->hqk", q_lat[q0:q1], c)
                  + np.einsum("qhd,kd->hqk", q_rope[q0:q1], pe)) * inputs.sm_scale
        positions = kv_len - q_len + np.arange(q_len)  # bottom-right causal
        scores = np.where((keys[None, :] <= positions[:, None])[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[q0:q1] = np.einsum("hqk,kd->qhd", probs, c)
    return out
