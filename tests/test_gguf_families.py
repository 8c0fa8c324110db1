"""GGUF files of the mixtures of experts (Mixtral as llama.cpp's `llama` with experts,
`qwen2moe`, `qwen3moe`) and of Gemma 2 / Gemma 3, written from tiny models as llama.cpp's
converter writes them.

References: transformers 5 cannot build these mixtures of experts from a GGUF file (its
`llama` loader ignores experts; its qwen2moe / qwen3moe loaders read no expert width and
fall back to the config class's default), so the MoE files are checked against
the source model itself: config and every weight identical for F32 files (so the forward
is the source's, whose greedy parity with transformers test_model_families checks; greedy
tokens equal transformers' on the source model for Mixtral, the permuted `llama` layout),
and the quantized file's weights within Q8_0's rounding of the source's.
Gemma files load in transformers (`gguf_file=`; the source models use transformers'
defaults where GGUF has no field), so they are checked against it for F16 and Q4_K.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.errors import ModelConfigError
from arcjax.model.formats.gguf_file import GGUFFile, load_gguf
from arcjax.model.formats.gguf_config import gguf_config
from arcjax.model.formats.hub import resolve_model
from arcjax.model.formats.loader import load_model
from arcjax.model.quant import QuantizedWeight
from arcjax.model.formats.hf_checkpoint import load_hf
from arcjax.model.formats.hf_layout import read_config
from support.gguf_files import tiny_gguf_model_dir, write_gguf
from support.hf_models import hf_greedy, tiny_model_dir
from support.checkpoint_cases import PROMPTS, dense_greedy
from support.checkpoint_cases import gguf_hf_greedy


def _leaves(params) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                  "Qwen3MoeForCausalLM"])
def test_moe_gguf_equals_the_source_model(arch):
    import gguf

    src = tiny_model_dir(arch)
    path = write_gguf(src, "F32")
    f = GGUFFile(path)
    assert f.tensors["blk.0.ffn_gate_exps.weight"].shape[2] == read_config(src).num_experts
    cfg, params = load_gguf(path)
    want = read_config(src)
    if arch == "MixtralForCausalLM":  # llama.cpp's `llama` has no window (as it runs Mixtral)
        want = dataclasses.replace(want, sliding_window=None, sliding_layers=())
    assert cfg == want
    exact = _leaves(params)
    for key, value in _leaves(load_hf(src)[1]).items():  # q/k unpermuted, experts split
        np.testing.assert_array_equal(exact[key], value, err_msg=key)
    if arch == "MixtralForCausalLM":  # (the others: the same config and params)
        ids = PROMPTS[1]  # 11 + 12 tokens: within the source Mixtral's window of 24
        assert dense_greedy(cfg, params, ids, 12) == hf_greedy(src, ids, 12)
    # Q8_0: every weight within its block's rounding: d / 2 plus up to 127 steps of d's f16
    # rounding (2**-11 relative), d = max|block| / 127
    qpath = write_gguf(src, "Q8_0")
    assert GGUFFile(qpath).tensors["blk.0.ffn_up_exps.weight"].ggml_type == (
        gguf.GGMLQuantizationType.Q8_0)
    _, qparams = load_gguf(qpath)
    for key, got in _leaves(qparams).items():
        ref = exact[key]
        bound = np.abs(ref).max() / 127 * (0.5 + 127 * 2.0**-11) * (1 + 1e-5) + 1e-7
        assert np.abs(got - ref).max() <= bound, key
        if key.endswith("['we_gate']") or key.endswith("['wq']"):
            assert np.abs(got - ref).max() > 0, key  # really quantized
    if arch == "MixtralForCausalLM":  # files from before llama.cpp merged the experts
        legacy = write_gguf(src, "F32", merge_experts=False)
        assert "blk.1.ffn_down.3.weight" in GGUFFile(legacy).tensors
        legacy_cfg, legacy_params = load_gguf(legacy)
        assert legacy_cfg == cfg
        for key, value in _leaves(legacy_params).items():
            np.testing.assert_array_equal(value, exact[key], err_msg=key)


def test_moe_gguf_quantized_at_load():
    """`quantization="int8"` on a GGUF mixture of experts: the experts dequantized from the
    file are requantized per expert and channel like a safetensors checkpoint's."""
    path = write_gguf(tiny_model_dir("Qwen3MoeForCausalLM"), "F16")
    model = load_model(resolve_model(path), dtype=jnp.float32, quantization="int8")
    assert model.gguf_file is not None
    for key in ("we_gate", "we_up", "we_down", "wq"):
        assert isinstance(model.params["layers"][key], QuantizedWeight), key
        assert model.params["layers"][key].dtype == jnp.int8


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_gguf_greedy_equals_transformers(arch):
    """An F16 file gives the source model's greedy tokens (norms stored as 1 + w, windows,
    soft-caps and Gemma 3's two rope bases read back); a quantized one (Gemma 2: Q4_K,
    Gemma 3: Q8_0) gives transformers' tokens loading the same file."""
    src = tiny_gguf_model_dir(arch)
    ids = PROMPTS[1]  # past the window of 8
    for qtype in ("F16", "Q4_K" if arch == "Gemma2ForCausalLM" else "Q8_0"):
        path = write_gguf(src, qtype)
        cfg, params = load_gguf(path)
        assert cfg == read_config(src), qtype
        got = dense_greedy(cfg, params, ids, 12)
        if qtype == "F16":  # the source model's tokens (transformers' loader gives them too)
            assert got == hf_greedy(src, ids, 12)
            _, ref = load_hf(src)  # norms: (1 + w) - 1 within f32 rounding of 1 + w
            np.testing.assert_allclose(np.asarray(params["layers"]["post_mlp_norm"]),
                                       np.asarray(ref["layers"]["post_mlp_norm"]), atol=1e-7)
        else:
            assert got == gguf_hf_greedy(path, ids, 12), qtype


