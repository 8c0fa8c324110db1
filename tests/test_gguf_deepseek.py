"""DeepSeek-V2/V3 GGUF files (`deepseek2`, as llama.cpp's converter writes them: MLA as MQA
with `kv_b_proj` split into `attn_k_b` / `attn_v_b`, or the older `attn_kv_b` layout) written
from the tiny transformers models: the config and every weight equal the source model's, and
greedy tokens equal transformers run on it (V2: group-limited softmax routing, no query
bottleneck; V3: a dense layer, the query bottleneck, noaux_tc, YaRN); a Q8_0 file through
the engine (weights kept packed in both layer stacks) equals the dense forward of its
dequantized weights; a missing key or an unknown gating function is a typed error.

transformers 5 builds no model from a deepseek2 GGUF file, so the reference is the source
model itself. GGUF keeps one YaRN mscale (`yarn_log_multiplier` = 0.1 * mscale_all_dim;
llama.cpp's cos/sin carry no attention factor), so the V3 source has mscale equal to
mscale_all_dim (the published checkpoints do).
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

import arcjax
from arcjax.errors import ModelConfigError
from arcjax.model.formats.gguf_config import gguf_config
from arcjax.model.formats.gguf_file import GGUFFile, load_gguf
from arcjax.model.formats.hf_checkpoint import load_hf
from arcjax.model.formats.hf_layout import read_config
from arcjax.model.packed import PackedWeight
from support.checkpoint_cases import PROMPTS, dense_greedy
from support.deepseek_gguf_files import write_deepseek_gguf
from support.hf_models import DEEPSEEK_V2, DEEPSEEK_V3, hf_greedy, tiny_model_dir
from support.scratch import scratch_dir


def _source(arch: str) -> str:
    """The tiny model; V3's with mscale = mscale_all_dim (what GGUF can say)."""
    src = tiny_model_dir(arch)
    if arch != DEEPSEEK_V3:
        return src
    out = scratch_dir("arcjax-gguf-deepseek-src-")
    shutil.copytree(src, out, dirs_exist_ok=True)
    with open(f"{out}/config.json") as f:
        cfg = json.load(f)
    cfg["rope_parameters"]["mscale"] = cfg["rope_parameters"]["mscale_all_dim"]
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg, f)
    return out


def _leaves(params) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize("arch,split", [(DEEPSEEK_V2, True), (DEEPSEEK_V3, True),
                                        (DEEPSEEK_V3, False)])
def test_deepseek_gguf_equals_the_source_and_transformers(arch, split):
    src = _source(arch)
    path = write_deepseek_gguf(src, "F32", split_kv_b=split)
    f = GGUFFile(path)
    assert ("blk.0.attn_k_b.weight" in f.tensors) == split
    assert ("blk.0.attn_kv_b.weight" in f.tensors) == (not split)
    cfg, params = load_gguf(path)
    assert cfg == read_config(src)
    assert cfg.architecture == arch and cfg.num_dense_layers == (arch == DEEPSEEK_V3)
    got = _leaves(params)
    ref = _leaves(load_hf(src)[1])
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    for ids in PROMPTS:
        assert dense_greedy(cfg, params, ids, 8) == hf_greedy(src, ids, 8)


def test_quantized_deepseek_gguf_through_the_engine():
    """Q8_0: the routed experts and the query bottleneck stay packed in the expert layers
    and in the dense layer; the engine's greedy tokens equal the dense forward of the same
    file dequantized."""
    path = write_deepseek_gguf(_source(DEEPSEEK_V3), "Q8_0")
    cfg, dequantized = load_gguf(path)
    llm = arcjax.LLM(path, max_model_len=64, max_num_seqs=2, num_kv_blocks=16, block_size=8,
                     async_scheduling=False)
    params = llm.engine.runner.params
    assert isinstance(params["layers"]["we_gate"], PackedWeight)
    assert isinstance(params["dense_layers"]["wq_a"], PackedWeight)
    assert isinstance(params["layers"]["wq_a"], PackedWeight)
    greedy = arcjax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(list(PROMPTS), greedy, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == dense_greedy(cfg, dequantized, ids, 8)


def test_missing_key_and_unknown_gating_are_typed_errors(tmp_path):
    src = tiny_model_dir(DEEPSEEK_V2)
    for key in ("attention.kv_lora_rank", "rope.dimension_count", "expert_count"):
        path = write_deepseek_gguf(src, "F32", str(tmp_path / "m.gguf"), drop=(key,))
        with pytest.raises(ModelConfigError, match=f"deepseek2.{key} is missing"):
            gguf_config(GGUFFile(path))
    path = write_deepseek_gguf(src, "F32", str(tmp_path / "g.gguf"),
                               drop=("expert_gating_func",))
    assert gguf_config(GGUFFile(path)).architecture == DEEPSEEK_V2  # llama.cpp's default
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "deepseek2")
    w.add_uint32("deepseek2.expert_gating_func", 3)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelConfigError, match="expert_gating_func 3 is not supported"):
        gguf_config(GGUFFile(tmp_path / "bad.gguf"))
