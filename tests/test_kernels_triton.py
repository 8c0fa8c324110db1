"""The raw Triton kernel (impl="triton") against the oracle, in Triton's own interpreter.

`interpret=True` runs `pallas_kernels/triton_kernel.py` in Triton's interpreter (a worker
process with TRITON_INTERPRET=1) from a host callback, so these are the same random
ragged batches, layouts and dtypes as the other implementations' tests, through the
kernel's real Triton source. The interpreter runs one program at a time: shapes are small
and examples few. Compiling the kernel for sm_90a is scripts/gpu_compile_report.py;
running it on a GPU is scripts/gpu_check.sh.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (KernelArgumentError, backends, cpu_build, ragged_paged_attention,
                            resolve_impl)
from pallas_kernels.testing import make_batch
from support.attention_batches import FP8, FP8_MAX, LAYOUT_IDS, LAYOUTS, TOLERANCES, attention
from support.attention_batches import attention_with_options, draw_batch
from support.attention_batches import nan_outside_windows as _nan_outside_windows
from support.devices import has_gpu

_MISSING = [m for m in ("triton", "torch") if importlib.util.find_spec(m) is None]
needs_interpreter = pytest.mark.skipif(
    bool(_MISSING), reason=f"Triton's interpreter needs {_MISSING} (the test extra)")


def _fp8_args(batch, k_scale, v_scale):
    """The batch's arguments with its pages quantized to float8_e4m3fn by the scales."""
    kq = jnp.clip(batch.k_pages.astype(jnp.float32) / k_scale, -FP8_MAX, FP8_MAX).astype(FP8)
    vq = jnp.clip(batch.v_pages.astype(jnp.float32) / v_scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return (batch.q, kq, vq, *batch.args()[3:])


def _check(batch, dtype, *, interpret=True, **kwargs):
    ref = ragged_paged_attention(*batch.args(), impl="reference", sm_scale=kwargs.get("sm_scale"))
    out = attention(*batch.args(), impl="triton", interpret=interpret, **kwargs)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out32).any()  # NaN pages past kv_len never leak
    np.testing.assert_array_equal(out32[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out32, np.asarray(ref32), **TOLERANCES[dtype])


@needs_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@settings(max_examples=2)
@given(data=st.data())
def test_interpreted_kernel_matches_reference(layout, dtype, data):
    _check(draw_batch(data, layout, dtype, num_tokens=24, seq_bucket=4, max_seqs=3, max_kv=20),
           dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_interpreted_decode_split_k(dtype):
    # max_q_len=1: a decode-only plan, one row per tile, keys split across programs; the
    # idle row and the garbage table columns past each sequence's pages stay out.
    batch = make_batch([(1, 70), (1, 3), (1, 33), (0, 9)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=8, num_tokens=6, seq_bucket=6, max_blocks=10,
                       dtype=dtype, seed=5)
    _check(batch, dtype, max_q_len=1, sm_scale=0.2)


@needs_interpreter
def test_interpreted_long_chunk_and_odd_group():
    # 40 rows over 150 keys: several tiles, unmasked and diagonal key steps; 3 query heads
    # per KV head (the packed group is padded to 4).
    batch = make_batch([(40, 150), (1, 100), (7, 7)], num_heads=6, num_kv_heads=2,
                       head_dim=64, block_size=16, num_tokens=52, seq_bucket=4, seed=11)
    _check(batch, jnp.float32)


@needs_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@settings(max_examples=2)
@given(data=st.data())
def test_interpreted_window_and_softcap_match_reference(dtype, data):
    # A traced window (one executable for every layer's window), the soft-cap, and NaN in
    # every key before all of a sequence's windows: such keys are never read.
    layout = LAYOUTS[2]
    batch = draw_batch(data, layout, dtype, num_tokens=24, seq_bucket=4, max_seqs=3,
                       max_kv=40)
    window = data.draw(st.integers(1, 30), label="window")
    softcap = data.draw(st.sampled_from([None, 0.5]), label="softcap")
    k, v = _nan_outside_windows(batch, window, layout[3])
    args = (batch.q, k, v, *batch.args()[3:])
    out = attention_with_options(*args, sliding_window=jnp.int32(window),
                                 logit_softcap=softcap, impl="triton", interpret=True)
    ref = ragged_paged_attention(*args, sliding_window=window, logit_softcap=softcap,
                                 impl="reference")
    out32 = np.asarray(out, np.float32)
    assert not np.isnan(out32).any()
    np.testing.assert_array_equal(out32[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out32, np.asarray(ref, np.float32), **TOLERANCES[dtype])


@needs_interpreter
def test_interpreted_fp8_pages_with_scales():
    # float8_e4m3fn pages (bf16 compute) with traced k/v scales, mixed chunks and decode
    # rows, a window and split-K decode (max_q_len=1) too; NaN past kv_len survives the
    # cast and stays out. (float32 compute over float8 pages: the GPU test.)
    dtype = jnp.bfloat16
    base = make_batch([(5, 40), (1, 70), (0, 3), (1, 9), (12, 12)], num_heads=8,
                      num_kv_heads=2, head_dim=64, block_size=8, num_tokens=20, seq_bucket=6,
                      dtype=dtype, seed=21)
    ks, vs = 0.05, 0.25
    args = _fp8_args(base, ks, vs)
    for options in (dict(), dict(sliding_window=jnp.int32(7), logit_softcap=2.0)):
        out = attention_with_options(*args, k_scale=jnp.float32(ks), v_scale=jnp.float32(vs),
                                     impl="triton", interpret=True, **options)
        ref = ragged_paged_attention(*args, k_scale=ks, v_scale=vs, impl="reference",
                                     **{k: int(v) if k == "sliding_window" else v
                                        for k, v in options.items()})
        out32 = np.asarray(out, np.float32)
        assert not np.isnan(out32).any()
        np.testing.assert_allclose(out32, np.asarray(ref, np.float32), **TOLERANCES[dtype])
    decode = make_batch([(1, 70), (1, 3), (1, 33)], num_heads=8, num_kv_heads=2, head_dim=64,
                        block_size=8, num_tokens=4, seq_bucket=4, dtype=dtype, seed=22)
    args = _fp8_args(decode, ks, vs)
    out = attention_with_options(*args, k_scale=jnp.float32(ks), v_scale=jnp.float32(vs),
                                 impl="triton", interpret=True, max_q_len=1)
    ref = ragged_paged_attention(*args, k_scale=ks, v_scale=vs, impl="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               **TOLERANCES[dtype])


@needs_interpreter
def test_interpreter_failure_is_reported():
    # A kernel error comes back with the interpreter's traceback, not as garbage output.
    from pallas_kernels import triton_interpret

    x = jnp.zeros((4,), jnp.float32)
    with pytest.raises(Exception, match="no_such_kernel"):
        jax.block_until_ready(triton_interpret.launch(
            "no_such_kernel", (1,), (x,), (jax.ShapeDtypeStruct((4,), jnp.float32),), {}))


def test_auto_resolution_follows_what_is_installed(monkeypatch):
    # Off the GPU (this machine), "auto" is the compiled CPU kernel (xla where it cannot
    # build) whatever GPU kernels are installed.
    assert resolve_impl("auto", head_dim=64, block_size=16, max_q_len=None) == (
        "cpu" if cpu_build.kernels_unavailable() is None else "xla")
    assert backends.resolve(on_gpu=False, can_tile=True, decode_only=False) == "xla"
    on_gpu = dict(on_gpu=True, can_tile=True, kind="NVIDIA H200")
    monkeypatch.setattr(backends.verified, "has_passed", lambda impl, kind, path=None: False)
    for pallas, triton_reason, expected in [("current", None, "pallas_gpu"),
                                            ("deprecated", None, "triton"),
                                            ("absent", None, "triton"),
                                            ("deprecated", "not installed", "xla")]:
        monkeypatch.setattr(backends, "pallas_triton_state", lambda p=pallas: p)
        monkeypatch.setattr(backends, "triton_unavailable", lambda r=triton_reason: r)
        assert backends.resolve(decode_only=False, **on_gpu) == expected
    # Shapes the GPU kernels cannot tile stay on xla.
    assert backends.resolve(on_gpu=True, can_tile=False, decode_only=False) == "xla"
    # Windows, soft-caps and scales go to the kernel that has them (or xla).
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "current")
    monkeypatch.setattr(backends, "triton_unavailable", lambda: None)
    assert backends.resolve(decode_only=False, plain=False, **on_gpu) == "triton"
    monkeypatch.setattr(backends, "triton_unavailable", lambda: "not installed")
    assert backends.resolve(decode_only=False, plain=False, **on_gpu) == "xla"
    # Mosaic GPU serves decode-only batches once a GPU run of it passed here.
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "deprecated")
    monkeypatch.setattr(backends, "triton_unavailable", lambda: None)
    monkeypatch.setattr(backends, "mosaic_gpu_unavailable", lambda: None)
    assert backends.resolve(decode_only=True, **on_gpu) == "triton"
    monkeypatch.setattr(backends.verified, "has_passed",
                        lambda impl, kind, path=None: impl == "mosaic_gpu")
    assert backends.resolve(decode_only=True, **on_gpu) == "mosaic_gpu"
    assert backends.resolve(decode_only=True, plain=False, **on_gpu) == "triton"
    assert backends.resolve(decode_only=False, **on_gpu) == "triton"


def test_explicit_impls_resolve_to_themselves():
    for impl in ("xla", "pallas_gpu", "triton", "mosaic_gpu"):
        assert resolve_impl(impl, head_dim=80, block_size=3, max_q_len=None) == impl
    with pytest.raises(KernelArgumentError, match="^impl:"):
        resolve_impl("cuda", head_dim=64, block_size=16, max_q_len=None)


def test_triton_rejects_what_it_cannot_tile_or_launch():
    batch = make_batch([(2, 5)], num_heads=2, num_kv_heads=1, head_dim=80, block_size=4)
    with pytest.raises(KernelArgumentError, match="^q:"):
        ragged_paged_attention(*batch.args(), impl="triton", interpret=True)
    batch = make_batch([(2, 5)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    if backends.triton_unavailable() is not None:  # no GPU launch path on this machine
        with pytest.raises(KernelArgumentError, match="^impl:.*cannot launch"):
            ragged_paged_attention(*batch.args(), impl="triton")


def test_mosaic_gpu_refuses_interpret_and_mixed_batches():
    batch = make_batch([(1, 5), (1, 3)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    with pytest.raises(KernelArgumentError, match="^interpret:"):
        ragged_paged_attention(*batch.args(), impl="mosaic_gpu", interpret=True, max_q_len=1)
    with pytest.raises(KernelArgumentError, match="^max_q_len:"):
        ragged_paged_attention(*batch.args(), impl="mosaic_gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu, reason="needs an NVIDIA GPU")
@pytest.mark.skipif(has_gpu and backends.triton_unavailable() is not None,
                    reason=f"impl='triton' cannot launch: {backends.triton_unavailable()}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("max_q_len", [None, 1], ids=["mixed", "decode"])
def test_compiled_kernel_on_gpu(max_q_len, dtype):
    # Through jax_triton on the GPU: a long decode row (split-K), chunks, an idle row; then
    # a window, a soft-cap and float8 pages with scales on the same batch.
    seqs = ([(1, 900), (1, 17)] if max_q_len == 1
            else [(300, 700), (1, 513), (37, 37), (0, 9), (1, 4500)])
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                       num_tokens=384, seq_bucket=8, dtype=dtype, seed=3)
    _check(batch, dtype, interpret=False, max_q_len=max_q_len)
    ks, vs = 0.05, 0.25
    args = _fp8_args(batch, ks, vs)
    out = attention_with_options(*args, sliding_window=jnp.int32(200), logit_softcap=30.0,
                                 k_scale=jnp.float32(ks), v_scale=jnp.float32(vs),
                                 impl="triton", max_q_len=max_q_len)
    ref = ragged_paged_attention(*args, sliding_window=200, logit_softcap=30.0, k_scale=ks,
                                 v_scale=vs, impl="reference")
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), **TOLERANCES[dtype])


def test_gpu_pass_records_vouch_only_for_the_same_kernel(tmp_path, monkeypatch):
    from pallas_kernels import verified

    path = str(tmp_path / "records.json")
    shape = verified.ShapeClass(head_dim=128, page_size=16, gqa=4)
    assert not verified.has_passed("mosaic_gpu", "NVIDIA H200", shape, path)
    [entry] = verified.record_pass("mosaic_gpu", "NVIDIA H200", {shape: 3}, path=path)
    assert entry["cases"] == 3 and entry["source"] == verified.source_digest("mosaic_gpu")
    assert entry["shape_class"] == "d128-p16-g4"
    assert verified.has_passed("mosaic_gpu", "NVIDIA H200", shape, path)
    assert not verified.has_passed("mosaic_gpu", "NVIDIA H100", shape, path)  # another device
    assert not verified.has_passed("triton", "NVIDIA H200", shape, path)  # another kernel
    for other in (verified.ShapeClass(head_dim=128, page_size=32, gqa=4),  # another class
                  verified.ShapeClass(head_dim=128, page_size=16, gqa=8),
                  verified.ShapeClass(head_dim=128, page_size=16, gqa=4, fp8=True), None):
        assert not verified.has_passed("mosaic_gpu", "NVIDIA H200", other, path)
    # An edited kernel (another source digest) or another jax is no longer vouched for.
    monkeypatch.setattr(verified, "source_digest", lambda impl: "edited")
    assert not verified.has_passed("mosaic_gpu", "NVIDIA H200", shape, path)
    monkeypatch.undo()
    monkeypatch.setattr(verified.jax, "__version__", "9.9.9")
    assert not verified.has_passed("mosaic_gpu", "NVIDIA H200", shape, path)
    monkeypatch.undo()
    # Nor other versions of the implementation's own libraries (jax-triton, triton).
    verified.record_pass("triton", "NVIDIA H200", {shape: 2}, path=path)
    assert verified.has_passed("triton", "NVIDIA H200", shape, path)
    monkeypatch.setattr(verified, "library_versions",
                        lambda impl: {"jax-triton": "0.0.1", "triton": "3.6.0"})
    assert not verified.has_passed("triton", "NVIDIA H200", shape, path)
    monkeypatch.undo()
    # Written only where $ARCJAX_VERIFIED_KERNELS (or the caller) says, and read there.
    monkeypatch.delenv(verified.ENV, raising=False)
    with pytest.raises(verified.RecordPathError, match=verified.ENV):
        verified.record_pass("mosaic_gpu", "NVIDIA H200", {shape: 1})
    assert not verified.has_passed("mosaic_gpu", "NVIDIA H200", shape)
    monkeypatch.setenv(verified.ENV, path)
    assert verified.has_passed("mosaic_gpu", "NVIDIA H200", shape)
    (tmp_path / "records.json").write_text("not json")  # unreadable: vouches for nothing
    assert not verified.has_passed("mosaic_gpu", "NVIDIA H200", shape, path)
