"""The flax.nnx layers: what they declare, how the params pytree binds to them, and that
`import arcjax` does not import flax."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.errors import WeightsError
from arcjax.model import binding, decoder, layers, moe
from arcjax.model.model_config import ModelConfig
from arcjax.model.quant import QuantizedWeight, quantize
from arcjax.model.specs import init_params, is_spec, param_specs

DENSE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, qk_norm=True)
MOE = ModelConfig(architecture="Qwen2MoeForCausalLM", vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, shared_expert_gate=True,
                  tie_word_embeddings=True)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_every_parameter_is_declared_once_by_its_module(cfg):
    declared = binding.declarations(cfg)
    specs = jax.tree.leaves_with_path(param_specs(cfg), is_leaf=is_spec)
    assert len(declared) == len(specs) == len({d.key for d in declared})
    for d in declared:
        assert len(d.axes) == len(d.shape)
        if d.key[0] == "layers":  # stacked by nnx.vmap: the layer axis first
            assert d.shape[0] == cfg.num_layers and d.axes[0] == "layers"
        else:
            assert "layers" not in d.axes
    by_key = {d.key: d for d in declared}
    assert by_key[("layers", "wq")].axes == ("layers", "embed", "heads")
    assert by_key[("embed",)].axes == ("vocab", "embed")
    assert ("lm_head",) in by_key or cfg.tie_word_embeddings
    # The expert stacks, and only they, are the variables the layer scan passes whole.
    experts = {d.key[-1] for d in declared if isinstance(d.variable, layers.ExpertWeight)}
    assert experts == (set(moe.EXPERT_WEIGHTS) if cfg.is_moe else set())


def _params(cfg: ModelConfig) -> dict:
    """Random params from numpy (jax's eager random ops compile per shape: slow here)."""
    rs = np.random.RandomState(0)
    return jax.tree.map(lambda s: jnp.asarray(0.02 * rs.standard_normal(s.shape), jnp.float32),
                        param_specs(cfg), is_leaf=is_spec)


def test_bind_refuses_params_that_do_not_match_the_modules():
    params = jax.eval_shape(lambda: init_params(DENSE, jax.random.key(0)))  # the tree suffices
    missing = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "bq"}}
    with pytest.raises(WeightsError, match=r"missing \[layers/bq\], unknown \[\]"):
        binding.bind(DENSE, missing)
    extra = {**params, "layers": {**params["layers"], "w_extra": params["layers"]["wq"]}}
    with pytest.raises(WeightsError, match=r"missing \[\], unknown \[layers/w_extra\]"):
        binding.bind(DENSE, extra)


def _same_arrays(a, b) -> bool:
    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(left) == len(right) > 0 and all(x is y for x, y in zip(left, right))


def test_bound_modules_hold_the_params_leaves_as_they_are():
    params = _params(MOE)
    for name in ("wq", "we_gate"):  # a quantized dense and a quantized expert weight
        params["layers"][name] = quantize(params["layers"][name], "int8")
    model = binding.bind(MOE, params)
    wq = layers.value(model.layers.attn.wq)
    # The same arrays, not copies (nnx may rebuild a pytree node such as QuantizedWeight).
    assert isinstance(wq, QuantizedWeight) and wq.block == params["layers"]["wq"].block
    assert _same_arrays(wq, params["layers"]["wq"])
    assert _same_arrays(layers.value(model.layers.mlp.we_gate), params["layers"]["we_gate"])
    assert layers.value(model.embed.embedding) is params["embed"]
    # The bound head is `lm_head`, which the tied model computes from the embedding.
    h = jax.random.normal(jax.random.key(2), (3, MOE.hidden_size))
    logits = decoder.lm_head(params, MOE, h)
    expected = layers.rms_norm(h, params["final_norm"], MOE.rms_norm_eps) @ params["embed"].T
    np.testing.assert_allclose(logits, expected.astype(jnp.float32), rtol=1e-6, atol=1e-6)


def test_import_arcjax_does_not_import_flax_or_optax():
    code = ("import sys, arcjax, arcjax.model.decoder, arcjax.model.specs\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'flax', 'optax'})\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    assert out.stdout.strip() == ""
