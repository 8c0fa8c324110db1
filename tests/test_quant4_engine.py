"""Packed checkpoints through the engine (issue 37): greedy tokens equal transformers on
the dequantized weights under every policy with chunked prefill, overlapped scheduling on
and off, prefix caching, n-gram speculative decoding, and (a subprocess with two forced CPU
devices) tensor parallelism 2 (act-order GPTQ: attention's and the experts' rows split,
their scales whole) and expert parallelism 2; one MoE layer under each split checks that
packed experts whose rows split with their groups stay packed, and that those a split would
cut from their groups are dequantized first, with one device's output either way."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from arcjax import LLM, SamplingParams
from arcjax.bench.packed_checkpoints import packed_checkpoint
from support.hf_models import hf_greedy, tiny_model_dir

HERE = pathlib.Path(__file__).resolve().parent
PROMPT_LENS = (3, 40, 17, 66)
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto", chunk_tile=16, max_num_batched_tokens=64)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# (model, packed_checkpoint options, tensor_parallel_size, expert_parallel_size)
PARALLEL_CASES = (("MixtralForCausalLM", dict(method="gptq", desc_act=True), 2, 1),
                  ("MixtralForCausalLM", dict(method="pack-quantized", group=16), 2, 2))
# one MoE layer: groups of 16 split with each expert's 48 rows a device holds; 32 cannot
SPLIT_GROUPS = (16, 32)
# Under the mesh every prompt prefills in one step, then the rows decode together: two
# executables per engine (each compile under shard_map is most of the subprocess's time;
# chunked prefill under every policy is the single-device tests' subject).
PARALLEL_GEOMETRY = {**GEOMETRY, "max_num_seqs": 4, "max_num_batched_tokens": 256}
SUBPROCESS_TIMEOUT_S = 600


def _prompts():
    rs = np.random.RandomState(5)
    shared = rs.randint(3, 384, 24).tolist()  # a common prefix: prefix caching hits it
    return [shared + rs.randint(3, 384, n).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def _expected(fdir: str):
    return [hf_greedy(fdir, p, MAX_TOKENS) for p in _prompts()]


def _tokens(llm) -> list[list[int]]:
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert llm.engine.blocks_in_use() == 0
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("policy", ["prefill_first", "alternate", "token_budget"])
def test_every_policy_overlapped_on_and_off_with_prefix_caching(policy):
    """AWQ weights (packed): chunked prefill under each policy, overlapped scheduling on
    and off; a second pass over the same prompts reads their cached prefix blocks."""
    qdir, fdir = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "awq")
    for overlapped in (False, True):
        llm = LLM(qdir, policy=policy, async_scheduling=overlapped, **GEOMETRY)
        assert llm.trace_summary(1.0)["weight_dtype"] == "awq"
        assert _tokens(llm) == _expected(fdir), (policy, overlapped)
        second = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [list(o.token_ids) for o in second] == _expected(fdir)
        assert all(o.num_cached_tokens > 0 for o in second)


def test_speculative_decoding_with_packed_weights():
    """n-gram drafts verified by a compressed-tensors W4A16 target: the same tokens."""
    qdir, fdir = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "pack-quantized",
                                   symmetric=True)
    llm = LLM(qdir, speculative_config=NGRAM, **GEOMETRY)
    assert _tokens(llm) == _expected(fdir)


def _specs(w) -> dict:
    return {"planes": [str(a) for a in w.planes[0].sharding.spec],
            "scale": [str(a) for a in w.scale.sharding.spec]}


def _run_parallel(cases: list, layer_dirs: list) -> dict:
    """In the 2-device subprocess: each engine case's tokens and shardings, and one MoE
    layer's output per split for each of `layer_dirs`."""
    import jax

    assert jax.device_count() == 2
    out = {}
    for qdir, tp, ep in cases:
        llm = LLM(qdir, tensor_parallel_size=tp, expert_parallel_size=ep, **PARALLEL_GEOMETRY)
        layers = llm.engine.runner.params["layers"]
        out[qdir] = {"tokens": _tokens(llm), "wo": _specs(layers["wo"]),
                     "we_down": _specs(layers["we_down"])}
    for qdir in layer_dirs:
        out[qdir] = _moe_layer_splits(qdir)
    return out


