"""MXFP4 as gpt-oss checkpoints store it: decoding bit-exact with transformers'
`convert_moe_packed_tensors` (at load and in the step), encoding round trips, the experts
kept packed on the device through the grouped GEMMs and the engine (against transformers
and the decode-at-load engine), and the typed refusals."""

import numpy as np
import pytest

from arcjax.errors import WeightsError
from arcjax.model.formats import mxfp4

torch = pytest.importorskip("torch")


def test_decode_is_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 10, 4, 16), dtype=np.uint8)  # [E, out, G, 16]
    scales = rng.integers(110, 140, size=(3, 10, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()  # [E, in, out]
    got = mxfp4.decode(blocks, scales)  # [E, out, in]
    np.testing.assert_array_equal(got.transpose(0, 2, 1), want)


def test_encode_round_trips_what_the_format_holds():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(5, 3, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(5, 3), dtype=np.uint8)
    values = mxfp4.decode(blocks, scales)
    b2, s2 = mxfp4.encode(values)
    np.testing.assert_array_equal(mxfp4.decode(b2, s2), values)
    # a transposed (strided) weight still encodes to C-order arrays, what files are written from
    b3, s3 = mxfp4.encode(np.swapaxes(values.reshape(5, 3, 32), 0, 1))
    assert b3.flags["C_CONTIGUOUS"] and s3.flags["C_CONTIGUOUS"]
    # an arbitrary weight: every value within half an FP4 step of its block's scale
    w = rng.normal(size=(4, 64)).astype(np.float32)
    b, s = mxfp4.encode(w)
    step = np.ldexp(1.0, mxfp4.exponents(s))  # [4, 2] the spacing at the top is 2 * scale
    err = np.abs(mxfp4.decode(b, s) - w).reshape(4, 2, 32)
    assert np.all(err <= step[..., None] + 1e-7) and np.any(err > 0)


def test_codes_unpack_low_nibble_first_and_split_interleaves():
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0] = 0x4A  # inputs 0 (0xA) and 1 (0x4)
    assert mxfp4.codes(blocks)[:2].tolist() == [0xA, 0x4]
    gate, up = mxfp4.split_gate_up(np.arange(12).reshape(2, 6), axis=1)
    assert gate.tolist() == [[0, 2, 4], [6, 8, 10]] and up[0].tolist() == [1, 3, 5]


@pytest.mark.parametrize("blocks, scales, match", [
    (np.zeros((2, 16), np.int8), np.zeros((2,), np.uint8), "uint8"),
    (np.zeros((2, 8), np.uint8), np.zeros((2,), np.uint8), "do not match"),
    (np.zeros((2, 16), np.uint8), np.full((2,), 255, np.uint8), "NaN"),
])
def test_bad_blocks_are_refused(blocks, scales, match):
    with pytest.raises(WeightsError, match=match):
        mxfp4.decode(blocks, scales)


def _gpt_oss_experts():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=3,
                                    num_experts_per_tok=2, num_hidden_layers=1)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p))
    return {f"model.layers.0.mlp.experts.{k}": v.detach().numpy()
            for k, v in experts.state_dict().items()}


def _names(key, e):
    from arcjax.model.formats.hf_layout import GPT_OSS_LAYER_NAMES

    return GPT_OSS_LAYER_NAMES[key][0].format(i=0, e=e)


def test_fused_reader_splits_each_expert_out_of_the_float_tensors():
    from arcjax.model.formats.fused_experts import reader

    tensors = _gpt_oss_experts()
    read = reader(tensors.get)
    prefix = "model.layers.0.mlp.experts."
    gate_up, bias = tensors[prefix + "gate_up_proj"], tensors[prefix + "gate_up_proj_bias"]
    for e in range(3):
        np.testing.assert_array_equal(read(_names("we_gate", e)), gate_up[e][:, 0::2])
        np.testing.assert_array_equal(read(_names("we_up", e)), gate_up[e][:, 1::2])
        np.testing.assert_array_equal(read(_names("be_up", e)), bias[e][1::2])
        np.testing.assert_array_equal(read(_names("we_down", e)),
                                      tensors[prefix + "down_proj"][e])
        np.testing.assert_array_equal(read(_names("be_down", e)),
                                      tensors[prefix + "down_proj_bias"][e])
    assert read("model.layers.1.mlp.experts.down_proj@0") is None  # absent: None, not raised


