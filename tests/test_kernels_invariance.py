"""The batch-invariant mode (`AttentionInputs.batch_invariant`) of the xla path and of the
GPU kernels (Pallas GPU in interpret mode, the raw Triton kernel in Triton's interpreter): a
query row's output is bitwise its lone decode's, whatever chunk it sits in (start, length,
its offset in the tile), which other sequences share the call, and whether the call is a
decode bucket or a mixed one; and it is still attention (the oracle)."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import gpu_plan
from pallas_kernels.api import paged_attention
from pallas_kernels.attention_inputs import AttentionInputs
from pallas_kernels.kernel_errors import KernelArgumentError
from pallas_kernels.reference import ragged_paged_attention_reference

HQ, HKV, D, BS, BLOCKS, SEQS = 4, 2, 16, 8, 64, 8  # a probe sees up to 512 keys
MIXED_T = 64  # the mixed bucket's rows (max_q_len = T); the decode bucket has SEQS rows
_rs = np.random.RandomState(0)
K_POOL = _rs.randn(SEQS * BLOCKS, BS, HKV, D)
V_POOL = _rs.randn(SEQS * BLOCKS, BS, HKV, D)
PROBE_Q = _rs.randn(BLOCKS * BS, HQ, D)  # the probe's query at each position
OTHER_Q = _rs.randn(MIXED_T, HQ, D)


_MISSING = [m for m in ("triton", "torch") if importlib.util.find_spec(m) is None]
GPU_KERNELS = ["pallas_gpu", pytest.param("triton", marks=pytest.mark.skipif(
    bool(_MISSING), reason=f"Triton's interpreter needs {_MISSING} (the test extra)"))]


@functools.partial(jax.jit, static_argnames="impl")
def _attend(inputs, impl="xla"):
    return paged_attention(inputs, impl=impl, interpret=impl != "xla")


def _call(seqs, t, max_q_len, dtype, window, softcap):
    """seqs: [(queries [n, Hq, D], kv_len, pages row)], the probe's pages row 0."""
    q = np.zeros((t, HQ, D))
    cu, kv, tables = [0], [], np.zeros((SEQS, BLOCKS), np.int32)
    for i, (rows, kv_len, pages) in enumerate(seqs):
        q[cu[-1]:cu[-1] + len(rows)] = rows
        cu.append(cu[-1] + len(rows))
        kv.append(kv_len)
        tables[i] = pages * BLOCKS + np.arange(BLOCKS)
    cu += [cu[-1]] * (SEQS + 1 - len(cu))
    kv += [0] * (SEQS - len(kv))
    return AttentionInputs.create(
        q=jnp.asarray(q, dtype), k_pages=jnp.asarray(K_POOL, dtype),
        v_pages=jnp.asarray(V_POOL, dtype), block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(kv), cu_seqlens_q=jnp.asarray(cu), num_seqs=len(seqs),
        sliding_window=window, logit_softcap=softcap, max_q_len=max_q_len,
        batch_invariant=True)


def _bits(x):
    return np.asarray(x, np.float32).view(np.int32)


@st.composite
def _arrangements(draw):
    """A probe position, a chunk holding it, and other sequences around it."""
    pos = draw(st.integers(0, BLOCKS * BS - 1))
    length = draw(st.integers(1, min(pos + 1, 40)))
    start = draw(st.integers(max(0, pos - length + 1), min(pos, BLOCKS * BS - length)))
    others = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 400)), max_size=4))
    slot = draw(st.integers(0, len(others)))
    window = draw(st.sampled_from([24, 100, 4096]))
    return pos, start, length, others, slot, window


