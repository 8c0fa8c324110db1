"""Attention sinks (gpt-oss): a learned logit per query head in every softmax denominator.

The oracle against an independent float64 computation (transformers' formulation: the sink
appended as one more column of the scores, dropped after the softmax), then every
implementation against the oracle, with and without a sliding window, split-K decode rows
and mixed batches included. NaN in keys no row may see must never reach an output.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionInputs, KernelArgumentError, choose_inputs, gpu_plan
from pallas_kernels import lowering, pallas_gpu, ragged_paged_attention
from pallas_kernels.testing import make_batch
from support.attention_batches import TOLERANCES, key_slots, nan_outside_windows

attention = jax.jit(ragged_paged_attention,
                    static_argnames=("sm_scale", "impl", "interpret", "max_q_len"))
HAS_TRITON = all(importlib.util.find_spec(m) is not None for m in ("triton", "torch"))
# One ragged batch: a long decode row, chunks (first and later), a tiny decode, an idle row.
SEQS = [(1, 70), (9, 30), (1, 3), (0, 9), (5, 5), (1, 40)]


def _sinks(num_heads, seed=0, scale=2.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=num_heads) * scale, jnp.float32)


def _dense_with_sinks(q, k, v, scale, sinks, window=None):
    """transformers' eager attention for the last q_len positions of one sequence, float64:
    scores, the sink as one more column, softmax, the sink column dropped."""
    q_len, length = q.shape[0], k.shape[0]
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    pos = np.arange(length - q_len, length)[:, None]
    keys = np.arange(length)[None, :]
    ok = keys <= pos
    if window is not None:
        ok &= keys > pos - window
    s = np.where(ok[None], s, -np.inf)
    combined = np.concatenate([s, np.broadcast_to(sinks[:, None, None], s.shape[:2] + (1,))],
                              axis=-1)
    p = np.exp(combined - combined.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("window", [None, 4])
def test_reference_matches_transformers_formulation(window):
    length, q_len, heads, d, bs = 19, 6, 4, 16, 4
    batch = make_batch([(q_len, length)], num_heads=heads, num_kv_heads=heads, head_dim=d,
                       block_size=bs, nan_fill=False, seed=3)
    sinks = _sinks(heads, scale=3.0)
    pages, offs = key_slots(batch, 0, length, bs)
    k = np.asarray(batch.k_pages, np.float64)[pages, offs]
    v = np.asarray(batch.v_pages, np.float64)[pages, offs]
    q = np.asarray(batch.q, np.float64)
    expected = _dense_with_sinks(q, k, v, d**-0.5, np.asarray(sinks, np.float64), window)
    out = ragged_paged_attention(*batch.args(), impl="reference", sinks=sinks,
                                 sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6, rtol=2e-5)
    plain = ragged_paged_attention(*batch.args(), impl="reference", sliding_window=window)
    assert np.abs(np.asarray(plain) - expected).max() > 1e-2  # the sinks changed it


def _batch(dtype=jnp.float32, seed=9):
    return make_batch(SEQS, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                      num_tokens=24, seq_bucket=8, max_blocks=10, dtype=dtype, seed=seed)


def _check(batch, out, ref, dtype):
    out = np.asarray(out, np.float32)
    assert out.shape == batch.q.shape and not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), **TOLERANCES[dtype])


def _windowed_args(batch, window):
    if window is None:
        return batch.args()
    k, v = nan_outside_windows(batch, window, 8)
    return (batch.q, k, v, *batch.args()[3:])


@pytest.mark.parametrize("window", [None, 6])
def test_xla_matches_reference(window):
    batch = _batch()
    sinks = _sinks(8, seed=1)
    args = _windowed_args(batch, window)
    win = None if window is None else jnp.int32(window)
    out = attention(*args, impl="xla", sinks=sinks, sliding_window=win)
    ref = ragged_paged_attention(*args, impl="reference", sinks=sinks, sliding_window=window)
    _check(batch, out, ref, jnp.float32)


@pytest.mark.parametrize("dtype, window, max_q_len", [
    (jnp.float32, None, None),  # mixed batch, the decode rows split their keys
    (jnp.float32, 6, None),
    (jnp.bfloat16, 6, 1),  # decode-only plan: one row per tile, split-K everywhere
], ids=["mixed", "mixed-window", "decode-window-bf16"])
def test_pallas_gpu_interpret_matches_reference(dtype, window, max_q_len):
    seqs = SEQS if max_q_len is None else [(1, kv) if q else (0, kv) for q, kv in SEQS]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                       num_tokens=24, seq_bucket=8, max_blocks=10, dtype=dtype, seed=4)
    sinks = _sinks(8, seed=2)
    args = _windowed_args(batch, window)
    win = None if window is None else jnp.int32(window)
    inputs = AttentionInputs.create(
        q=args[0], k_pages=args[1], v_pages=args[2], block_tables=batch.block_tables,
        kv_lens=batch.kv_lens, cu_seqlens_q=batch.cu_seqlens_q, num_seqs=batch.num_seqs,
        sinks=sinks, sliding_window=win, sm_scale=0.125, max_q_len=max_q_len)
    plan = gpu_plan.make_gpu_plan(num_tokens=24, num_seqs=8, num_heads=8, num_kv_heads=2,
                                  head_dim=64, page_size=8, max_blocks=10,
                                  max_q_len=inputs.max_q_len, block_m=64, block_k=16,
                                  num_splits=3, itemsize=jnp.dtype(dtype).itemsize)
    assert plan.num_splits == 3  # split rows take their sink once, in the combine
    out = jax.jit(pallas_gpu.ragged_paged_attention_pallas_gpu,
                  static_argnames=("plan", "interpret"))(inputs, plan=plan, interpret=True)
    ref = ragged_paged_attention(*args, impl="reference", sinks=sinks, sliding_window=window,
                                 sm_scale=0.125)
    _check(batch, out, ref, dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton's interpreter needs triton and torch")
@pytest.mark.parametrize("window, max_q_len", [(6, None), (None, 1)], ids=["mixed", "decode"])
def test_triton_interpret_matches_reference(window, max_q_len):
    seqs = SEQS if max_q_len is None else [(1, kv) if q else (0, kv) for q, kv in SEQS]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                       num_tokens=24, seq_bucket=8, max_blocks=10, seed=6)
    sinks = _sinks(8, seed=3)
    args = _windowed_args(batch, window)
    win = None if window is None else jnp.int32(window)
    out = attention(*args, impl="triton", interpret=True, sinks=sinks, sliding_window=win,
                    max_q_len=max_q_len)
    ref = ragged_paged_attention(*args, impl="reference", sinks=sinks, sliding_window=window)
    _check(batch, out, ref, jnp.float32)


def test_auto_and_records_know_the_sinks():
    batch = _batch()
    inputs = batch.inputs(sinks=_sinks(8))
    assert "sinks" in inputs.options()
    choice = choose_inputs("pallas_gpu", inputs, platform="gpu")
    assert choice.shape_class.endswith("-sinks")  # a record without sinks never vouches


@pytest.mark.parametrize("sinks, match", [
    (jnp.zeros((4,), jnp.float32), "one logit per query head"),
    (jnp.zeros((8,), jnp.int32), "floating dtype"),
    (jnp.zeros((8, 1), jnp.float32), "one logit per query head"),
])
def test_bad_sinks_name_the_field(sinks, match):
    with pytest.raises(KernelArgumentError, match=f"^sinks: .*{match}"):
        _batch().inputs(sinks=sinks)


def test_mosaic_gpu_refuses_sinks():
    batch = make_batch([(1, 9)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=8)
    with pytest.raises(KernelArgumentError, match="sinks"):
        ragged_paged_attention(*batch.args(), impl="mosaic_gpu", sinks=_sinks(8), max_q_len=1)


_NO_CUDA = lowering.cuda_lowering_unavailable()


@pytest.mark.skipif(_NO_CUDA is not None, reason=_NO_CUDA or "")
@pytest.mark.parametrize("max_q_len", [256, 1], ids=["mixed", "decode"])
def test_pallas_gpu_with_sinks_and_window_lowers_for_cuda(max_q_len):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pages = sds((1024, 16, 8, 64), jnp.bfloat16)
    inputs = AttentionInputs.create(
        q=sds((256, 64, 64), jnp.bfloat16), k_pages=pages, v_pages=pages,
        block_tables=sds((16, 64), i32), kv_lens=sds((16,), i32), cu_seqlens_q=sds((17,), i32),
        num_seqs=sds((), i32), sliding_window=sds((), i32), sinks=sds((64,), jnp.float32),
        max_q_len=max_q_len)
    plan = gpu_plan.make_gpu_plan(num_tokens=256, num_seqs=16, num_heads=64, num_kv_heads=8,
                                  head_dim=64, page_size=16, max_blocks=64, max_q_len=max_q_len)
    text = lowering.lower_for_cuda(pallas_gpu.ragged_paged_attention_pallas_gpu, inputs,
                                   plan=plan)
    assert lowering.triton_kernel_calls(text) == 1