def _moe_layer_splits(qdir: str) -> dict:
    """Layer 1's experts (packed, in their shards) under tp=2 and ep=2 and on one device:
    the outputs, and whether we_down reached the experts' shard_map packed."""
    import jax
    import jax.numpy as jnp

    from arcjax.model.formats.hf_layout import read_config
    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import load_model
    from arcjax.model.moe import _shardable, moe_mlp
    from arcjax.model.packed import PackedWeight
    from arcjax.parallel import TensorParallel

    cfg = read_config(qdir)
    h = jax.random.normal(jax.random.key(0), (16, cfg.hidden_size), jnp.float32)
    out = {}
    for tp, ep in ((1, 1), (2, 1), (1, 2)):
        parallel = None if tp == ep == 1 else TensorParallel.create(cfg, tp, ep=ep)
        layers = load_model(resolve_model(qdir), dtype=jnp.float32,
                            parallel=parallel).params["layers"]
        experts = {k: layers[k] for k in ("we_gate", "we_up", "we_down")}
        mlp = jax.jit(functools.partial(
            moe_mlp, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            renormalize=cfg.norm_topk_prob, act=cfg.hidden_act, impl="tiled",
            parallel=parallel))
        y, _ = mlp(h, {"router": layers["router"][1]}, experts, jnp.int32(1),
                   valid=jnp.ones(16, bool))
        split = 1 if parallel is None else parallel.degree("moe_mlp")
        kept = _shardable(experts["we_down"], jnp.float32, split > 1, split)
        out[f"{tp}/{ep}"] = {"out": np.asarray(y).tolist(),
                             "packed": isinstance(kept, PackedWeight)}
    return out


def test_tensor_and_expert_parallel_2_equal_transformers():
    cases, want = [], {}
    for arch, options, tp, ep in PARALLEL_CASES:
        qdir, fdir = packed_checkpoint(tiny_model_dir(arch), **options)
        cases.append((qdir, tp, ep))
        want[qdir] = _expected(fdir)
    layer_dirs = [packed_checkpoint(tiny_model_dir("MixtralForCausalLM"), "pack-quantized",
                                    group=g)[0] for g in SPLIT_GROUPS]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, json.dumps([cases, layer_dirs])],
                          env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for qdir, tp, ep in cases:
        assert got[qdir]["tokens"] == want[qdir], (qdir, tp, ep)
    act_order = got[cases[0][0]]
    # act-order rows split over the tensor axis (attention's heads, the experts' width);
    # their scales stay whole: any row may read any group
    assert act_order["wo"] == {"planes": ["None", "tp", "None"],
                               "scale": ["None", "None", "None"]}
    assert act_order["we_down"]["planes"] == ["None", "None", "tp", "None"]
    assert act_order["we_down"]["scale"] == ["None", "None", "None", "None"]
    assert got[cases[1][0]]["we_down"]["planes"][:2] == ["None", "ep"]  # split by expert
    for qdir, group in zip(layer_dirs, SPLIT_GROUPS):
        layer = got[qdir]
        for key in ("2/1", "1/2"):
            np.testing.assert_allclose(layer[key]["out"], layer["1/1"]["out"], atol=1e-5,
                                       err_msg=f"group {group}, tp/ep {key}")
        assert layer["1/2"]["packed"]  # a split by expert keeps every matrix whole
        assert layer["2/1"]["packed"] == (group == 16)  # 48 rows: groups of 16, not of 32


if __name__ == "__main__":
    print(json.dumps(_run_parallel(*json.loads(sys.argv[1]))))
