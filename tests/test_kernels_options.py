"""Sliding windows, logit soft-capping and quantized (scaled) pages: the oracle against
an independent dense computation, then every jnp implementation against the oracle.

NaN in keys that no row may see (past kv_len, or before every row's window) must never
reach an output.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import KernelArgumentError, ragged_paged_attention
from pallas_kernels.testing import make_batch
from support.attention_batches import FP8, FP8_MAX, LAYOUTS, draw_batch
from support.attention_batches import attention_with_options as attention
from support.attention_batches import key_slots as _keys_of
from support.attention_batches import nan_outside_windows as _nan_outside_windows


def _dense(q, k, v, scale, *, window=None, softcap=None):
    """Attention of the last q_len positions of one whole sequence, float64 numpy.

    q: [q_len, H, D]; k, v: [L, H, D] (every key of the sequence, in order)."""
    q_len, length = q.shape[0], k.shape[0]
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    pos = np.arange(length - q_len, length)[:, None]
    keys = np.arange(length)[None, :]
    ok = keys <= pos
    if window is not None:
        ok &= keys > pos - window
    s = np.where(ok[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.0), (3, 1.5), (1, None),
                                             (100, None)])
def test_reference_matches_dense(window, softcap):
    length, q_len, heads, d, bs = 23, 7, 2, 16, 4
    batch = make_batch([(q_len, length)], num_heads=heads, num_kv_heads=heads, head_dim=d,
                       block_size=bs, nan_fill=False, seed=11)
    pages, offs = _keys_of(batch, 0, length, bs)
    k = np.asarray(batch.k_pages, np.float64)[pages, offs]
    v = np.asarray(batch.v_pages, np.float64)[pages, offs]
    q = np.asarray(batch.q, np.float64) * 3.0  # large scores, so the cap bites
    expected = _dense(q, k, v, d**-0.5, window=window, softcap=softcap)
    out = ragged_paged_attention(jnp.asarray(q, jnp.float32), *batch.args()[1:],
                                 impl="reference", sliding_window=window,
                                 logit_softcap=softcap)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)
    plain = _dense(q, k, v, d**-0.5)
    assert np.abs(plain - expected).max() > 1e-3 or window == 100  # the option changed it


def test_reference_dequantizes_scaled_pages():
    batch = make_batch([(3, 10), (1, 6)], num_heads=2, num_kv_heads=1, head_dim=16,
                       block_size=4, nan_fill=False, seed=2)
    ks, vs = 0.05, 0.2
    kq, vq = (batch.k_pages / ks).astype(FP8), (batch.v_pages / vs).astype(FP8)
    args = list(batch.args())
    out = ragged_paged_attention(args[0], kq, vq, *args[3:], impl="reference",
                                 k_scale=ks, v_scale=vs)
    # The same values, dequantized by hand, as plain float32 pages.
    args[1] = kq.astype(jnp.float32) * ks
    args[2] = vq.astype(jnp.float32) * vs
    np.testing.assert_allclose(out, ragged_paged_attention(*args, impl="reference"),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS[1:3], ids=["g2-d128", "g4-d64"])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_xla_options_match_reference(layout, data):
    batch = draw_batch(data, layout, jnp.float32)
    window = data.draw(st.integers(1, 45), label="window")
    softcap = data.draw(st.sampled_from([None, 0.5]), label="softcap")
    k, v = _nan_outside_windows(batch, window, layout[3])
    args = (batch.q, k, v, *batch.args()[3:])
    # The window is traced: one executable per layout serves every window.
    out = attention(*args, sliding_window=jnp.int32(window), logit_softcap=softcap,
                    impl="xla")
    ref = ragged_paged_attention(*args, sliding_window=window, logit_softcap=softcap,
                                 impl="reference")
    out32 = np.asarray(out)
    assert not np.isnan(out32).any()
    real = int(batch.cu_seqlens_q[batch.num_seqs])
    np.testing.assert_array_equal(out32[real:], 0.0)
    np.testing.assert_allclose(out32, np.asarray(ref), atol=2e-5, rtol=2e-5)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_xla_fp8_pages_match_reference(data):
    batch = draw_batch(data, LAYOUTS[2], jnp.float32)
    ks = data.draw(st.sampled_from([0.01, 0.125, 1.0]), label="k_scale")
    vs = data.draw(st.sampled_from([0.02, 0.5]), label="v_scale")
    # NaN survives the cast: float8_e4m3fn has a NaN encoding.
    kq = jnp.clip(batch.k_pages / ks, -FP8_MAX, FP8_MAX).astype(FP8)
    vq = jnp.clip(batch.v_pages / vs, -FP8_MAX, FP8_MAX).astype(FP8)
    args = (batch.q, kq, vq, *batch.args()[3:])
    out = np.asarray(attention(*args, k_scale=jnp.float32(ks), v_scale=jnp.float32(vs),
                               impl="xla"))
    ref = np.asarray(ragged_paged_attention(*args, k_scale=ks, v_scale=vs, impl="reference"))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_long_window_skips_key_blocks_and_stays_exact():
    # Chunks and decodes far past a short window: the xla walk starts at the window.
    batch = make_batch([(200, 900), (1, 700), (64, 64)], num_heads=4, num_kv_heads=2,
                       head_dim=32, block_size=16, num_tokens=272, seq_bucket=4, seed=4)
    k, v = _nan_outside_windows(batch, 96, 16)
    args = (batch.q, k, v, *batch.args()[3:])
    out = attention(*args, sliding_window=jnp.int32(96), impl="xla")
    ref = ragged_paged_attention(*args, sliding_window=96, impl="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=2.5), "sliding_window"),
    (dict(sliding_window=jnp.ones((2,), jnp.int32)), "sliding_window"),
    (dict(logit_softcap=-1.0), "logit_softcap"),
    (dict(logit_softcap=jnp.float32(3.0)), "logit_softcap"),
    (dict(k_scale=jnp.ones((2,))), "k_scale"),
    (dict(v_scale=jnp.ones((1, 1))), "v_scale"),
])
def test_bad_options_name_the_argument(kwargs, argument):
    batch = make_batch([(2, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    with pytest.raises(KernelArgumentError, match=f"^{argument}:"):
        ragged_paged_attention(*batch.args(), impl="xla", **kwargs)