def test_fused_reader_decodes_the_published_mxfp4_layout_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from arcjax.model.formats.fused_experts import reader

    tensors = _gpt_oss_experts()
    prefix = "model.layers.0.mlp.experts."
    for name in mxfp4.EXPERT_TENSORS:  # [E, in, out] -> the published [E, out, in / 32, 16]
        blocks, scales = mxfp4.encode(np.swapaxes(tensors.pop(prefix + name), 1, 2))
        tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"] = blocks, scales
    read = reader(tensors.get)
    want = {name: convert_moe_packed_tensors(
        torch.from_numpy(tensors[prefix + name + "_blocks"]),
        torch.from_numpy(tensors[prefix + name + "_scales"]), dtype=torch.float32).numpy()
        for name in mxfp4.EXPERT_TENSORS}  # [E, in, out]
    for e in range(3):
        np.testing.assert_array_equal(read(_names("we_gate", e)), want["gate_up_proj"][e][:, 0::2])
        np.testing.assert_array_equal(read(_names("we_up", e)), want["gate_up_proj"][e][:, 1::2])
        np.testing.assert_array_equal(read(_names("we_down", e)), want["down_proj"][e])


ENGINE = dict(block_size=8, num_kv_blocks=32, max_model_len=128, max_num_seqs=2,
              attention_impl="auto", chunk_tile=32, max_num_batched_tokens=32)
K = 2  # prompt logprobs per position


