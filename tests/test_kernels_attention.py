"""ragged_paged_attention: every implementation against the reference oracle.

Pallas GPU kernels run here in interpret mode; those cases stay tiny because
interpret mode executes the grid one program at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import KernelArgumentError, ragged_paged_attention
from pallas_kernels.testing import make_batch
from support.attention_batches import LAYOUT_IDS, LAYOUTS, TOLERANCES, attention, draw_batch


def _check(batch, impl, dtype, **kwargs):
    ref = ragged_paged_attention(*batch.args(), impl="reference",
                                 sm_scale=kwargs.get("sm_scale"))
    out = attention(*batch.args(), impl=impl, **kwargs)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out32).any()
    real = int(batch.cu_seqlens_q[batch.num_seqs])
    np.testing.assert_array_equal(out32[real:], 0.0)  # padding rows: exact zeros
    np.testing.assert_allclose(out32, ref32, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@settings(max_examples=12)
@given(data=st.data())
def test_xla_matches_reference(layout, dtype, data):
    _check(draw_batch(data, layout, dtype), "xla", dtype)


@pytest.mark.parametrize("kind", ["decode", "first", "later"])
@settings(max_examples=6)
@given(data=st.data())
def test_xla_single_kind_batches(kind, data):
    # Decode-only, first-chunks-only and later-chunks-only batches.
    _check(draw_batch(data, LAYOUTS[2], jnp.float32, kinds=(kind,)), "xla", jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_long_chunks_use_every_tile_width(dtype):
    # Chunks longer than one tile (128 rows), plus decode rows, in one batch.
    batch = make_batch([(300, 700), (1, 513), (37, 37), (0, 9), (129, 1000)], num_heads=4,
                       num_kv_heads=2, head_dim=64, block_size=16, num_tokens=480, seq_bucket=8,
                       dtype=dtype, seed=3)
    _check(batch, "xla", dtype)


def test_xla_max_q_len_bound():
    batch = make_batch([(1, 30), (1, 7), (1, 64)], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=8, num_tokens=8, seq_bucket=4)
    _check(batch, "xla", jnp.float32, max_q_len=1, sm_scale=0.3)
    # Decode rows spanning several decode key blocks (XLA_DECODE_BLOCK_K) with ragged ends.
    batch = make_batch([(1, 700), (1, 129), (1, 1000), (1, 5)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, num_tokens=8, seq_bucket=8, seed=5)
    _check(batch, "xla", jnp.float32, max_q_len=1)


def test_traced_num_seqs_does_not_recompile():
    traces = []

    @jax.jit
    def fn(*args):
        traces.append(1)
        return ragged_paged_attention(*args, impl="xla")

    for n in (1, 2, 3):
        batch = make_batch([(2, 9), (1, 5), (3, 3)][:n], num_heads=2, num_kv_heads=1, head_dim=64,
                           block_size=4, num_tokens=8, seq_bucket=4, max_blocks=4, num_blocks=8)
        np.testing.assert_allclose(fn(*batch.args()),
                                   ragged_paged_attention(*batch.args(), impl="reference"),
                                   atol=2e-5, rtol=2e-5)
    assert len(traces) == 1


def _dense_causal_numpy(q, k, v, scale):
    """Full causal softmax attention over one whole sequence, in float64 numpy."""
    # q: [L, H, D]; k, v: [L, H, D]
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    s = np.where(np.tril(np.ones((length, length), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_later_chunk_is_bottom_right_aligned(impl):
    # A 20-token prompt whose last 6 tokens are this step's chunk: 14 keys cached.
    length, q_len, heads, d = 20, 6, 2, 64
    batch = make_batch([(q_len, length)], num_heads=heads, num_kv_heads=heads, head_dim=d,
                       block_size=4, nan_fill=False, seed=7)
    # The whole sequence's keys/values, in position order, straight from the pages.
    keys = np.arange(length)
    pages = np.asarray(batch.block_tables[0])[keys // 4]
    k = np.asarray(batch.k_pages, np.float64)[pages, keys % 4]  # [L, H, D]
    v = np.asarray(batch.v_pages, np.float64)[pages, keys % 4]
    rng = np.random.default_rng(1)
    q_all = rng.standard_normal((length, heads, d))
    q_all[-q_len:] = np.asarray(batch.q, np.float64)
    expected = _dense_causal_numpy(q_all, k, v, d**-0.5)[-q_len:]  # rows 14..19

    out = np.asarray(ragged_paged_attention(*batch.args(), impl=impl))
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    # Top-left alignment (row i attends keys 0..i) is a different, wrong answer.
    top_left = _dense_causal_numpy(q_all[-q_len:], k[:q_len], v[:q_len], d**-0.5)
    assert np.abs(top_left - expected).max() > 0.1


def test_default_scale_is_inverse_sqrt_head_dim():
    # The default is resolved before dispatch, so the oracle shows it for every impl.
    batch = make_batch([(3, 10)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    a = ragged_paged_attention(*batch.args(), impl="reference")
    b = ragged_paged_attention(*batch.args(), impl="reference", sm_scale=64**-0.5)
    c = ragged_paged_attention(*batch.args(), impl="reference", sm_scale=1.0)
    np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-3


def _valid_args():
    return make_batch([(2, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4).args()


@pytest.mark.parametrize("index, bad, argument", [
    (0, jnp.zeros((2, 4, 64, 1)), "q"),
    (0, jnp.zeros((2, 3, 64)), "k_pages"),  # Hq=3 not a multiple of Hkv=2
    (0, jnp.zeros((2, 4, 32)), "k_pages"),  # head dims differ
    (1, jnp.zeros((3, 4, 2)), "k_pages"),
    (2, jnp.zeros((3, 4, 2, 32)), "v_pages"),
    (3, jnp.zeros((2,), jnp.int32), "block_tables"),
    (3, jnp.zeros((1, 2), jnp.float32), "block_tables"),
    (4, jnp.zeros((2,), jnp.int32), "kv_lens"),
    (5, jnp.zeros((3,), jnp.int32), "cu_seqlens_q"),
    (6, jnp.zeros((1,), jnp.int32), "num_seqs"),
])
def test_invalid_inputs_name_the_argument(index, bad, argument):
    args = list(_valid_args())
    args[index] = bad
    with pytest.raises(KernelArgumentError, match=f"^{argument}:") as info:
        ragged_paged_attention(*args, impl="xla")
    assert info.value.argument == argument
    assert isinstance(info.value, ValueError)


def test_reference_refuses_jit():
    with pytest.raises(TypeError, match="under jit"):
        attention(*_valid_args(), impl="reference")


def test_unknown_impl_is_rejected():
    with pytest.raises(KernelArgumentError, match="^impl:"):
        ragged_paged_attention(*_valid_args(), impl="cuda")


def test_bad_max_q_len_is_rejected():
    with pytest.raises(KernelArgumentError, match="^max_q_len:"):
        ragged_paged_attention(*_valid_args(), impl="xla", max_q_len=0)
