"""MXFP4 as gpt-oss checkpoints store it: decoding bit-exact with transformers'
`convert_moe_packed_tensors`, encoding round trips, and the typed refusals."""

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


def _mxfp4_twins() -> tuple[str, str]:
    """The tiny random gpt-oss with its experts in the published MXFP4 layout
    (`quant_method: "mxfp4"`, `*_blocks` / `*_scales`), and its float twin whose experts are
    the decoded values: what transformers runs as the reference."""
    import json
    import os
    import shutil

    from safetensors.numpy import load_file, save_file
    from support.hf_models import GPT_OSS, tiny_model_dir
    from support.scratch import scratch_dir

    src = tiny_model_dir(GPT_OSS)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, decoded = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.rsplit(".", 1)[-1] in mxfp4.EXPERT_TENSORS:  # [E, in, out] -> [E, out, in]
            blocks, scales = mxfp4.encode(np.swapaxes(w, 1, 2))
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            decoded[name] = np.ascontiguousarray(
                np.swapaxes(mxfp4.decode(blocks, scales), 1, 2).astype(w.dtype))
    dirs = []
    for kind, weights in (("mxfp4", packed), ("decoded", decoded)):
        path = scratch_dir(f"arcjax-gpt-oss-{kind}-")
        shutil.copy(os.path.join(src, "config.json"), path)
        save_file(weights, os.path.join(path, "model.safetensors"))
        dirs.append(path)
    with open(os.path.join(dirs[0], "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(os.path.join(dirs[0], "config.json"), "w") as f:
        json.dump(cfg, f)
    return dirs[0], dirs[1]


def test_mxfp4_gpt_oss_checkpoint_equals_transformers_on_the_decoded_weights():
    """A random gpt-oss written in the published MXFP4 layout loads (its experts decoded at
    load, equal to the decoded values) and gives transformers' greedy tokens on the decoded
    twin, for a prompt past the sliding window; another quantization is refused."""
    import os

    from safetensors.numpy import load_file

    from arcjax import LLM, SamplingParams
    from arcjax.errors import EngineConfigError
    from support.hf_models import WINDOW, hf_greedy

    packed, decoded = _mxfp4_twins()
    prompt = np.random.RandomState(5).randint(3, 384, 2 * WINDOW + 3).tolist()
    llm = LLM(packed, block_size=8, num_kv_blocks=32, max_model_len=128, max_num_seqs=2,
              attention_impl="xla", chunk_tile=32, max_num_batched_tokens=32)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.token_ids) == hf_greedy(decoded, prompt, 8)
    w = load_file(os.path.join(decoded, "model.safetensors"))
    gate_up = w["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    np.testing.assert_array_equal(np.asarray(llm.engine.runner.params["layers"]["we_up"][1]),
                                  gate_up[..., 1::2])
    with pytest.raises(EngineConfigError) as e:
        LLM(packed, quantization="int8", block_size=8, num_kv_blocks=32, max_model_len=128)
    assert e.value.field == "quantization"
