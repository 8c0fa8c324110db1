"""Quantized expert weights: `quantization=` on mixtures of experts, FP8 expert checkpoints.

The stacked expert weights [L, E, in, out] are quantized per expert and output channel and
stay quantized on the device; the grouped GEMMs (tiled, ragged_dot and the dense loop)
dequantize each (layer, expert) matrix inside the step. The reference is transformers
running the same weights dequantized in float32 (written back as a float checkpoint), so
greedy tokens must be identical.
"""

from __future__ import annotations

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.model.formats.hub import resolve_model
from arcjax.model.formats.loader import load_model
from arcjax.model.moe import moe_mlp
from arcjax.model.quant import QuantizedWeight, param_bytes, quantized_specs
from arcjax.model.specs import param_specs
from arcjax.model.formats.hf_checkpoint import save_hf
from support.hf_models import hf_greedy, tiny_model_dir
from support.checkpoint_cases import PROMPTS, dense_greedy
from support.quantized_models import quantized_checkpoint

EXPERTS = ("we_gate", "we_up", "we_down")


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantized_dir(cfg, params) -> str:
    """A float checkpoint of `params` with every quantized weight dequantized (float32)."""
    dense = jax.jit(lambda p: jax.tree.map(
        lambda w: w.dequantize(jnp.float32) if _is_quantized(w) else w, p,
        is_leaf=_is_quantized))(params)
    path = tempfile.mkdtemp(prefix="arcjax-deq-moe-")
    save_hf(dense, cfg, path)
    return path


def test_experts_quantized_per_expert_and_channel():
    """Expert weights quantized per (expert, output channel) and kept quantized; routers
    stay float. (Greedy parity of int8 Mixtral experts: under tensor parallelism in
    test_engine_families; FP8 experts: the two tests below.)"""
    src = tiny_model_dir("MixtralForCausalLM")
    ref = load_model(resolve_model(src), dtype=jnp.float32)
    model = load_model(resolve_model(src), dtype=jnp.float32, quantization="int8")
    layers = model.params["layers"]
    for key in EXPERTS:
        w, float_w = layers[key], np.asarray(ref.params["layers"][key])
        assert _is_quantized(w) and w.dtype == jnp.int8
        assert w.scale.shape == (*float_w.shape[:2], 1, float_w.shape[-1])  # [L, E, 1, out]
        np.testing.assert_allclose(np.asarray(w.scale),
                                   np.abs(float_w).max(axis=2, keepdims=True) / 127, rtol=1e-6)
        err = np.abs(np.asarray(w.dequantize(jnp.float32)) - float_w)
        assert (err <= 0.5 * np.asarray(w.scale) * (1 + 1e-4)).all(), key
    assert not _is_quantized(layers["router"])  # routers stay in the compute dtype
    # values: 1 byte instead of 4 (scales add one float per expert and channel)
    assert param_bytes(layers[key]) < 0.3 * float_w.nbytes
    assert param_bytes(model.params) < 0.5 * param_bytes(ref.params)


def test_fp8_experts_and_shared_expert_greedy_equal_transformers():
    """Qwen2-MoE with `quantization="fp8"`: experts and its gated shared expert quantized;
    the tiled grouped GEMM gives transformers' tokens on the dequantized weights, and
    ragged_dot (the GPU default) agrees with it on the quantized weights. (The engine runs
    quantized experts, split over two devices, in test_engine_families.)"""
    src = tiny_model_dir("Qwen2MoeForCausalLM")
    model = load_model(resolve_model(src), dtype=jnp.float32, quantization="fp8")
    layers = model.params["layers"]
    assert all(_is_quantized(layers[k]) and layers[k].dtype == jnp.float8_e4m3fn
               for k in EXPERTS + ("ws_gate", "ws_up", "ws_down"))
    assert not _is_quantized(layers["ws_router"])
    ref = dequantized_dir(model.cfg, model.params)
    ids = PROMPTS[1]
    assert dense_greedy(model.cfg, model.params, ids, 12) == hf_greedy(ref, ids, 12)
    h = jax.random.normal(jax.random.key(0), (16, model.cfg.hidden_size), jnp.float32)
    experts = {k: layers[k] for k in EXPERTS}
    lp = {k: jax.tree.map(lambda x: x[0], v) for k, v in layers.items() if k not in EXPERTS}
    cfg = model.cfg

    def mlp(impl):
        out, _ = jax.jit(functools.partial(
            moe_mlp, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            renormalize=cfg.norm_topk_prob, act=cfg.hidden_act, impl=impl))(
                h, lp, experts, jnp.int32(0), valid=jnp.ones(16, bool))
        return np.asarray(out)

    np.testing.assert_allclose(mlp("ragged_dot"), mlp("tiled"), atol=2e-5)


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
    """A compressed-tensors FP8 checkpoint of a mixture of experts (one FP8 tensor and
    scale per layer and expert, as Qwen3-30B-A3B-FP8 and Qwen2-MoE FP8 checkpoints store
    them; the shared expert too) loads with its experts stacked and still quantized; greedy
    tokens equal transformers on the dequantized weights."""
    qdir, fdir = quantized_checkpoint("channel", "fp8", src=tiny_model_dir("Qwen2MoeForCausalLM"))
    model = load_model(resolve_model(qdir), dtype=jnp.float32)
    for key in EXPERTS + ("ws_gate", "ws_up", "ws_down"):
        assert _is_quantized(model.params["layers"][key]), key
    w = model.params["layers"]["we_down"]
    assert w.dtype == jnp.float8_e4m3fn
    assert w.scale.shape == (2, 4, 1, model.cfg.hidden_size)
    assert dense_greedy(model.cfg, model.params, PROMPTS[1], 12) == hf_greedy(fdir, PROMPTS[1], 12)


def test_block_scaled_experts_are_dequantized_before_a_split():
    """Under expert / tensor parallelism a quantized expert weight enters the shard_map
    quantized when its scales split with its values (per channel, per tensor) or when only
    experts are split; block scales, whose blocks a split of the width would cut, are
    dequantized first."""
    from arcjax.model.moe import _shardable

    values = jnp.ones((1, 2, 8, 4), jnp.int8)
    channel = QuantizedWeight(values, jnp.full((1, 2, 1, 4), 0.5), (8, 1))
    tensor = QuantizedWeight(values, jnp.full((1, 2, 1, 1), 0.5), (8, 4))
    block = QuantizedWeight(values, jnp.full((1, 2, 2, 2), 0.5), (4, 2))
    assert _shardable(channel, jnp.float32, True) is channel
    assert _shardable(tensor, jnp.float32, True) is tensor
    assert _shardable(block, jnp.float32, False) is block  # split by expert only
    dense = _shardable(block, jnp.float32, True)
    assert not _is_quantized(dense)
    np.testing.assert_array_equal(np.asarray(dense), np.full((1, 2, 8, 4), 0.5, np.float32))