def test_gemma_metadata_llama_cpp_defaults(tmp_path):
    """What GGUF leaves out, read as llama.cpp does: soft-caps 50 / 30 (Gemma 2), every
    6th layer global (Gemma 3), the 27B query scale (hidden / heads), an explicit
    `attention.sliding_window_pattern`; typed errors for inconsistent metadata."""
    import gguf

    def write(arch, layers, extra):
        w = gguf.GGUFWriter(str(tmp_path / f"{arch}{layers}.gguf"), arch)
        for name, value in dict(block_count=layers, embedding_length=64,
                                feed_forward_length=128, head_count=4, head_count_kv=2,
                                key_length=32, sliding_window=16, **extra).items():
            getattr(w, f"add_{name}")(value)
        w.add_tensor("token_embd.weight", np.zeros((100, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return gguf_config(GGUFFile(tmp_path / f"{arch}{layers}.gguf"))

    g2 = write("gemma2", 4, {})
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g2.sliding_layers == (True, False, True, False) and g2.query_pre_attn_scalar == 32
    g3 = write("gemma3", 7, {})
    assert g3.sliding_layers == (True,) * 5 + (False, True)
    assert (g3.rope_theta, g3.local_rope_theta, g3.attn_logit_softcap) == (1e6, 1e4, None)
    assert write("gemma2", 46, {}).query_pre_attn_scalar == 16  # 64 / 4, the 27B rule
    pattern = write("gemma3", 3, {"sliding_window_pattern": [True, False, False]})
    assert pattern.sliding_layers == (True, False, False)
    with pytest.raises(ModelConfigError, match="sliding_window_pattern has 2 entries"):
        write("gemma3", 3, {"sliding_window_pattern": [True, False]})
    with pytest.raises(ModelConfigError, match="qwen3moe.expert_count is missing"):
        write("qwen3moe", 2, {})
    with pytest.raises(ModelConfigError, match="'qwen2' with experts is not supported"):
        write("qwen2", 2, {"expert_count": 4})