def test_device_decode_equals_the_load_decode_bit_for_bit():
    """`Mxfp4Weight.dequantize` (jax, in the step) equals `mxfp4.decode` (numpy, at load)
    and `ldexp` of the FP4 table for every code and scale byte (subnormal and infinite
    products too); shapes, one (layer, expert) read through `dense_at`, the specs' axes."""
    import jax.numpy as jnp

    from arcjax.model.mxfp4_weight import FP4_VALUES, Mxfp4Weight
    from arcjax.model.quant import dense, dense_at, weight_axes

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(2, 3, 40, 4, 16), dtype=np.uint8)  # [L, E, out, G, 16]
    scales = rng.integers(0, 255, size=(2, 3, 40, 4), dtype=np.uint8)  # 0xFF is NaN
    scales[0, 0, :, 0] = np.arange(40)  # the bytes whose products are subnormal
    w = Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales))
    assert w.shape == (2, 3, 128, 40) and w.dtype == "mxfp4"
    lut = np.asarray(FP4_VALUES, np.float32)
    with np.errstate(over="ignore"):
        want = np.ldexp(lut[mxfp4.codes(blocks)].reshape(2, 3, 40, 4, 32),
                        mxfp4.exponents(scales)[..., None]).reshape(2, 3, 40, 128)
    np.testing.assert_array_equal(mxfp4.decode(blocks, scales), want)
    want = np.swapaxes(want, -1, -2)  # [L, E, in, out] float32
    got = np.asarray(dense(w, jnp.float32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isinf(want).any() and (np.abs(want[want != 0]) < 2.0 ** -126).any()
    one = np.asarray(dense_at(w, (1, 2), jnp.bfloat16)).astype(np.float32)
    np.testing.assert_array_equal(one, want[1, 2].astype(jnp.bfloat16).astype(np.float32))
    axes = ("layers", "expert", "moe_mlp", "embed")  # we_down's [L, E, I, H]
    assert weight_axes(w, axes, lambda a: 2) == Mxfp4Weight(
        ("layers", "expert", "embed", "moe_mlp", None), ("layers", "expert", "embed", "moe_mlp"))
    assert weight_axes(w, axes, lambda a: 3).scales == ("layers", "expert", "embed", None)
    assert w.splits_rows(4) and not w.splits_rows(3)


def test_grouped_gemms_dequantize_packed_experts_as_the_decoded_ones():
    """moe_mlp over MXFP4 experts through every grouped GEMM equals moe_mlp over the same
    experts decoded to float32 (gpt-oss's biased experts and clamped SwiGLU)."""
    import jax
    import jax.numpy as jnp

    from arcjax.model.expert_ffn import ExpertAct
    from arcjax.model.moe import moe_mlp
    from arcjax.model.mxfp4_weight import Mxfp4Weight
    from arcjax.model.quant import dense

    rng = np.random.default_rng(3)
    L, E, H, I = 2, 4, 64, 32
    packed = {}
    for name, (n_in, n_out) in (("we_gate", (H, I)), ("we_up", (H, I)), ("we_down", (I, H))):
        b, s = mxfp4.encode(rng.normal(size=(L, E, n_out, n_in)) * 0.1)
        packed[name] = Mxfp4Weight(jnp.asarray(b), jnp.asarray(s))
    biases = {"be_gate": (L, E, I), "be_up": (L, E, I), "be_down": (L, E, H)}
    biases = {k: jnp.asarray(rng.normal(size=v) * 0.1, jnp.float32) for k, v in biases.items()}
    decoded = {k: dense(w, jnp.float32) for k, w in packed.items()}
    h = jnp.asarray(rng.normal(size=(12, H)), jnp.float32)
    lp = {"router": jnp.asarray(rng.normal(size=(H, E)), jnp.float32)}
    valid = jnp.arange(12) < 11
    for impl in ("tiled", "ragged_dot", "dense"):
        run = jax.jit(lambda experts: moe_mlp(
            h, lp, experts, jnp.int32(1), num_experts=E, top_k=2, renormalize=True,
            act=ExpertAct("swiglu_oai", limit=1.5), valid=valid, impl=impl)[0])
        want, got = run({**decoded, **biases}), run({**packed, **biases})
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6,
                                   err_msg=impl)
        assert float(jnp.max(jnp.abs(want))) > 0.1


def test_mxfp4_gpt_oss_stays_packed_and_equals_transformers_and_the_decoded_engine():
    """A random gpt-oss written in the published MXFP4 layout loads with its experts MXFP4
    on the device (uint8 blocks and scales, 4.25 bits per weight), and gives transformers'
    greedy tokens and prompt logprobs on the decoded twin, for a prompt past the sliding
    window, and again from the prefix cache; `quantization="dequantize"` decodes at load
    (the experts in the compute dtype, equal to the step's decoding) and gives the same
    tokens and logprobs; the trace summary names the experts' storage; another
    quantization is refused."""
    import jax.numpy as jnp

    from arcjax import LLM, SamplingParams
    from arcjax.errors import EngineConfigError
    from arcjax.model.mxfp4_weight import Mxfp4Weight
    from arcjax.model.quant import dense
    from support.hf_models import WINDOW, hf_greedy, hf_logits
    from support.quantized_models import mxfp4_twins

    packed, decoded = mxfp4_twins()
    prompt = np.random.RandomState(5).randint(3, 384, 2 * WINDOW + 3).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=K)
    llm = LLM(packed, **ENGINE)
    experts = {k: llm.engine.runner.params["layers"][k] for k in ("we_gate", "we_up", "we_down")}
    stored = values = 0
    for w in experts.values():
        assert isinstance(w, Mxfp4Weight)
        assert w.blocks.dtype == w.scales.dtype == jnp.uint8
        stored += w.blocks.nbytes + w.scales.nbytes
        values += int(np.prod(w.shape))
    assert 8 * stored / values == 4.25
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert list(out.token_ids) == hf_greedy(decoded, prompt, 8)
    logits = hf_logits(decoded, prompt)
    ref = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                 keepdims=True)) - logits.max(-1, keepdims=True)
    assert max(abs(out.prompt_logprobs[p][prompt[p]].logprob - ref[p - 1, prompt[p]])
               for p in range(1, len(prompt))) < 1e-4
    assert llm.trace_summary(1.0)["expert_weight_dtype"] == "mxfp4"
    cached = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert cached.token_ids == out.token_ids and cached.num_cached_tokens > 0  # prefix cache

    dq = LLM(packed, quantization="dequantize", **ENGINE)
    layers = dq.engine.runner.params["layers"]
    for k, w in experts.items():  # decoded at load == decoded in the step, bit for bit
        np.testing.assert_array_equal(np.asarray(layers[k]), np.asarray(dense(w, jnp.float32)))
    again = dq.generate([prompt], params, use_tqdm=False)[0]
    assert again.token_ids == out.token_ids
    for p in range(1, len(prompt)):  # the same weights; XLA fuses the two steps apart
        for t, lp in out.prompt_logprobs[p].items():
            assert abs(again.prompt_logprobs[p][t].logprob - lp.logprob) < 1e-5, (p, t)
    assert dq.trace_summary(1.0)["expert_weight_dtype"] == "float32"
    with pytest.raises(EngineConfigError) as e:
        LLM(packed, quantization="int8", block_size=8, num_kv_blocks=32, max_model_len=128)
    assert e.value.field == "quantization"


@pytest.mark.parametrize("edit, match", [
    ("drop", "missing"),  # layer 0 is MXFP4, layer 1's blocks are not there
    ("truncate", "do not match"),  # layer 1's scales lose a block
    ("nan", "NaN"),
])
def test_a_broken_mxfp4_layer_is_a_weights_error(edit, match):
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    from arcjax.model.formats.hf_checkpoint import hf_host
    from support.quantized_models import mxfp4_twins
    from support.scratch import scratch_dir

    packed, _ = mxfp4_twins()
    tensors = load_file(os.path.join(packed, "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    if edit == "drop":
        del tensors[name + "_blocks"]
    elif edit == "truncate":
        tensors[name + "_scales"] = np.ascontiguousarray(tensors[name + "_scales"][..., :-1])
    else:
        tensors[name + "_scales"][0, 0, 0] = 0xFF
    path = scratch_dir("arcjax-gpt-oss-broken-")
    shutil.copy(os.path.join(packed, "config.json"), path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightsError, match=match) as e:
        hf_host(path, "float32", mxfp4_packed=True)
    assert name in str(e.value)
