"""gpt-oss and DeepSeek-V2/V3 config.json files as transformers' own config classes write
them: every field arcjax reads, YaRN's frequencies and attention factor against
transformers' `ROPE_INIT_FUNCTIONS`, the softmax scale against the attention modules',
the write-back round trip, and the typed refusals naming the field.
"""

import json

import numpy as np
import pytest

from arcjax.errors import ModelConfigError
from arcjax.model.formats.hf_layout import read_config
from arcjax.model.kv_report import kv_cache_report
from arcjax.model.model_config import ModelConfig, rope_attention_factor, rope_inv_freq

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0}


def _gpt_oss(**extra):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=16, head_dim=8,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=512,
              rope_scaling={**YARN, "truncate": False, "rope_theta": 150000.0})
    return transformers.GptOssConfig(**(kw | extra))


def _deepseek(version, **extra):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
              first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=512)
    return getattr(transformers, f"Deepseek{version}Config")(**(kw | extra))


def _cfg(hf_cfg, arch):
    return ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": [arch]})


def _yarn_reference(hf_cfg):
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, None)
    return inv.numpy().astype(np.float64), float(attention)


def test_gpt_oss_config():
    hf = _gpt_oss()
    cfg = _cfg(hf, "GptOssForCausalLM")
    assert cfg.attention_sinks and cfg.expert_bias and cfg.is_moe and not cfg.is_mla
    assert cfg.qkv_bias and cfg.o_bias  # attention_bias: q, k, v and o
    assert cfg.sliding_layers == (True, False, True, False) and cfg.sliding_window == 8
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 16)
    assert cfg.router.scoring == "topk_softmax" and cfg.router.bias and not cfg.norm_topk_prob
    assert cfg.expert_act == "swiglu_oai"
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (hf.swiglu_alpha, hf.swiglu_limit)
    inv, attention = _yarn_reference(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), inv, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(attention, rel=1e-12)
    assert cfg.sm_scale == pytest.approx(8 ** -0.5)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_gpt_oss_default_theta_and_layer_types():
    d = {**_gpt_oss().to_dict(), "architectures": ["GptOssForCausalLM"]}
    d.pop("rope_parameters")
    d["layer_types"] = ["full_attention", "sliding_attention"] * 2
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling is None
    assert cfg.sliding_layers == (False, True, False, True)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_deepseek_v2_config(q_lora_rank):
    rope = {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7}
    hf = _deepseek("V2", q_lora_rank=q_lora_rank, topk_method="group_limited_greedy",
                   n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_scaling=rope)
    cfg = _cfg(hf, "DeepseekV2ForCausalLM")
    mla = cfg.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (q_lora_rank, 16, 8, 4, 6)
    assert cfg.head_dim == 12 and cfg.rope_dim == 4 and cfg.num_kv_heads == 4
    assert cfg.moe_layers == (False, True, True) and cfg.mixed_layers
    assert cfg.shared_expert_intermediate_size == 32 and not cfg.shared_expert_gate
    r = cfg.router
    assert (r.scoring, r.n_group, r.topk_group, r.group_score, r.correction_bias) == (
        "softmax", 4, 2, "max", False)
    assert r.routed_scaling_factor == 1.5 and not cfg.norm_topk_prob
    attn = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention(hf, 0)
    assert cfg.sm_scale == pytest.approx(attn.scaling, rel=1e-12)
    inv, attention = _yarn_reference(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), inv, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(attention, rel=1e-12)
    assert attention != pytest.approx(1.0)  # mscale and mscale_all_dim differ: a real factor
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # the cache holds one latent and rope key per token and layer, not per-head K and V
    assert cfg.kv_values_per_token() == 16 + 4
    assert cfg.per_head_kv_values() == 4 * (12 + 6)
    assert kv_cache_report(cfg, "bfloat16") == {
        "kv_layout": "mla_latent", "kv_bytes_per_token": 3 * 20 * 2,
        "per_head_kv_bytes_per_token": 3 * 4 * 18 * 2}


def test_deepseek_v3_config():
    hf = _deepseek("V3", q_lora_rank=24, n_group=4, topk_group=2, rope_scaling=YARN)
    cfg = _cfg(hf, "DeepseekV3ForCausalLM")
    r = cfg.router
    assert (r.scoring, r.correction_bias, r.group_score, r.renormalize_eps) == (
        "sigmoid", True, "top2_sum", 1e-20)
    assert cfg.norm_topk_prob and r.routed_scaling_factor == hf.routed_scaling_factor
    attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf, 0)
    assert cfg.sm_scale == pytest.approx(attn.scaling, rel=1e-12)
    inv, attention = _yarn_reference(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), inv, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(attention, rel=1e-12)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("version, change, field", [
    ("V2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("V2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("V3", {"scoring_func": "softmax"}, "scoring_func"),
    ("V2", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("V2", {"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ("V2", {"qk_rope_head_dim": 3}, "qk_rope_head_dim"),
    ("V2", {"kv_lora_rank": 0}, "kv_lora_rank"),
    ("V2", {"q_lora_rank": 0}, "q_lora_rank"),
    ("V2", {"attention_bias": True}, "attention_bias"),
    ("V2", {"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ("V3", {"n_group": 3}, "n_group"),
])
def test_deepseek_refusals_name_the_field(version, change, field):
    d = {**_deepseek(version).to_dict(), "architectures": [f"Deepseek{version}ForCausalLM"],
         **change}
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("change, field", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"swiglu_limit": 0}, "swiglu_limit"),
    ({"rope_scaling": {**YARN, "factor": -1.0}}, "factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     "original_max_position_embeddings"),
])
def test_gpt_oss_refusals_name_the_field(change, field):
    d = {**_gpt_oss().to_dict(), "architectures": ["GptOssForCausalLM"]}
    d.pop("rope_parameters")
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf_dict(d | change)


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_loading_reads_deepseek_configs(tmp_path, arch):
    """The decoder runs DeepSeek (tests/test_engine_deepseek.py): its config.json loads."""
    hf = _deepseek(arch[8:10])
    (tmp_path / "config.json").write_text(json.dumps({**hf.to_dict(), "architectures": [arch]}))
    cfg = read_config(tmp_path)
    assert cfg.architecture == arch and cfg.is_mla and cfg.mixed_layers
