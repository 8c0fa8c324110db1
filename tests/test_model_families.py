"""Mixtures of experts, Gemma and sliding windows below the engine: what each config.json
means, the expert grouping against a dense loop, that the test prompts really run past the
windows, the expert-parallel layout rules, and that a 256k vocabulary never gets [T, V]
logits. (Parity with transformers through the engine: tests/test_engine_families.py.)"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.errors import EngineConfigError, ModelConfigError
from arcjax.model import decoder, moe
from arcjax.model.model_config import GLOBAL_WINDOW, ModelConfig
from arcjax.model.specs import cache_specs, is_spec, param_specs
from arcjax.model.formats.hf_layout import read_config
from arcjax.parallel import TensorParallel, logical_rules
from support.device_caches import device_cache
from support.hf_models import NEW_ARCHS, WINDOW, hf_logits, tiny_model_dir


def _hf_config(arch):
    with open(f"{tiny_model_dir(arch)}/config.json") as f:
        return json.load(f)


# ---- config.json -------------------------------------------------------------------------------

def test_each_family_reads_its_fields_and_round_trips():
    cfgs = {arch: read_config(tiny_model_dir(arch)) for arch in NEW_ARCHS}
    mixtral, qwen2, qwen3, gemma2, gemma3 = (cfgs[a] for a in NEW_ARCHS)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob,
            mixtral.moe_intermediate_size) == (4, 2, True, 96)
    assert mixtral.all_sliding and mixtral.sliding_window == WINDOW
    assert (qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size, qwen2.qkv_bias) == (
        False, 80, True)
    assert qwen2.sliding_window is None  # use_sliding_window false: no window anywhere
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.num_experts == 8
    assert gemma2.layer_windows() == (WINDOW, GLOBAL_WINDOW) and not gemma2.all_sliding
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (5.0, 3.0)
    assert gemma2.hidden_act == "gelu_tanh" and gemma2.norm_unit_offset and gemma2.sandwich_norms
    assert gemma2.tie_word_embeddings and gemma2.scale_embeddings and gemma2.sm_scale == 24**-0.5
    assert gemma3.attn_logit_softcap is None and gemma3.qk_norm  # Gemma 3: QK-norm, no cap
    assert (gemma3.rope_theta, gemma3.rope_scaling) == (1e6, ("linear", 2.0))
    assert (gemma3.local_rope_theta, gemma3.local_rope_scaling) == (1e4, None)
    for cfg in cfgs.values():
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("arch, extra, sliding", [
    # Mistral-style: the window applies to every layer; no cap on the context any more.
    ("MixtralForCausalLM", {"sliding_window": 8}, (True, True, True)),
    # Qwen: only with use_sliding_window, from max_window_layers on.
    ("Qwen3MoeForCausalLM", {"sliding_window": 8, "use_sliding_window": False}, ()),
    ("Gemma2ForCausalLM", {"sliding_window": 8}, (True, False, True)),
    # Gemma 3 configs from before layer_types: every sliding_window_pattern-th layer global.
    ("Gemma3ForCausalLM", {"sliding_window": 8, "sliding_window_pattern": 3},
     (True, True, False)),
])
def test_layer_types_default_as_transformers_does(arch, extra, sliding):
    d = {**_hf_config(arch), "num_hidden_layers": 3, **extra}
    d.pop("layer_types", None)
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_layers == sliding
    assert cfg.max_position_embeddings == d["max_position_embeddings"]


def test_qwen2_windows_from_max_window_layers():
    d = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
         "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
         "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    assert ModelConfig.from_hf_dict(d).sliding_layers == (False, False, True, True)


def test_gemma3_legacy_rope_fields():
    d = {**_hf_config("Gemma3ForCausalLM"), "rope_theta": 5e5, "rope_local_base_freq": 2e4,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    del d["rope_parameters"]
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, ("linear", 8.0))
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (2e4, None)


@pytest.mark.parametrize("arch, change, match", [
    ("Qwen2MoeForCausalLM", {"mlp_only_layers": [0]}, "mixing dense and expert layers"),
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 2}, "mixing dense and expert layers"),
    ("MixtralForCausalLM", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("Gemma2ForCausalLM", {"layer_types": ["sliding_attention", "chunked_attention"]},
     "layer_types"),
    ("Gemma2ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation"),
    ("Gemma3ForCausalLM", {"architectures": ["Gemma3ForConditionalGeneration"]},
     "not supported"),
])
def test_unsupported_configs_name_the_field(arch, change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict({**_hf_config(arch), **change})


def test_test_prompts_run_past_the_windows():
    """The engine tests' 50-token prompts are longer than the tiny models' window: with the
    window removed, transformers' own logits change (so parity there really tests it)."""
    import torch
    import transformers

    ids = np.random.RandomState(3).randint(3, 384, 50).tolist()
    for arch in ("MixtralForCausalLM", "Gemma2ForCausalLM"):
        path = tiny_model_dir(arch)
        windowed = hf_logits(path, ids)
        cfg = transformers.AutoConfig.from_pretrained(path)
        cfg.sliding_window = 10_000
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=cfg,
                                                                  dtype="float32").eval()
        with torch.no_grad():
            full = model(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(full[:WINDOW] - windowed[:WINDOW]).max() < 1e-4
        assert np.abs(full[-1] - windowed[-1]).max() > 1e-2


# ---- experts -----------------------------------------------------------------------------------

@device_cache
def _experts(num_experts=6, hidden=16, width=24, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    lp = {"router": jax.random.normal(k[0], (hidden, num_experts)),
          "we_gate": 0.3 * jax.random.normal(k[1], (num_experts, hidden, width)),
          "we_up": 0.3 * jax.random.normal(k[2], (num_experts, hidden, width)),
          "we_down": 0.3 * jax.random.normal(k[3], (num_experts, width, hidden))}
    return lp


@pytest.mark.parametrize("tokens, top_k, renormalize", [(1, 2, True), (37, 3, False)])
def test_grouped_experts_equal_the_dense_loop(tokens, top_k, renormalize):
    """One sort, packed rows, grouped GEMMs (ragged_dot and the tiled loop), scattered back:
    equal to every expert run on every token, weighted; padding rows get nothing."""
    lp = _experts()
    stacked = {k: jnp.stack([jnp.zeros_like(lp[k]), lp[k]]) for k in moe.EXPERT_WEIGHTS}
    h = jax.random.normal(jax.random.key(tokens), (tokens, 16))
    valid = jnp.arange(tokens) < max(1, tokens - 5)  # the last rows are bucket padding
    outs = {}
    for impl in ("dense", "tiled", "ragged_dot"):  # layer 1 of 2 stacked layers
        mlp = jax.jit(functools.partial(moe.moe_mlp, num_experts=6, top_k=top_k,
                                        renormalize=renormalize, act="silu", impl=impl))
        out, counts = mlp(h, lp, stacked, jnp.int32(1), valid=valid)
        outs[impl] = np.asarray(out)
        _, experts = moe.route(h, lp["router"], top_k, renormalize)
        want = np.bincount(np.asarray(experts)[np.asarray(valid)].ravel(), minlength=6)
        np.testing.assert_array_equal(np.asarray(counts), want)
        assert int(counts.sum()) == top_k * int(valid.sum())
    for impl in ("tiled", "ragged_dot"):
        np.testing.assert_allclose(outs[impl], outs["dense"], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(outs["tiled"][~np.asarray(valid)], 0.0)


def test_router_renormalizes_per_the_flag():
    h = jax.random.normal(jax.random.key(1), (5, 16))
    router = _experts()["router"]
    w_norm, e_norm = moe.route(h, router, 2, True)
    w_raw, e_raw = moe.route(h, router, 2, False)
    np.testing.assert_allclose(np.asarray(w_norm.sum(-1)), 1.0, rtol=1e-6)
    probs = jax.nn.softmax(h @ router, axis=-1)
    np.testing.assert_allclose(np.asarray(w_raw), np.sort(np.asarray(probs))[:, ::-1][:, :2],
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(e_norm), np.asarray(e_raw))


def test_expert_parallel_rules():
    cfg = read_config(tiny_model_dir("MixtralForCausalLM"))  # 4 heads, 2 KV heads, 4 experts
    dense = read_config(tiny_model_dir("Gemma2ForCausalLM"))
    # experts inside the tensor-parallel group: heads over both mesh axes, experts over "ep",
    # each expert's width over what is left
    rules = dict(logical_rules(cfg, 4, 2))
    assert rules["heads"] == ("ep", "tp") and rules["expert"] == "ep"
    assert rules["moe_mlp"] == "tp"
    # more expert devices than tensor ones: attention replicated over "ep"
    rules = dict(logical_rules(cfg, 1, 2))
    assert rules["heads"] == "tp" and rules["expert"] == ("ep", "tp") and "moe_mlp" not in rules
    # tensor parallelism alone splits each expert by width
    assert dict(logical_rules(cfg, 2))["moe_mlp"] == "tp" and "expert" not in dict(
        logical_rules(cfg, 2))
    for tp, ep, field in ((1, 3, "expert_parallel_size"), (2, 3, "expert_parallel_size"),
                          (1, 8, "expert_parallel_size"), (3, 1, "tensor_parallel_size")):
        with pytest.raises(EngineConfigError) as e:
            logical_rules(cfg, tp, ep)
        assert e.value.field == field
    with pytest.raises(EngineConfigError, match="no experts"):
        logical_rules(dense, 1, 2)
    tp = TensorParallel(TensorParallel.create(cfg, 1).mesh, logical_rules(cfg, 2))
    specs = param_specs(cfg)
    sh = tp.shardings(specs)
    assert tuple(sh["layers"]["we_down"].spec) == (None, None, "tp", None)
    assert tuple(tp.shardings(cache_specs(cfg, 4, 8))["k"].spec) == (None, None, "tp", None)


# ---- a 256k vocabulary -------------------------------------------------------------------------

def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


def test_large_vocabulary_logits_only_at_the_rows_that_need_them():
    """Gemma's 256k vocabulary: an engine step computes [S, V] logits at the sampled rows,
    and a step with prompt log-probabilities [128, V] at a time, never [T, V]."""
    from arcjax.runtime import step_program
    from arcjax.runtime.batching import empty_batch
    from arcjax.runtime.buckets import Bucket
    from arcjax.runtime.step_output import PromptTargets
    from arcjax.runtime.penalties import TokenCounts, TokenTables
    from arcjax.runtime.sampling import SamplingBatch

    vocab, t = 262_144, 512
    cfg = dataclasses.replace(read_config(tiny_model_dir("Gemma2ForCausalLM")), vocab_size=vocab)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
                          param_specs(cfg), is_leaf=is_spec)
    cache = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
                         cache_specs(cfg, 80, 8), is_leaf=is_spec)
    bucket = Bucket(t, 8, t)
    batch = empty_batch(bucket, max_blocks=64, block_size=8, num_blocks=80)
    sampling = SamplingBatch.build([], 8)
    counts = TokenTables(jax.ShapeDtypeStruct((9, vocab), jnp.int32),
                         jax.ShapeDtypeStruct((9, vocab), jnp.float32))
    prompt = PromptTargets(np.zeros(8, np.int32), np.zeros(t, np.int32))
    every_row = dataclasses.replace(batch, logits_rows=np.arange(t, dtype=np.int32))
    for with_prompt in (None, prompt):  # a prompt-logprobs step reads every row (`prepare`)
        step = functools.partial(step_program.step, cfg=cfg, attn_impl="xla", dtype=jnp.float32,
                                 max_q_len=t)
        jaxpr = jax.make_jaxpr(step)(params, cache, every_row if with_prompt else batch,
                                     sampling, counts, None, with_prompt)
        shapes = {a.shape for a in _avals(jaxpr.jaxpr) if hasattr(a, "shape")}
        # rows of [rows, V] arrays, the tied embedding [H, V] and the count table aside
        widest = max(s[0] for s in shapes if len(s) == 2 and s[1] == vocab
                     and s[0] not in (cfg.hidden_size, 9))
        assert widest == (step_program.PROMPT_LOGPROB_ROWS if with_prompt else 8), shapes


def test_dense_forward_matches_transformers_past_the_window():
    """The full-sequence forward (training, checks) with windows, soft-caps and experts."""
    ids = np.random.RandomState(4).randint(3, 384, 40).tolist()
    for arch in ("Gemma3ForCausalLM", "MixtralForCausalLM"):
        from arcjax.model.formats.hf_checkpoint import load_hf

        cfg, params = load_hf(tiny_model_dir(arch))
        ref = hf_logits(tiny_model_dir(arch), ids)
        out = np.asarray(decoder.forward_dense(params, cfg, jnp.asarray([ids], jnp.int32)))[0]
        np.testing.assert_allclose(out, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=0)
