"""FP8 KV-cache scales calibrated at build time (arcjax/model/kv_scales.py) against 1.0.

The model is the tiny Llama with its keys made 1024 times larger and its values 64 times
smaller (q_proj / 1024, k_proj * 1024, v_proj / 64, o_proj * 64): in float it computes the
same function, but at scale 1.0 e4m3 saturates the largest keys (past 448) and keeps the
values below its smallest normal (2**-6) with a few bits only, the two failures per-layer
scales exist for. Calibrated scales (powers of two) bring the FP8 cache's prompt
log-probabilities close to the float cache's, and much closer than 1.0 does."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from arcjax import LLM, SamplingParams
from arcjax.errors import EngineConfigError
from support.hf_models import tiny_model_dir
from support.scratch import scratch_dir

KEYS, VALUES = 1024.0, 1 / 64  # what the keys and the values are multiplied by
ENGINE = dict(max_model_len=128, max_num_seqs=4, num_kv_blocks=64, async_scheduling=False,
              block_size=8, attention_impl="auto")
SCORED = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)


def _rescaled_llama() -> str:
    src = tiny_model_dir("LlamaForCausalLM")
    out = scratch_dir("arcjax-kv-rescaled-")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), out)
    factors = {"q_proj": 1 / KEYS, "k_proj": KEYS, "v_proj": VALUES, "o_proj": 1 / VALUES}
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(src, name))
            for key, w in tensors.items():
                f = next((v for k, v in factors.items() if f".{k}." in key), 1.0)
                tensors[key] = (w * np.float32(f)).astype(w.dtype)
            save_file(tensors, os.path.join(out, name))
    with open(os.path.join(out, "config.json")) as f:
        assert not json.load(f).get("attention_bias")  # (biases would need scaling too)
    return out


def _logprobs(llm, prompts) -> np.ndarray:
    out = []
    for o, ids in zip(llm.generate(prompts, SCORED, use_tqdm=False), prompts):
        out += [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], ids[1:])]
    return np.asarray(out)


def test_calibrated_scales_beat_unit_scales():
    path = _rescaled_llama()
    rs = np.random.RandomState(3)
    prompts = [rs.randint(3, 384, n).tolist() for n in (48, 33)]
    ref = _logprobs(LLM(path, **ENGINE), prompts)
    calibrated = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    scales = np.asarray(calibrated.engine.runner.cache["k_scale"]), np.asarray(
        calibrated.engine.runner.cache["v_scale"])
    for s in scales:  # powers of two, keys' above 1 and values' below
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)
    assert (scales[0] > 1).all() and (scales[1] < 1).all()
    err_calibrated = np.abs(_logprobs(calibrated, prompts) - ref)
    unit = LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=False, **ENGINE)
    assert (np.asarray(unit.engine.runner.cache["k_scale"]) == 1).all()
    err_unit = np.abs(_logprobs(unit, prompts) - ref)
    assert err_calibrated.mean() < 0.25 * err_unit.mean(), (err_calibrated.mean(),
                                                            err_unit.mean())
    assert err_calibrated.max() < 0.5 * err_unit.max()


def test_calculate_kv_scales_must_be_a_bool():
    with pytest.raises(EngineConfigError) as err:
        LLM(tiny_model_dir("LlamaForCausalLM"), kv_cache_dtype="fp8", calculate_kv_scales=1)
    assert err.value.field == "calculate_kv_scales"
