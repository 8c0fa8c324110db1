"""Quantized weights and the FP8 KV cache end to end.

FP8/INT8 checkpoints are written from a tiny model the way the Hub stores them (fp8
128x128 blocks with `weight_scale_inv`, compressed-tensors FP8 per channel / per tensor,
compressed-tensors INT8 per channel). The reference is transformers running the same
weights dequantized in float32, so greedy tokens must be identical: arcjax keeps the
weights quantized on the device and dequantizes them inside the step.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

import arcjax
from arcjax.errors import EngineConfigError, ModelConfigError
from arcjax.model.formats.hub import resolve_model
from arcjax.model.formats.loader import _repeat_kv, load_model
from arcjax.model.quant import QuantizedWeight, weight_dtype
from arcjax.model.formats.quantized_checkpoint import _scale_layout
from support.checkpoint_cases import ENGINE, GREEDY, PROMPTS, dense_greedy
from support.gguf_files import tiny_gguf_model_dir
from support.hf_models import hf_greedy
from support.quantized_models import KV_SCALES, quantize_np, quantized_checkpoint


@pytest.mark.parametrize("layout, fmt", [("block", "fp8"), ("channel", "fp8"),
                                         ("tensor", "fp8"), ("channel", "int8")])
def test_quantized_checkpoints_greedy_equal_transformers(layout, fmt):
    """Each checkpoint layout, weights kept quantized (the engine runs them in
    test_engine_fp8_weights_then_fp8_kv_cache_with_checkpoint_scales)."""
    qdir, fdir = quantized_checkpoint(layout, fmt)
    model = load_model(resolve_model(qdir), dtype=jnp.float32)
    wq = model.params["layers"]["wq"]
    assert isinstance(wq, QuantizedWeight)
    assert wq.block == {"block": (128, 128), "channel": (256, 1), "tensor": (256, 256)}[layout]
    assert weight_dtype(model.params) == ("float8_e4m3fn" if fmt == "fp8" else "int8")
    ids = PROMPTS[1]
    assert dense_greedy(model.cfg, model.params, ids, 12) == hf_greedy(fdir, ids, 12)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantization_at_load_is_per_channel(fmt):
    """quantization= on a float checkpoint: int8 has one scale per output channel (max |w|
    / 127); fp8 one per output channel and block of 32 input rows, max |w| / 448 of the
    block times one of 32 steps of the octave above (the least rounding error, nothing
    saturated: issue 37). Every
    weight within half a quantization step (int8) or e4m3's 2**-4 relative rounding plus
    its subnormal step (fp8)."""
    src = tiny_gguf_model_dir("LlamaForCausalLM")
    model = load_model(resolve_model(src), dtype=jnp.float32, quantization=fmt)
    ref = load_model(resolve_model(src), dtype=jnp.float32)
    qmax = 448.0 if fmt == "fp8" else 127.0
    for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w, float_w = model.params["layers"][key], np.asarray(ref.params["layers"][key])
        rows = 32 if fmt == "fp8" else w.shape[-2]
        assert isinstance(w, QuantizedWeight) and w.block == (rows, 1)
        scale = np.asarray(w.scale)  # [L, in / rows, out]
        blocks = float_w.reshape(float_w.shape[0], -1, rows, float_w.shape[-1])
        amax = np.abs(blocks).max(axis=2) / qmax  # [L, in / rows, out]
        if fmt == "int8":
            np.testing.assert_allclose(scale, amax, rtol=1e-6)
        else:  # amax / 448 * 2**(i / 32), i in [0, 32)
            steps = 32 * np.log2(scale / amax)
            np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
            assert steps.min() > -1e-3 and steps.max() < 31 + 1e-3
        full = np.repeat(scale, rows, axis=1)
        err = np.abs(np.asarray(w.dequantize(jnp.float32)) - float_w)
        bound = (0.5 * full if fmt == "int8"
                 else np.abs(float_w) * 2.0**-4 + full * 2.0**-9)
        assert (err <= bound * (1 + 1e-4)).all(), key
    assert weight_dtype(model.params) == ("float8_e4m3fn" if fmt == "fp8" else "int8")


def test_quantization_errors_are_typed():
    qdir, _ = quantized_checkpoint("channel", "int8")
    with pytest.raises(EngineConfigError, match="checkpoint is int8") as err:
        load_model(resolve_model(qdir), dtype=jnp.float32, quantization="fp8")
    assert err.value.field == "quantization"
    with pytest.raises(EngineConfigError) as err:
        arcjax.LLM(qdir, quantization="nf4")
    assert err.value.field == "quantization"
    with pytest.raises(EngineConfigError) as err:
        arcjax.LLM(qdir, kv_cache_dtype="int4")
    assert err.value.field == "kv_cache_dtype"
    # (GPTQ loads since issue 37, packed: tests/test_quant4_checkpoints.py)
    bnb = tempfile.mkdtemp(prefix="arcjax-bnb-")
    for f in os.listdir(qdir):
        shutil.copy(os.path.join(qdir, f), bnb)
    with open(os.path.join(bnb, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(os.path.join(bnb, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelConfigError, match="'bitsandbytes' is not supported"):
        load_model(resolve_model(bnb), dtype=jnp.float32)


def test_engine_fp8_weights_then_fp8_kv_cache_with_checkpoint_scales():
    """kv_cache_dtype="fp8": FP8 pages with the checkpoint's per-layer scales (0.02 here,
    so a path that dropped a scale would be off by 50x). The prompt log-probabilities
    (every position reads the FP8 pages of all earlier ones) stay close to the float
    cache's: measured max 0.13 nats, mean 0.04 on this random model whose outputs are
    near-uniform (asserted: 0.25 and 0.08). The format's accuracy is measured in
    tests/test_kernels_fp8.py and by scripts/bench_quant.py (perplexity)."""
    qdir, fdir = quantized_checkpoint("channel", "fp8", kv_scales=True)
    plain = arcjax.LLM(qdir, **ENGINE)  # FP8 weights, float cache: transformers' tokens
    assert plain.trace_summary(1.0)["weight_dtype"] == "float8_e4m3fn"
    for ids, out in zip(PROMPTS, plain.generate(list(PROMPTS), GREEDY, use_tqdm=False)):
        assert list(out.token_ids) == hf_greedy(fdir, ids, GREEDY.max_tokens)
    llm = arcjax.LLM(qdir, kv_cache_dtype="fp8", **ENGINE)
    cache = llm.engine.runner.cache
    assert cache["k"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(cache["k_scale"], np.float32([KV_SCALES[0]] * 2))
    np.testing.assert_array_equal(cache["v_scale"], np.float32([KV_SCALES[1]] * 2))
    assert llm.trace_summary(1.0)["kv_cache_dtype"] == "float8_e4m3fn"
    prompt = list(np.random.default_rng(0).integers(3, 380, size=40))
    params = arcjax.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def logprobs(engine):
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        return np.array([pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    want, got = logprobs(plain), logprobs(llm)
    diff = np.abs(got - want)
    assert 0 < diff.max() < 0.25 and diff.mean() < 0.08, diff


def test_fp8_kv_cache_doubles_the_blocks_memory_holds():
    from arcjax.engine.build import _default_num_blocks
    from arcjax.model.formats.hf_layout import read_config

    cfg = read_config(tiny_gguf_model_dir("LlamaForCausalLM"))
    # Memory-bound (the CPU cap, a power of two): one byte a value holds twice the blocks.
    f32, bf16, fp8 = (_default_num_blocks(cfg, jnp.dtype(d), 16, 8, 1 << 20, 0.5)
                      for d in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn))
    assert fp8 == 2 * bf16 == 4 * f32


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_kv_heads_repeated_for_tensor_parallelism_keep_their_scales(layout):
    """Tensor parallelism beyond the KV heads repeats each head's columns; a quantized
    weight's scales follow them (a tp=4 run over 4 CPU devices gives the tp=1 tokens:
    see RESULTS.md)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(256, 256)).astype(np.float32)  # [out = 2 heads x 128, in]
    values, scale, _ = quantize_np(w, layout, "fp8")
    s, block = _scale_layout(scale, 256, 256, (128, 128), "w", "w")
    qw = QuantizedWeight(np.ascontiguousarray(values.T), s, block)
    repeated = _repeat_kv(qw, 2, 128)
    dense = np.asarray(qw.dequantize(jnp.float32))  # [in, out]
    want = np.repeat(dense.reshape(256, 2, 1, 128), 2, axis=2).reshape(256, 512)
    np.testing.assert_array_equal(np.asarray(repeated.dequantize(jnp.float32)), want)


def test_sharding_specs_cover_the_scales():
    """Values keep the weight's logical axes; a per-channel scale follows the output axis,
    block and per-tensor scales are replicated."""
    from arcjax.model.quant import quantized_specs
    from arcjax.model.specs import param_specs
    from arcjax.parallel.layout import TensorParallel

    def specs_of(layout):
        qdir, _ = quantized_checkpoint(layout)
        model = load_model(resolve_model(qdir), dtype=jnp.float32)
        return model.cfg, quantized_specs(param_specs(model.cfg), model.params)["layers"]

    cfg, channel = specs_of("channel")
    tp = TensorParallel.create(cfg, 1)
    assert channel["wq"].values.axes == ("layers", "embed", "heads")
    assert tuple(tp.pspec(channel["wq"].scale.axes)) == (None, None, "tp")
    assert tuple(tp.pspec(channel["w_down"].scale.axes)) == (None, None, None)  # out: embed
    _, block = specs_of("block")
    assert block["wk"].scale.shape == (2, 2, 1) and block["wk"].scale.axes == (
        "layers", None, None)
