"""The Mosaic GPU decode kernel (impl="mosaic_gpu") lowers for CUDA, checked on the CPU.

It can neither run nor be interpreted here: lowering (layout inference, wgmma shapes and
swizzles, TMA slices, barriers) is what the CPU can check. Its numbers are checked against
the oracle on a GPU only (scripts/gpu_check.sh, and the `gpu`-marked test below), which
records a passing run; "auto" uses the kernel only after that (pallas_kernels.verified).
"""

import contextlib

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (AttentionInputs, KernelArgumentError, backends, lowering,
                            mosaic_gpu, ragged_paged_attention)
from pallas_kernels.api import gpu_plan_for
from pallas_kernels.testing import make_batch
from support.devices import has_gpu

_UNAVAILABLE = backends.mosaic_gpu_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")


def _abstract_args(*, group, head_dim, block_size, num_seqs=16, max_blocks=64,
                   dtype=jnp.bfloat16):
    hkv, i32 = 2, jnp.int32
    pages = (num_seqs * max_blocks, block_size, hkv, head_dim)
    return (jax.ShapeDtypeStruct((num_seqs, hkv * group, head_dim), dtype),
            jax.ShapeDtypeStruct(pages, dtype), jax.ShapeDtypeStruct(pages, dtype),
            jax.ShapeDtypeStruct((num_seqs, max_blocks), i32),
            jax.ShapeDtypeStruct((num_seqs,), i32),
            jax.ShapeDtypeStruct((num_seqs + 1,), i32), jax.ShapeDtypeStruct((), i32))


MOSAIC_CALL = 'custom_call @mosaic_gpu'


# (group, D, block_size): one page per step, several pages per step, GQA 1/4/8.
@pytest.mark.parametrize("group, head_dim, block_size", [(4, 128, 16), (8, 64, 32),
                                                         (1, 128, 64)])
def test_decode_kernel_lowers_for_cuda(group, head_dim, block_size):
    args = _abstract_args(group=group, head_dim=head_dim, block_size=block_size)
    text = lowering.lower_for_cuda(ragged_paged_attention, *args, impl="mosaic_gpu",
                                   max_q_len=1)
    assert text.count(MOSAIC_CALL) == 1


def test_unsupported_shapes_are_refused_by_name():
    batch = make_batch([(1, 5), (1, 3)], num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype=jnp.bfloat16)
    with pytest.raises(KernelArgumentError, match="^q:.*multiple of 64"):
        ragged_paged_attention(*batch.args(), impl="mosaic_gpu", max_q_len=1)
    batch = make_batch([(1, 5), (1, 3)], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=jnp.float32)
    with pytest.raises(KernelArgumentError, match="^q:.*bfloat16"):
        ragged_paged_attention(*batch.args(), impl="mosaic_gpu", max_q_len=1)


def _lowered_smem(*, head_dim, block_size) -> list[int]:
    """The shared memory of the kernel lowered directly (past `unsupported`'s gate)."""
    q, k_pages, v_pages, block_tables, kv_lens, cu_seqlens_q, num_seqs = _abstract_args(
        group=4, head_dim=head_dim, block_size=block_size)
    inputs = AttentionInputs.create(q=q, k_pages=k_pages, v_pages=v_pages,
                                    block_tables=block_tables, kv_lens=kv_lens,
                                    cu_seqlens_q=cu_seqlens_q, num_seqs=num_seqs, max_q_len=1)
    with contextlib.ExitStack() as stack:
        try:
            sizes = stack.enter_context(lowering.capture_mosaic_smem())
        except RuntimeError as e:  # this jax moved the hook: say so, check the rest
            pytest.skip(str(e))
        try:
            lowering.lower_for_cuda(mosaic_gpu.ragged_paged_attention_mosaic_gpu, inputs,
                                    plan=gpu_plan_for(inputs))
        except Exception as e:  # noqa: BLE001 - over the limit: the lowering refuses it too
            assert "shared memory" in str(e), e
    return sizes


# (D, block_size): fits (one page per step, several, 64-key pages) and over the limit
# (D=256; 128-token pages make 128-key steps).
@pytest.mark.parametrize("head_dim, block_size, fits", [
    (128, 16, True), (64, 16, True), (128, 64, True), (256, 16, False), (128, 128, False)])
def test_shared_memory_gate_matches_the_lowering(head_dim, block_size, fits):
    need = mosaic_gpu.smem_bytes(head_dim=head_dim, block_size=block_size, itemsize=2)
    assert _lowered_smem(head_dim=head_dim, block_size=block_size) == [need]
    assert (need <= mosaic_gpu.SMEM_LIMIT) == fits
    reason = mosaic_gpu.unsupported(head_dim=head_dim, block_size=block_size, num_heads=8,
                                    num_kv_heads=2, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    assert (reason is None) == fits, reason
    if not fits:
        assert f"{need:,} bytes of shared memory" in reason
        # so "auto" never sends such a decode bucket to it, and an explicit call is refused
        args = _abstract_args(group=4, head_dim=head_dim, block_size=block_size)
        with pytest.raises(KernelArgumentError, match="^q:.*shared memory"):
            lowering.lower_for_cuda(ragged_paged_attention, *args, impl="mosaic_gpu",
                                    max_q_len=1)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs an NVIDIA GPU")
def test_compiled_decode_kernel_on_gpu():
    import numpy as np

    batch = make_batch([(1, 900), (1, 17), (0, 5), (1, 4500), (1, 1)], num_heads=32,
                       num_kv_heads=8, head_dim=128, block_size=16, num_tokens=8, seq_bucket=8,
                       dtype=jnp.bfloat16, seed=3)
    out = np.asarray(jax.jit(ragged_paged_attention, static_argnames=("impl", "max_q_len"))(
        *batch.args(), impl="mosaic_gpu", max_q_len=1), np.float32)
    ref = np.asarray(ragged_paged_attention(*batch.args(), impl="reference"), np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)
