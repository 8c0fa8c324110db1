"""Multi-head latent attention (MLA, absorbed): the float64 oracle against the naive
per-head path (keys and values expanded through W_uk / W_uv, then ordinary paged attention),
the xla path and the Pallas GPU kernel (interpret mode) against the oracle on random ragged
batches, the cache write, the typed refusals, and the kernel's CUDA lowering on the CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import KernelArgumentError, lowering, ragged_paged_attention
from pallas_kernels.mla import mla_attention, ragged_paged_mla, resolve_mla_impl, write_latent
from pallas_kernels.mla_inputs import MLAInputs
from pallas_kernels.mla_pallas_gpu import make_mla_plan, mla_attention_pallas_gpu
from pallas_kernels.mla_reference import mla_attention_float64
from pallas_kernels.testing import make_mla_batch
from support.attention_batches import ragged_seqs

mla = jax.jit(mla_attention, static_argnames=("impl", "interpret"))
SEQS = [(1, 70), (9, 30), (1, 3), (0, 9), (5, 5), (1, 40)]  # decode, chunks, idle
TOL = {jnp.float32: dict(atol=3e-5, rtol=3e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _check(batch, out, dtype, sm_scale, **tol):
    ref = mla_attention_float64(batch.inputs(sm_scale=sm_scale))
    out = np.asarray(out, np.float32)
    assert out.shape == batch.q_latent.shape and not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, ref, **(tol or TOL[dtype]))


def test_absorbed_equals_naive_per_head_attention():
    # DeepSeek's shapes in miniature: Dn=16 no-rope dims, Dr=8 rope dims, Dv=12, Dl=32.
    hq, dn, dr, dv, dl, bs = 4, 16, 8, 12, 32, 4
    batch = make_mla_batch([(3, 11), (1, 6), (4, 4)], num_heads=hq, latent_dim=dl,
                           rope_dim=dr, block_size=bs, nan_fill=False, seed=7)
    rng = np.random.default_rng(0)
    w_uk = jnp.asarray(rng.normal(size=(hq, dn, dl)) * 0.2, jnp.float32)  # c -> k_nope_h
    w_uv = jnp.asarray(rng.normal(size=(hq, dl, dv)) * 0.2, jnp.float32)  # c -> v_h
    q_nope = jnp.asarray(rng.normal(size=(batch.q_latent.shape[0], hq, dn)), jnp.float32)
    q_pe, c, pe = batch.q_rope, batch.latent_pages, batch.rope_pages
    scale = (dn + dr) ** -0.5
    # absorbed: q_latent = W_uk^T q_nope, out = W_uv(attention over the latents)
    q_latent = jnp.einsum("thn,hnl->thl", q_nope, w_uk)
    lat = ragged_paged_mla(q_latent, q_pe, c, pe, *batch.args()[4:], sm_scale=scale,
                           impl="reference")
    absorbed = np.einsum("thl,hlv->thv", np.asarray(lat, np.float64), np.asarray(w_uv))
    # naive: every head's keys [W_uk c, k_pe] and values W_uv c in per-head pages
    k = jnp.concatenate([jnp.einsum("nbl,hdl->nbhd", c, w_uk),
                         jnp.broadcast_to(pe[:, :, None], pe.shape[:2] + (hq, dr))], -1)
    v = jnp.einsum("nbl,hlv->nbhv", c, w_uv)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dn + dr - dv)))  # K and V share a width
    q = jnp.concatenate([q_nope, q_pe], -1)
    naive = ragged_paged_attention(q, k, v, *batch.args()[4:], sm_scale=scale,
                                   impl="reference")
    np.testing.assert_allclose(absorbed, np.asarray(naive)[..., :dv], atol=2e-5, rtol=2e-5)
    xla = mla(MLAInputs.create(q_latent=q_latent, q_rope=q_pe, latent_pages=c, rope_pages=pe,
                               block_tables=batch.block_tables, kv_lens=batch.kv_lens,
                               cu_seqlens_q=batch.cu_seqlens_q, num_seqs=batch.num_seqs,
                               sm_scale=scale), impl="xla")
    np.testing.assert_allclose(np.einsum("thl,hlv->thv", np.asarray(xla), np.asarray(w_uv)),
                               np.asarray(naive)[..., :dv], atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("heads, dl, dr, bs", [(4, 32, 16, 4), (16, 64, 16, 8)],
                         ids=["h4-l32-r16-bs4", "h16-l64-r16-bs8"])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_xla_matches_float64_oracle(heads, dl, dr, bs, data):
    seqs = data.draw(ragged_seqs(max_seqs=5, max_kv=40, max_tokens=24), label="seqs")
    batch = make_mla_batch(seqs, num_heads=heads, latent_dim=dl, rope_dim=dr, block_size=bs,
                           num_tokens=24, seq_bucket=6, max_blocks=-(-40 // bs) + 1,
                           num_blocks=6 * (-(-40 // bs) + 1),
                           seed=data.draw(st.integers(0, 2**16), label="seed"))
    _check(batch, mla(batch.inputs(sm_scale=0.15), impl="xla"), jnp.float32, 0.15)


@pytest.mark.parametrize("dtype, decode_only, num_splits", [
    (jnp.float32, False, 1), (jnp.float32, False, 3), (jnp.bfloat16, True, None)],
    ids=["mixed", "mixed-split", "decode-bf16"])
def test_pallas_gpu_interpret_matches_float64_oracle(dtype, decode_only, num_splits):
    seqs = [(min(q, 1), kv) for q, kv in SEQS] if decode_only else SEQS
    batch = make_mla_batch(seqs, num_heads=8, latent_dim=32, rope_dim=16, block_size=8,
                           num_tokens=24, seq_bucket=8, max_blocks=10, dtype=dtype, seed=3)
    inputs = batch.inputs(sm_scale=0.2, max_q_len=1 if decode_only else None)
    tuning = {} if num_splits is None else dict(num_splits=num_splits)
    plan = make_mla_plan(inputs, block_k=16, **tuning)
    assert plan.group == 8 and (decode_only or plan.tiles.block_q > 1)
    assert plan.num_splits > 1 or num_splits == 1
    out = jax.jit(mla_attention_pallas_gpu, static_argnames=("plan", "interpret"))(
        inputs, plan=plan, interpret=True)
    _check(batch, out, dtype, 0.2)


def test_write_latent_fills_slots_and_drops_padding():
    latent, rope = jnp.zeros((3, 4, 8)), jnp.zeros((3, 4, 2))
    c = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8) + 1
    pe = -jnp.arange(3 * 2, dtype=jnp.float32).reshape(3, 2) - 1
    slots = jnp.array([5, 11, 12], jnp.int32)  # 12 = 3 * 4: a padding row's slot
    latent, rope = write_latent(latent, rope, c, pe, slots)
    np.testing.assert_array_equal(latent[1, 1], c[0])
    np.testing.assert_array_equal(latent[2, 3], c[1])
    np.testing.assert_array_equal(rope[1, 1], pe[0])
    assert int(jnp.count_nonzero(latent)) == 16 and int(jnp.count_nonzero(rope)) == 4
    with pytest.raises(KernelArgumentError, match="^latent:"):
        write_latent(latent, rope, c[:, :4], pe, slots)


@pytest.mark.parametrize("change, field", [
    (dict(q_rope=jnp.zeros((5, 3, 16))), "q_rope"),
    (dict(latent_pages=jnp.zeros((10, 8, 16))), "latent_pages"),
    (dict(rope_pages=jnp.zeros((10, 4, 16))), "rope_pages"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens"),
    (dict(block_tables=jnp.zeros((2, 4), jnp.float32)), "block_tables"),
    (dict(sm_scale=0.0), "sm_scale"),
    (dict(max_q_len=0), "max_q_len"),
])
def test_bad_inputs_name_the_field(change, field):
    args = dict(q_latent=jnp.zeros((5, 4, 32)), q_rope=jnp.zeros((5, 4, 16)),
                latent_pages=jnp.zeros((10, 8, 32)), rope_pages=jnp.zeros((10, 8, 16)),
                block_tables=jnp.zeros((2, 4), jnp.int32), kv_lens=jnp.zeros((2,), jnp.int32),
                cu_seqlens_q=jnp.zeros((3,), jnp.int32), num_seqs=1, sm_scale=0.1)
    with pytest.raises(KernelArgumentError, match=f"^{field}:"):
        MLAInputs.create(**(args | change))
    with pytest.raises(KernelArgumentError, match="^impl:"):
        mla_attention(MLAInputs.create(**args), impl="triton")


def test_auto_runs_the_kernel_on_a_gpu_only_with_a_recorded_pass(monkeypatch, tmp_path):
    import json

    from pallas_kernels import backends, verified
    from pallas_kernels.mla import choose_mla_impl, mla_shape_class

    path = tmp_path / "records.json"
    monkeypatch.setenv(verified.ENV, str(path))
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "current")
    kind = backends.device_kind()  # what a pretend GPU's records are keyed by
    inputs = make_mla_batch([(1, 5)], num_heads=4, latent_dim=32, rope_dim=16,
                            block_size=4).inputs(sm_scale=0.1)
    shape = mla_shape_class(inputs)
    assert shape.key == "d32-r16-p4-g4" and verified.ShapeClass.from_key(shape.key) == shape
    assert resolve_mla_impl("auto", inputs, platform="cpu") == "xla"
    # No record: "auto" stays on xla; an explicit "pallas_gpu" runs, reported unverified.
    assert choose_mla_impl("auto", inputs, platform="gpu") == backends.Choice(
        impl="xla", verified=None, shape_class=shape.key)
    assert choose_mla_impl("pallas_gpu", inputs, platform="gpu").verified is False
    # Records that do not vouch: the attention kernel's name, another shape class (8 heads),
    # another device kind, a stale source digest (the 8 heads' record is its own).
    fields = verified.current(verified.MLA_KERNEL, kind, shape) | dict(when="x", cases=1)
    other = verified.ShapeClass(head_dim=32, rope_dim=16, page_size=4, gqa=8).key
    path.write_text(json.dumps([fields | dict(impl="pallas_gpu"), fields | dict(
        shape_class=other), fields | dict(device_kind="NVIDIA H200"), fields | dict(
        source="0" * 64)]))
    assert resolve_mla_impl("auto", inputs, platform="gpu") == "xla"
    eight = make_mla_batch([(1, 5)], num_heads=8, latent_dim=32, rope_dim=16, block_size=4)
    assert resolve_mla_impl("auto", eight.inputs(sm_scale=0.1), platform="gpu") == "pallas_gpu"
    # A record of this kernel, kind, source and class: "auto" runs it, verified.
    verified.record_pass(verified.MLA_KERNEL, kind, {shape: 2})
    assert choose_mla_impl("auto", inputs, platform="gpu") == backends.Choice(
        impl="pallas_gpu", verified=True, shape_class=shape.key)
    assert choose_mla_impl("pallas_gpu", inputs, platform="gpu").verified is True
    assert resolve_mla_impl("auto", inputs, platform="cpu") == "xla"
    # Still only where the dims tile and Pallas' Triton backend is current.
    odd = make_mla_batch([(1, 5)], num_heads=4, latent_dim=48, rope_dim=16, block_size=4)
    odd_inputs = odd.inputs(sm_scale=0.1)
    verified.record_pass(verified.MLA_KERNEL, kind, {mla_shape_class(odd_inputs): 1})
    assert resolve_mla_impl("auto", odd_inputs, platform="gpu") == "xla"
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "deprecated")
    assert resolve_mla_impl("auto", inputs, platform="gpu") == "xla"
    # Editing the kernel's sources invalidates its records.
    assert "mla_pallas_gpu.py" in verified.SOURCES[verified.MLA_KERNEL]
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "current")
    monkeypatch.setattr(verified, "source_digest", lambda impl: "edited")
    assert resolve_mla_impl("auto", inputs, platform="gpu") == "xla"


_NO_CUDA = lowering.cuda_lowering_unavailable()


@pytest.mark.skipif(_NO_CUDA is not None, reason=_NO_CUDA or "")
@pytest.mark.parametrize("heads, max_q_len", [(16, 256), (16, 1), (128, 1)],
                         ids=["v2lite-mixed", "v2lite-decode", "v3-decode"])
def test_kernel_lowers_for_cuda_at_deepseek_shapes(heads, max_q_len):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    inputs = MLAInputs.create(
        q_latent=sds((256, heads, 512), jnp.bfloat16), q_rope=sds((256, heads, 64), jnp.bfloat16),
        latent_pages=sds((2048, 16, 512), jnp.bfloat16),
        rope_pages=sds((2048, 16, 64), jnp.bfloat16), block_tables=sds((16, 128), i32),
        kv_lens=sds((16,), i32), cu_seqlens_q=sds((17,), i32), num_seqs=sds((), i32),
        sm_scale=192**-0.5, max_q_len=max_q_len)
    plan = make_mla_plan(inputs)
    assert plan.group == 16 and plan.rows * 512 <= 64 * 512
    text = lowering.lower_for_cuda(mla_attention_pallas_gpu, inputs, plan=plan)
    assert lowering.triton_kernel_calls(text) == 1