def _check_lone_decode(impl, dtype, softcap, case):
    pos, start, length, others, slot, window = case
    window = jnp.int32(window)
    alone = _attend(_call([(PROBE_Q[pos:pos + 1], pos + 1, 0)], SEQS, 1, dtype, window,
                          softcap), impl)[0]
    seqs = [(OTHER_Q[:n], n + extra, 1 + i) for i, (n, extra) in enumerate(others)]
    seqs.insert(slot, (PROBE_Q[start:start + length], start + length, 0))
    first = sum(len(rows) for rows, _, _ in seqs[:slot])
    out = _attend(_call(seqs, MIXED_T, MIXED_T, dtype, window, softcap), impl)
    np.testing.assert_array_equal(_bits(out[first + pos - start]), _bits(alone))
    # a decode bucket (every chunk one row) beside the other sequences' decodes
    decodes = [(OTHER_Q[:1], n + extra, 1 + i) for i, (n, extra) in enumerate(others)]
    decodes.insert(slot, (PROBE_Q[pos:pos + 1], pos + 1, 0))
    out = _attend(_call(decodes, SEQS, 1, dtype, window, softcap), impl)
    np.testing.assert_array_equal(_bits(out[slot]), _bits(alone))


@pytest.mark.parametrize("dtype,softcap", [("float32", None), ("bfloat16", 5.0)])
@settings(max_examples=12, deadline=None)
@given(case=_arrangements())
def test_a_row_is_its_lone_decode_bitwise(dtype, softcap, case):
    _check_lone_decode("xla", dtype, softcap, case)


@pytest.mark.parametrize("dtype,softcap", [("float32", 5.0), ("bfloat16", None)])
@pytest.mark.parametrize("impl", GPU_KERNELS)
@settings(max_examples=4, deadline=None)
@given(case=_arrangements())
def test_a_gpu_kernel_row_is_its_lone_decode_bitwise(impl, dtype, softcap, case):
    _check_lone_decode(impl, dtype, softcap, case)


@pytest.mark.parametrize("impl", ["xla", *GPU_KERNELS])
def test_batch_invariant_attention_is_attention(impl):
    seqs = [(PROBE_Q[90:130], 130, 0), (OTHER_Q[:5], 5, 1), (OTHER_Q[:1], 300, 2)]
    inputs = _call(seqs, MIXED_T, MIXED_T, "float32", jnp.int32(60), 5.0)
    want = ragged_paged_attention_reference(inputs)
    np.testing.assert_allclose(np.asarray(_attend(inputs, impl))[:46], np.asarray(want)[:46],
                               atol=2e-5, rtol=2e-5)


def test_the_gpu_plan_is_one_plan_for_every_bucket():
    def plan(**bucket):
        return gpu_plan.make_gpu_plan(num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                      page_size=BS, max_blocks=BLOCKS, batch_invariant=True,
                                      **bucket)

    decode, mixed = plan(num_tokens=SEQS, num_seqs=SEQS, max_q_len=1), plan(
        num_tokens=MIXED_T, num_seqs=SEQS, max_q_len=MIXED_T)
    fields = ("block_q", "block_k", "page_size", "one_width")
    assert [getattr(decode.tiles, f) for f in fields] == [getattr(mixed.tiles, f) for f in fields]
    assert (decode.rows, decode.num_splits, decode.num_warps, decode.all_masked) == (
        mixed.rows, 1, mixed.num_warps, True)
    with pytest.raises(KernelArgumentError) as err:
        plan(num_tokens=SEQS, num_seqs=SEQS, max_q_len=1, num_splits=4)
    assert err.value.argument == "num_splits"


def test_batch_invariant_is_refused_where_not_built_and_checked():
    inputs = _call([(PROBE_Q[:3], 3, 0)], SEQS, 3, "float32", None, None)
    for impl in ("mosaic_gpu", "reference"):
        with pytest.raises(KernelArgumentError) as err:
            paged_attention(inputs, impl=impl)
        assert err.value.argument == "impl"
    with pytest.raises(KernelArgumentError) as err:
        AttentionInputs.create(q=inputs.q, k_pages=inputs.k_pages, v_pages=inputs.v_pages,
                               block_tables=inputs.block_tables, kv_lens=inputs.kv_lens,
                               cu_seqlens_q=inputs.cu_seqlens_q, num_seqs=1,
                               batch_invariant="yes")
    assert err.value.argument == "batch_invariant"
