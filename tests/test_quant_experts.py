"""Quantized expert weights: `quantization=` on mixtures of experts, FP8 expert checkpoints.

The stacked expert weights [L, E, in, out] are quantized per expert and output channel and
stay quantized on the device; the grouped GEMMs (tiled, ragged_dot and the dense loop)
dequantize each (layer, expert) matrix inside the step. The reference is transformers
running the same weights dequantized in float32 (written back as a float checkpoint), so
greedy tokens must be identical.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arcjax
from arcjax.model.hub import resolve_model
from arcjax.model.loader import load_model
from arcjax.model.moe import moe_mlp
from arcjax.model.quant import QuantizedWeight, param_bytes, quantized_specs
from arcjax.model.specs import param_specs
from arcjax.model.weights import save_hf
from hf_models import hf_greedy, tiny_model_dir
from test_gguf import PROMPTS, dense_greedy
from test_quant import quantized_checkpoint

EXPERTS = ("we_gate", "we_up", "we_down")
GREEDY = arcjax.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_model_len=128, max_num_seqs=4, num_kv_blocks=64, async_scheduling=False)


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantized_dir(cfg, params) -> str:
    """A float checkpoint of `params` with every quantized weight dequantized (float32)."""
    dense = jax.tree.map(lambda w: w.dequantize(jnp.float32) if _is_quantized(w) else w,
                         params, is_leaf=_is_quantized)
    path = tempfile.mkdtemp(prefix="arcjax-deq-moe-")
    save_hf(dense, cfg, path)
    return path


@pytest.mark.parametrize("arch, fmt", [("MixtralForCausalLM", "int8")])
def test_quantized_experts_greedy_equal_transformers(arch, fmt):
    """Expert weights quantized per (expert, output channel), kept quantized; the dense
    forward's tiled grouped GEMM gives transformers' tokens on the dequantized weights
    (FP8 experts: test_engine_serves_quantized_experts_and_shared_expert and the FP8
    checkpoint test)."""
    src = tiny_model_dir(arch)
    ref = load_model(resolve_model(src), dtype=jnp.float32)
    model = load_model(resolve_model(src), dtype=jnp.float32, quantization=fmt)
    layers = model.params["layers"]
    qmax = 448.0 if fmt == "fp8" else 127.0
    for key in EXPERTS:
        w, float_w = layers[key], np.asarray(ref.params["layers"][key])
        assert _is_quantized(w) and w.dtype == (jnp.float8_e4m3fn if fmt == "fp8" else jnp.int8)
        assert w.scale.shape == (*float_w.shape[:2], 1, float_w.shape[-1])  # [L, E, 1, out]
        np.testing.assert_allclose(np.asarray(w.scale),
                                   np.abs(float_w).max(axis=2, keepdims=True) / qmax, rtol=1e-6)
    assert not _is_quantized(layers["router"])  # routers stay in the compute dtype
    # values: 1 byte instead of 4 (scales add one float per expert and channel)
    assert param_bytes(layers[key]) < 0.3 * float_w.nbytes
    assert param_bytes(model.params) < 0.5 * param_bytes(ref.params)
    want = hf_greedy(dequantized_dir(model.cfg, model.params), PROMPTS[1], 12)
    assert dense_greedy(model.cfg, model.params, PROMPTS[1], 12) == want


def test_engine_serves_quantized_experts_and_shared_expert():
    """Qwen2-MoE (with its gated shared expert, quantized too) through `arcjax.LLM`: the
    paged, batched engine's greedy tokens equal transformers' on the dequantized weights;
    the grouped-GEMM implementations agree on the quantized weights."""
    src = tiny_model_dir("Qwen2MoeForCausalLM")
    llm = arcjax.LLM(src, quantization="fp8", **ENGINE)
    runner = llm.engine.runner
    layers = runner.params["layers"]
    assert all(_is_quantized(layers[k]) for k in EXPERTS + ("ws_gate", "ws_up", "ws_down"))
    assert llm.trace_summary(1.0)["weight_dtype"] == "float8_e4m3fn"
    ref = dequantized_dir(runner.cfg, runner.params)
    outs = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == hf_greedy(ref, ids, GREEDY.max_tokens)
    h = jax.random.normal(jax.random.key(0), (16, runner.cfg.hidden_size), jnp.float32)
    experts = {k: layers[k] for k in EXPERTS}
    lp = {k: jax.tree.map(lambda x: x[0], v) for k, v in layers.items() if k not in EXPERTS}
    cfg = runner.cfg

    def mlp(impl):
        out, _ = moe_mlp(h, lp, experts, jnp.int32(0), num_experts=cfg.num_experts,
                         top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                         act=cfg.hidden_act, valid=jnp.ones(16, bool), impl=impl)
        return np.asarray(out)

    np.testing.assert_allclose(mlp("ragged_dot"), mlp("tiled"), atol=2e-5)
    np.testing.assert_allclose(mlp("dense"), mlp("tiled"), atol=2e-5)

def test_expert_scales_are_split_with_their_experts():
    """Sharding specs: an expert weight's per-channel scale [L, E, 1, out] carries the
    values' expert axis (expert parallelism splits both) and their output axis."""
    src = tiny_model_dir("MixtralForCausalLM")
    model = load_model(resolve_model(src), dtype=jnp.float32, quantization="fp8")
    specs = quantized_specs(param_specs(model.cfg), model.params)["layers"]
    assert specs["we_gate"].values.axes == ("layers", "expert", "embed", "moe_mlp")
    assert specs["we_gate"].scale.axes == ("layers", "expert", None, "moe_mlp")
    assert specs["we_down"].scale.axes == ("layers", "expert", None, "embed")


def test_fp8_expert_checkpoint_loads_per_expert_tensors():
    """A compressed-tensors FP8 checkpoint of a Qwen3-MoE (one FP8 tensor and scale per
    layer and expert, as Qwen3-30B-A3B-FP8 stores them) loads with its experts stacked and
    still quantized; greedy tokens equal transformers on the dequantized weights."""
    qdir, fdir = quantized_checkpoint("channel", "fp8", src=tiny_model_dir("Qwen3MoeForCausalLM"))
    model = load_model(resolve_model(qdir), dtype=jnp.float32)
    w = model.params["layers"]["we_down"]
    assert _is_quantized(w) and w.dtype == jnp.float8_e4m3fn
    assert w.scale.shape == (2, 8, 1, model.cfg.hidden_size)
    assert dense_greedy(model.cfg, model.params, PROMPTS[1], 12) == hf_greedy(fdir, PROMPTS[1], 12)
