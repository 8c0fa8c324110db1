"""Random ragged batches for the attention kernel tests, and what every implementation's
test checks them with: head layouts, per-dtype tolerances, one jitted entry point per
option set (so every example of one layout reuses one executable), FP8 page constants, and
NaN planted where no row may look (keys before every row's sliding window).

Pallas GPU kernels run in interpret mode on the CPU; batches stay tiny because interpret
mode executes the grid one program at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention
from pallas_kernels.testing import make_batch

# Per-dtype tolerances against the float32 reference on the same (rounded) inputs.
# bfloat16 outputs are rounded to 8 mantissa bits (relative step 2**-8) and the
# Pallas kernel feeds bf16 probabilities to its second matmul.
TOLERANCES = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


# One jitted entry point for the plain kernels, one for the options (soft-capping): a compile
# cache keyed by shapes and statics, so every example of one layout reuses one executable.
attention = jax.jit(ragged_paged_attention,
                    static_argnames=("sm_scale", "impl", "interpret", "max_q_len"))
attention_with_options = jax.jit(ragged_paged_attention,
                                 static_argnames=("sm_scale", "impl", "interpret", "max_q_len",
                                                  "logit_softcap"))
FP8 = jnp.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


# Head layouts (Hkv, Hq / Hkv, D, block_size): GQA ratios 1, 2, 4, 8; D 64 and 128.
LAYOUTS = [(2, 1, 64, 4), (1, 2, 128, 8), (2, 4, 64, 8), (1, 8, 128, 4)]
LAYOUT_IDS = [f"hkv{h}-g{g}-d{d}-bs{b}" for h, g, d, b in LAYOUTS]

KINDS = ("decode", "first", "later", "empty")


@st.composite
def ragged_seqs(draw, *, max_seqs, max_kv, max_tokens, kinds=KINDS):
    """(q_len, kv_len) per live sequence: decode, first chunk, later chunk or idle.

    Query lengths are trimmed so the batch fits `max_tokens` rows (a trimmed
    first chunk becomes a later chunk).
    """
    seqs, budget = [], max_tokens
    for _ in range(draw(st.integers(1, max_seqs))):
        kind = draw(st.sampled_from(kinds))
        kv = draw(st.integers(2, max_kv))
        q = {"decode": 1, "first": kv, "later": draw(st.integers(1, kv - 1)), "empty": 0}[kind]
        q = min(q, budget)
        budget -= q
        seqs.append((q, kv))
    return seqs


def draw_batch(data, layout, dtype, *, max_seqs=5, max_kv=40, num_tokens=48, seq_bucket=6,
               kinds=KINDS):
    """A batch with fixed bucket shapes for `layout`, so each layout compiles once."""
    hkv, group, head_dim, block_size = layout
    seqs = data.draw(ragged_seqs(max_seqs=max_seqs, max_kv=max_kv, max_tokens=num_tokens,
                                 kinds=kinds), label="(q_len, kv_len)")
    max_blocks = -(-max_kv // block_size) + 1  # one spare column of garbage
    return make_batch(
        seqs, num_heads=hkv * group, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size,
        num_tokens=num_tokens, seq_bucket=seq_bucket, max_blocks=max_blocks,
        num_blocks=seq_bucket * max_blocks, dtype=dtype,
        scramble=data.draw(st.booleans(), label="scramble"),
        seed=data.draw(st.integers(0, 2**16), label="seed"))


def key_slots(batch, s, length, block_size):
    """(page, offset) of keys 0 .. length - 1 of sequence `s` of `batch`."""
    keys = np.arange(length)
    pages = np.asarray(batch.block_tables[s])[keys // block_size]
    return pages, keys % block_size


def nan_outside_windows(batch, window, block_size):
    """NaN in every key that sits before the window of every row of its sequence."""
    k, v = np.array(batch.k_pages), np.array(batch.v_pages)
    cu, kv_lens = np.asarray(batch.cu_seqlens_q), np.asarray(batch.kv_lens)
    for s in range(int(batch.num_seqs)):
        q_len, kv_len = int(cu[s + 1] - cu[s]), int(kv_lens[s])
        if q_len == 0:
            continue
        first_seen = kv_len - q_len - window + 1  # row 0's oldest visible key
        if first_seen > 0:
            pages, offs = key_slots(batch, s, first_seen, block_size)
            k[pages, offs] = np.nan
            v[pages, offs] = np.nan
    return jnp.asarray(k, batch.k_pages.dtype), jnp.asarray(v, batch.v_pages.dtype)
