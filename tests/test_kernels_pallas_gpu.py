"""The Pallas GPU kernel against the oracle, in interpret mode on CPU.

The Triton lowering of every variant for CUDA is checked on the CPU in
tests/test_gpu_lowering.py; compiling to PTX and running needs a GPU (the
`gpu`-marked test here, and scripts/gpu_check.sh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import KernelArgumentError, gpu_plan, pallas_gpu, ragged_paged_attention
from pallas_kernels.testing import make_batch
from support.attention_batches import LAYOUT_IDS, LAYOUTS, TOLERANCES, attention, draw_batch
from support.attention_batches import attention_with_options
from support.attention_batches import nan_outside_windows as _nan_outside_windows
from support.devices import has_gpu


def _check(batch, dtype, *, interpret=True, **kwargs):
    ref = ragged_paged_attention(*batch.args(), impl="reference", sm_scale=kwargs.get("sm_scale"))
    ref = np.asarray(ref, np.float32)
    out = attention(*batch.args(), impl="pallas_gpu", interpret=interpret, **kwargs)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@settings(max_examples=4)
@given(data=st.data())
def test_interpret_matches_reference(layout, dtype, data):
    _check(draw_batch(data, layout, dtype, num_tokens=32, seq_bucket=5, max_seqs=4, max_kv=24),
           dtype)


@pytest.mark.parametrize("kind", ["decode", "first", "later"])
@settings(max_examples=3)
@given(data=st.data())
def test_interpret_single_kind_batches(kind, data):
    batch = draw_batch(data, LAYOUTS[2], jnp.float32, num_tokens=32, seq_bucket=5, max_seqs=4,
                       max_kv=24, kinds=(kind,))
    _check(batch, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_interpret_decode_split_k(dtype):
    # max_q_len=1 makes a decode-only plan: one row per tile, keys split across programs.
    batch = make_batch([(1, 70), (1, 3), (1, 33), (0, 9)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=8, num_tokens=6, seq_bucket=6, max_blocks=10,
                       dtype=dtype, seed=5)
    _check(batch, dtype, max_q_len=1, sm_scale=0.2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpret_mixed_batch_split_k(num_splits):
    # Decode rows split their keys; the 17-token chunk's last tile (1 row at block_q 16)
    # must not be taken for a decode row; the zero-length sequence stays empty.
    batch = make_batch([(1, 150), (17, 60), (1, 3), (0, 9), (5, 5), (1, 64)], num_heads=8,
                       num_kv_heads=2, head_dim=64, block_size=8, num_tokens=32, seq_bucket=8,
                       max_blocks=20, dtype=jnp.float32, seed=9)
    plan = gpu_plan.make_gpu_plan(num_tokens=32, num_seqs=8, num_heads=8, num_kv_heads=2,
                                  head_dim=64, page_size=8, max_blocks=20, max_q_len=32,
                                  block_m=64, block_k=16, num_splits=num_splits)
    assert plan.tiles.block_q == 16 and plan.num_splits == num_splits
    out = jax.jit(pallas_gpu.ragged_paged_attention_pallas_gpu,
                  static_argnames=("plan", "interpret"))(
        batch.inputs(sm_scale=0.125), plan=plan, interpret=True)
    ref = ragged_paged_attention(*batch.args(), impl="reference", sm_scale=0.125)
    out = np.asarray(out)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, np.asarray(ref), **TOLERANCES[jnp.float32])


def test_interpret_long_chunk_spans_tiles_and_unmasked_steps():
    # 90 query rows over 150 keys: several tiles, unmasked and diagonal key steps.
    batch = make_batch([(90, 150), (1, 100), (7, 7)], num_heads=2, num_kv_heads=1, head_dim=64,
                       block_size=16, num_tokens=100, seq_bucket=4, seed=11)
    _check(batch, jnp.float32)


def test_interpret_group_not_a_power_of_two():
    batch = make_batch([(5, 20), (1, 9)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=4,
                       num_tokens=8, seq_bucket=3, seed=2)
    _check(batch, jnp.float32)


def test_interpret_later_chunk_matches_xla_bottom_right():
    # The xla path's alignment is checked against dense numpy attention elsewhere.
    batch = make_batch([(6, 20)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=4, seed=7)
    np.testing.assert_allclose(attention(*batch.args(), impl="pallas_gpu", interpret=True),
                               attention(*batch.args(), impl="xla"), atol=2e-5, rtol=2e-5)


def test_rejects_head_dim_the_gpu_cannot_tile():
    batch = make_batch([(2, 5)], num_heads=2, num_kv_heads=1, head_dim=80, block_size=4)
    with pytest.raises(KernelArgumentError, match="^q:"):
        ragged_paged_attention(*batch.args(), impl="pallas_gpu", interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("max_q_len", [None, 1], ids=["mixed", "decode"])
def test_compiled_kernel_on_gpu(max_q_len, dtype):
    # The mixed batch's 4,500-key decode row is long enough for the default plan to split
    # it; f32 checks the precision rule (3xTF32) against the f32 tolerance.
    seqs = ([(1, 900), (1, 17)] if max_q_len == 1
            else [(300, 700), (1, 513), (37, 37), (0, 9), (1, 4500)])
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                       num_tokens=384, seq_bucket=8, dtype=dtype, seed=3)
    _check(batch, dtype, interpret=False, max_q_len=max_q_len)


# ---- sliding windows and soft-capping ----------------------------------------------------------

def _check_options(batch, *, window, softcap=None, block_size, interpret=True, **kwargs):
    """The kernel (interpret mode on CPU) against the oracle, with NaN in every key before the
    window of every row of its sequence: those pages must be skipped or masked, never leak."""
    k, v = _nan_outside_windows(batch, window, block_size)
    args = (batch.q, k, v, *batch.args()[3:])
    ref = ragged_paged_attention(*args, impl="reference", sliding_window=window,
                                 logit_softcap=softcap, sm_scale=kwargs.get("sm_scale"))
    out = attention_with_options(*args, impl="pallas_gpu", interpret=interpret,
                                 sliding_window=jnp.int32(window), logit_softcap=softcap,
                                 **kwargs)
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, np.asarray(ref, np.float32),
                               **TOLERANCES[jnp.bfloat16 if batch.q.dtype == jnp.bfloat16
                                            else jnp.float32])


@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_interpret_window_and_softcap_match_reference(data):
    batch = draw_batch(data, LAYOUTS[2], jnp.float32, num_tokens=32, seq_bucket=5, max_seqs=4,
                       max_kv=40)
    window = data.draw(st.integers(1, 30), label="window")
    softcap = data.draw(st.sampled_from([None, 0.5]), label="softcap")
    _check_options(batch, window=window, softcap=softcap, block_size=LAYOUTS[2][3])


@pytest.mark.parametrize("max_q_len, window", [(1, 20), (None, 20), (None, 5)],
                         ids=["decode-split", "mixed", "window-inside-a-step"])
def test_interpret_window_skips_pages_for_prefill_and_decode_rows(max_q_len, window):
    # Decode rows (split-K in a decode-only plan) and a 40-row chunk far past the window:
    # steps before the window are skipped, its left edge masked, the middle unmasked.
    seqs = [(1, 150), (1, 70), (1, 3)] if max_q_len == 1 else [(40, 150), (1, 70), (9, 9)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                       num_tokens=64 if max_q_len is None else 4, seq_bucket=4, max_blocks=20,
                       seed=13)
    _check_options(batch, window=window, softcap=2.0, block_size=8, max_q_len=max_q_len,
                   sm_scale=0.2)


@settings(max_examples=200, deadline=None)
@given(first_pos=st.integers(0, 300), rows=st.integers(1, 40), window=st.integers(1, 200),
       block_k=st.sampled_from([16, 32, 64]))
def test_window_steps_are_exactly_the_visible_ones(first_pos, rows, window, block_k):
    """The kernel visits key steps [window_start, total): each holds a key some row sees and
    the ones skipped hold none; steps in [window_full_start, unmasked) hold only keys every
    row sees (they run without a mask)."""
    from pallas_kernels import plan as plan_lib

    tiles = plan_lib.TilePlan(block_q=64, block_k=block_k, page_size=8, num_tiles=1)
    pos = np.arange(first_pos, first_pos + rows)

    def seen(step, every):
        keys = np.arange(step * block_k, (step + 1) * block_k)
        vis = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)
        return vis.any(0).all() and vis.all() if every else vis.any()

    fp, n, w = jnp.int32(first_pos), jnp.int32(rows), jnp.int32(window)
    unmasked, total = (int(x) for x in plan_lib.kv_steps(tiles, fp, n))
    start = int(plan_lib.window_start(tiles, fp, w))
    full = int(plan_lib.window_full_start(tiles, fp, n, w))
    assert [s for s in range(total + 2) if seen(s, False)] == list(range(start, total))
    assert all(seen(s, True) for s in range(full, unmasked))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("max_q_len", [None, 1], ids=["mixed", "decode"])
def test_compiled_window_kernel_on_gpu(max_q_len, dtype):
    # A 4,096-key window (Mistral's) over chunks and split decode rows far past it, with
    # Gemma 2's attention soft-cap.
    seqs = ([(1, 9000), (1, 700), (1, 5000)] if max_q_len == 1
            else [(300, 7000), (1, 5000), (37, 37), (0, 9), (129, 4200)])
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                       num_tokens=384 if max_q_len is None else 4, seq_bucket=8, dtype=dtype,
                       seed=5)
    _check_options(batch, window=4096, softcap=50.0, block_size=16, interpret=False,
                   max_q_len=max_q_len)


def test_auto_takes_the_pallas_kernel_for_windowed_calls(monkeypatch):
    # The kernel has every option now: a windowed / soft-capped call needs no other kernel.
    from pallas_kernels import api, backends

    assert {"sliding_window", "logit_softcap"} <= set(api.PALLAS_GPU_OPTIONS)
    on_gpu = dict(on_gpu=True, can_tile=True, kind="NVIDIA H200")
    monkeypatch.setattr(backends.verified, "has_passed", lambda impl, kind, path=None: False)
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "current")
    monkeypatch.setattr(backends, "triton_unavailable", lambda: "not installed")
    assert backends.resolve(decode_only=False, plain=False, pallas_gpu_ok=True,
                            **on_gpu) == "pallas_gpu"
    assert backends.resolve(decode_only=False, plain=False, **on_gpu) == "xla"
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "deprecated")
    assert backends.resolve(decode_only=False, plain=False, pallas_gpu_ok=True,
                            **on_gpu) == "xla"
