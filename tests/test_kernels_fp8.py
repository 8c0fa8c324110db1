"""The FP8 KV cache in every attention implementation: float8_e4m3fn pages with a K and a
V scale, quantized by `write_kv`, upcast inside attention.

Two kinds of check:
- Exactness of each implementation on the same FP8 pages: the Pallas GPU kernel
  (interpret mode) and the xla path against the oracle reading those pages, at the
  float32 tolerance (2e-5) for float32 queries and the bf16 one (3e-2) for bf16 queries.
- Accuracy of the format: attention over FP8 pages against attention over the float
  pages they came from. With scales amax / 448 (the checkpoint's, or computed), e4m3's
  3 mantissa bits bound each element's relative error by 2**-4; measured over these
  batches the output differs by at most 0.04 x max|v| (asserted: 0.06 x max|v|).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (AttentionInputs, gpu_plan, lowering, pallas_gpu,
                            ragged_paged_attention, write_kv)
from pallas_kernels.testing import make_batch
from support.attention_batches import FP8, FP8_MAX, LAYOUTS, TOLERANCES, attention, draw_batch


def _quantized(batch, k_scale, v_scale):
    """The batch's pages stored as FP8 by write_kv (every slot, NaN kept: NaN survives)."""
    k, v = batch.k_pages, batch.v_pages
    nb, bs = k.shape[:2]
    flat_k = k.reshape(nb * bs, *k.shape[2:])
    flat_v = v.reshape(nb * bs, *v.shape[2:])
    kq, vq = write_kv(jnp.zeros(k.shape, FP8), jnp.zeros(v.shape, FP8), flat_k, flat_v,
                      jnp.arange(nb * bs, dtype=jnp.int32), k_scale=k_scale, v_scale=v_scale)
    return kq, vq


def _scales(batch):
    def amax(x):
        x = np.asarray(x, np.float32)
        return float(np.nanmax(np.abs(x))) / FP8_MAX

    return jnp.float32(amax(batch.k_pages)), jnp.float32(amax(batch.v_pages))


def _check_impl(batch, dtype, impl, **kwargs):
    ks, vs = _scales(batch)
    kq, vq = _quantized(batch, ks, vs)
    args = (batch.q, kq, vq, *batch.args()[3:])
    ref = np.asarray(ragged_paged_attention(*args, impl="reference", k_scale=ks, v_scale=vs),
                     np.float32)
    out = attention(*args, impl=impl, k_scale=ks, v_scale=vs, **kwargs)
    assert out.dtype == batch.q.dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_pallas_gpu_fp8_pages_match_reference(dtype, data):
    batch = draw_batch(data, LAYOUTS[2], dtype, num_tokens=32, seq_bucket=5, max_seqs=4,
                       max_kv=24)
    _check_impl(batch, dtype, "pallas_gpu", interpret=True)


def test_pallas_gpu_fp8_decode_split_k():
    batch = make_batch([(1, 70), (1, 3), (1, 33), (0, 9)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=8, num_tokens=6, seq_bucket=6, max_blocks=10,
                       dtype=jnp.bfloat16, seed=5)
    _check_impl(batch, jnp.bfloat16, "pallas_gpu", interpret=True, max_q_len=1)


def test_xla_bf16_queries_over_fp8_pages():
    batch = make_batch([(5, 19), (1, 40), (3, 3)], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=8, num_tokens=16, seq_bucket=4, dtype=jnp.bfloat16, seed=3)
    _check_impl(batch, jnp.bfloat16, "xla")


def test_fp8_accuracy_against_float_pages():
    worst = 0.0
    for seed in range(4):
        batch = make_batch([(7, 30), (1, 61), (4, 4)], num_heads=8, num_kv_heads=2,
                           head_dim=64, block_size=8, num_tokens=16, seq_bucket=4,
                           nan_fill=False, seed=seed)
        ks, vs = _scales(batch)
        kq, vq = _quantized(batch, ks, vs)
        args = batch.args()
        exact = np.asarray(ragged_paged_attention(*args, impl="reference"))
        fp8 = np.asarray(ragged_paged_attention(args[0], kq, vq, *args[3:], impl="reference",
                                                k_scale=ks, v_scale=vs))
        vmax = float(np.abs(np.asarray(batch.v_pages)).max())
        worst = max(worst, float(np.abs(fp8 - exact).max()) / vmax)
    assert 0 < worst < 0.06, worst


def test_write_kv_quantizes_with_scale_and_saturates():
    k = jnp.asarray([[[1.0, -3.0, 1000.0, -1e6]]], jnp.float32)  # [T=1, Hkv=1, D=4]
    pages = jnp.zeros((2, 4, 1, 4), FP8)
    kq, vq = write_kv(pages, pages, k, k * 0.5, jnp.asarray([5], jnp.int32),
                      k_scale=jnp.float32(2.0), v_scale=jnp.float32(0.5))
    got_k = np.asarray(kq[1, 1, 0].astype(jnp.float32))
    got_v = np.asarray(vq[1, 1, 0].astype(jnp.float32))
    np.testing.assert_array_equal(got_k, [0.5, -1.5, 448.0, -448.0])  # 1000/2 saturates
    np.testing.assert_array_equal(got_v, [1.0, -3.0, 448.0, -448.0])
    assert not np.isnan(np.asarray(kq.astype(jnp.float32))).any()


_UNAVAILABLE = lowering.cuda_lowering_unavailable()


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")
@pytest.mark.parametrize("max_q_len", [256, 1], ids=["mixed", "decode"])
def test_fp8_kernel_lowers_for_cuda(max_q_len):
    hkv, group, d, bs, t, s, mb = 2, 4, 128, 16, 256, 16, 64
    plan = gpu_plan.make_gpu_plan(num_tokens=t, num_seqs=s, num_heads=hkv * group,
                                  num_kv_heads=hkv, head_dim=d, page_size=bs, max_blocks=mb,
                                  max_q_len=max_q_len, itemsize=2)
    pages = jax.ShapeDtypeStruct((s * mb, bs, hkv, d), FP8)
    i32 = jnp.int32
    args = (jax.ShapeDtypeStruct((t, hkv * group, d), jnp.bfloat16), pages, pages,
            jax.ShapeDtypeStruct((s, mb), i32), jax.ShapeDtypeStruct((s,), i32),
            jax.ShapeDtypeStruct((s + 1,), i32), jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))

    def fn(q, kp, vp, bt, kl, cu, n, ks, vs):
        inputs = AttentionInputs.create(q=q, k_pages=kp, v_pages=vp, block_tables=bt,
                                        kv_lens=kl, cu_seqlens_q=cu, num_seqs=n,
                                        sm_scale=d**-0.5, k_scale=ks, v_scale=vs)
        return pallas_gpu.ragged_paged_attention_pallas_gpu(inputs, plan)

    text = lowering.lower_for_cuda(fn, *args)
    assert lowering.triton_kernel_calls(text) == 1
