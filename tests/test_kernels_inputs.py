"""`AttentionInputs`: one pytree per attention call, its one validation, its one dispatch.

The arrays and traced options are leaves, the static settings part of the tree's structure;
`create` names the offending field; abstract inputs (`jax.ShapeDtypeStruct`) resolve as
`resolve_call` does; under tensor parallelism `attention_map` splits every field as
declared (a windowed, soft-capped model over FP8 pages, in a 2-device subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import AttentionInputs, KernelArgumentError, backends, paged_attention
from pallas_kernels.testing import make_batch

HERE = Path(__file__).resolve().parent


def _batch(**kwargs):
    return make_batch([(3, 10), (1, 7), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64,
                      block_size=4, num_tokens=8, seq_bucket=4, seed=3, **kwargs)


def test_leaves_are_the_arrays_and_the_settings_are_static():
    batch = _batch()
    plain = batch.inputs()
    assert len(jax.tree.leaves(plain)) == 7  # no option: no leaf
    full = batch.inputs(sliding_window=3, k_scale=0.5, v_scale=0.25, logit_softcap=2.0,
                        sm_scale=0.2, max_q_len=3)
    assert len(jax.tree.leaves(full)) == 10
    assert full.options() == {"sliding_window", "logit_softcap", "k_scale", "v_scale"}
    # Static settings are part of the structure (a new one is a new executable) ...
    assert (jax.tree.structure(batch.inputs(logit_softcap=2.0))
            != jax.tree.structure(batch.inputs(logit_softcap=3.0)))
    assert (jax.tree.structure(batch.inputs(sm_scale=0.1))
            != jax.tree.structure(batch.inputs(sm_scale=0.2)))
    # ... a traced option's value is not.
    assert (jax.tree.structure(batch.inputs(sliding_window=3))
            == jax.tree.structure(batch.inputs(sliding_window=5)))


def test_create_fills_defaults_and_normalizes_dtypes():
    batch = _batch()
    inputs = AttentionInputs.create(
        q=batch.q, k_pages=batch.k_pages, v_pages=batch.v_pages,
        block_tables=np.asarray(batch.block_tables, np.int64),
        kv_lens=np.asarray(batch.kv_lens, np.int64), cu_seqlens_q=batch.cu_seqlens_q,
        num_seqs=2, sliding_window=5, k_scale=0.5, max_q_len=100)
    assert inputs.sm_scale == 64**-0.5 and inputs.max_q_len == 8  # clipped to T
    for x in (inputs.block_tables, inputs.kv_lens, inputs.cu_seqlens_q, inputs.num_seqs,
              inputs.sliding_window):
        assert x.dtype == jnp.int32
    assert inputs.k_scale.dtype == jnp.float32 and inputs.v_scale is None
    assert int(inputs.num_seqs) == 2 and int(inputs.sliding_window) == 5


@pytest.mark.parametrize("settings, argument", [
    (dict(sm_scale=0.0), "sm_scale"),
    (dict(sm_scale=-0.5), "sm_scale"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(sm_scale=True), "sm_scale"),
    (dict(sm_scale=jnp.float32(0.1)), "sm_scale"),  # static: a Python number
    (dict(max_q_len=0), "max_q_len"),
    (dict(max_q_len=2.0), "max_q_len"),
])
def test_bad_settings_name_the_field(settings, argument):
    with pytest.raises(KernelArgumentError, match=f"^{argument}:") as info:
        _batch().inputs(**settings)
    assert info.value.argument == argument


def test_dispatch_of_the_pytree_is_the_front_door():
    batch = _batch()
    settings = dict(sliding_window=jnp.int32(4), logit_softcap=1.5, sm_scale=0.2)
    front = jax.jit(pallas_kernels.ragged_paged_attention,
                    static_argnames=("impl", "logit_softcap", "sm_scale"))(
        *batch.args(), impl="xla", **settings)
    inputs = batch.inputs(**settings)
    out = jax.jit(paged_attention, static_argnames="impl")(inputs, impl="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(front))
    ref = paged_attention(batch.inputs(sliding_window=4, logit_softcap=1.5, sm_scale=0.2),
                          impl="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    with pytest.raises(KernelArgumentError, match="^impl:"):
        paged_attention(inputs, impl="cuda")


def _abstract(*, head_dim=64, block_size=16, dtype=jnp.bfloat16, kv_dtype=None, **settings):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pages = sds((32, block_size, 2, head_dim), kv_dtype or dtype)
    return AttentionInputs.create(
        q=sds((16, 8, head_dim), dtype), k_pages=pages, v_pages=pages,
        block_tables=sds((4, 8), i32), kv_lens=sds((4,), i32), cu_seqlens_q=sds((5,), i32),
        num_seqs=sds((), i32), **settings)


@pytest.mark.parametrize("pallas", ["current", "deprecated"])
def test_abstract_inputs_resolve_as_resolve_call_does(monkeypatch, pallas):
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: pallas)
    monkeypatch.setattr(backends, "triton_unavailable", lambda: None)
    sds = jax.ShapeDtypeStruct
    cases = [dict(), dict(max_q_len=1), dict(sliding_window=sds((), jnp.int32)),
             dict(logit_softcap=30.0, max_q_len=1), dict(head_dim=48),
             dict(kv_dtype=jnp.float8_e4m3fn, k_scale=sds((), jnp.float32),
                  v_scale=sds((), jnp.float32))]
    seen = set()
    for case in cases:
        inputs = _abstract(**case)
        for platform in ("cpu", "gpu"):
            got = pallas_kernels.resolve_inputs("auto", inputs, platform=platform)
            options = {name: getattr(inputs, name) for name in inputs.options()}
            want = pallas_kernels.resolve_call("auto", inputs.q, inputs.k_pages,
                                               max_q_len=inputs.max_q_len, platform=platform,
                                               **options)
            assert got == want, (case, platform)
            seen.add(got)
    assert "xla" in seen and seen & {"pallas_gpu", "triton"}  # both branches were taken
    # Abstract inputs are validated like arrays: 3 query heads over 2 KV heads.
    pages = sds((8, 4, 2, 64), jnp.float32)
    with pytest.raises(KernelArgumentError, match="^k_pages:"):
        AttentionInputs.create(q=sds((4, 3, 64), jnp.float32), k_pages=pages, v_pages=pages,
                               block_tables=sds((1, 2), jnp.int32), kv_lens=sds((1,), jnp.int32),
                               cu_seqlens_q=sds((2,), jnp.int32), num_seqs=sds((), jnp.int32))


# --- tensor parallelism: every field split as declared --------------------------------------
def _parallel_logits() -> dict:
    """2 host devices: one step of a windowed, soft-capped model over FP8 pages, on one
    device and under tensor parallelism (`attention_map`)."""
    from arcjax.model import decoder
    from arcjax.model.model_config import ModelConfig
    from arcjax.model.specs import init_params, make_cache
    from arcjax.parallel import TensorParallel
    from pallas_kernels.paging import paged_layout

    assert jax.device_count() == 2
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=4,
                      sliding_layers=(True, False), attn_logit_softcap=3.0)
    params = init_params(cfg, jax.random.key(0), std=0.3)
    block_size, num_blocks = 4, 8
    layout = paged_layout([0, 0], [9, 3], [[0, 1, 2], [3]], token_bucket=16, seq_bucket=4,
                          max_blocks=4, block_size=block_size, num_blocks=num_blocks)
    batch = decoder.StepBatch(
        token_ids=jnp.asarray(np.arange(16) % 64, jnp.int32),
        positions=jnp.asarray(layout.positions),
        slot_mapping=jnp.asarray(layout.slot_mapping)[None],  # one KV cache group
        cu_seqlens_q=jnp.asarray(layout.cu_seqlens_q), kv_lens=jnp.asarray(layout.kv_lens),
        block_tables=jnp.asarray(layout.block_tables)[None], num_seqs=jnp.int32(layout.num_seqs),
        logits_rows=jnp.asarray(layout.last_rows))
    scales = [[0.02, 0.03], [0.05, 0.04]]
    out = {}
    for tp in (1, 2):
        parallel = None if tp == 1 else TensorParallel.create(cfg, tp)
        cache = (make_cache(cfg, num_blocks, block_size, jnp.float8_e4m3fn, scales)
                 if parallel is None else
                 parallel.make_cache(cfg, num_blocks, block_size, jnp.float8_e4m3fn, scales))
        p = params if parallel is None else jax.device_put(params, parallel.param_shardings(cfg))
        step = jax.jit(decoder.forward, static_argnames=("cfg", "attn_impl", "parallel"))
        logits, new_cache = step(p, cache, batch, cfg=cfg, attn_impl="xla", parallel=parallel)
        out[tp] = dict(logits=np.asarray(logits).tolist(),
                       k=np.asarray(new_cache["k"].astype(jnp.float32)).tolist(),
                       spec=str(getattr(new_cache["k"].sharding, "spec", "")))
    return out


def test_attention_map_splits_every_field_as_declared():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = got["1"], got["2"]
    assert "tp" in two["spec"]  # the cache really is split by KV head
    np.testing.assert_array_equal(np.asarray(two["k"]), np.asarray(one["k"]))
    np.testing.assert_allclose(np.asarray(two["logits"]), np.asarray(one["logits"]),
                               atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(one["logits"])).max() > 0


if __name__ == "__main__":
    print(json.dumps(_parallel_logits()))
