"""DeepSeek-V2 and V3 (latent attention, a dense layer then expert layers, shared experts,
V2's group-limited and V3's noaux_tc routers, V3's query bottleneck and YaRN) through the
engine, against transformers: greedy tokens and prompt log-probabilities over a latent paged
cache (the absorbed attention of every prefill chunk and decode row against transformers'
per-head attention), the dense forward (heads expanded), prefix caching, the policies,
overlapped on and off, preemption, n-gram speculative decoding, structured outputs, KV bytes
per token, and what is refused. Tensor and expert parallelism: tests/test_engine_families.py
(its two-device subprocess).

Engines of one architecture share one cache geometry, so they share compiled steps.
"""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from arcjax import LLM, SamplingParams, StructuredOutputsParams
from arcjax.errors import EngineConfigError
from arcjax.model import forward_dense
from support.device_caches import device_cache
from support.hf_models import (DEEPSEEK_V2, DEEPSEEK_V3, hf_greedy, hf_logits, tiny_model_dir,
                               tiny_model_with_tokenizer)
from support.quantized_models import quantized_checkpoint

# One token bucket (32) for every chunk: each engine compiles few steps. 9 blocks of 8
# tokens: the 50-token prompt's 8 blocks fit, three prompts at once (8 + 3 + 5) do not.
GEOMETRY = dict(block_size=8, num_kv_blocks=9, max_model_len=64, max_num_seqs=4,
                attention_impl="auto", chunk_tile=32, max_num_batched_tokens=32)
LONG = 50  # two chunks of 32
MAX_TOKENS = 8
K = 3


def _prompts():
    rs = np.random.RandomState(21)
    return [rs.randint(3, 384, n).tolist() for n in (LONG, 9, 30)]


@functools.lru_cache(maxsize=None)
def _expected(arch: str, index: int) -> list[int]:
    return hf_greedy(tiny_model_dir(arch), _prompts()[index], MAX_TOKENS)


@device_cache
def _llm(arch: str, **options) -> LLM:
    return LLM(tiny_model_dir(arch), **{**GEOMETRY, **options})


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("arch", [DEEPSEEK_V2, DEEPSEEK_V3])
def test_greedy_and_prompt_logprobs_equal_transformers_over_the_latent_cache(arch):
    """A 50-token prompt in two chunks: greedy tokens equal transformers', prompt
    log-probabilities within 1e-4 of its log_softmax (absorbed latent attention against its
    per-head attention); the dense forward (every head's K and V expanded) gives its logits
    too (V3). The cache holds one latent and one rope key per token and layer; run again,
    the prefix cache serves the prompt's blocks; a dense layer (V3's first) routes no token,
    each expert layer k per token; the trace summary states the KV bytes per token beside
    per-head's."""
    llm = _llm(arch)
    prompt = _prompts()[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=K)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert list(first.token_ids) == _expected(arch, 0)
    assert len(set(first.token_ids)) > 1  # the tiny model does not repeat one token
    logits = hf_logits(tiny_model_dir(arch), prompt)
    ref = _log_softmax(logits)
    for p in range(1, len(prompt)):
        entry = first.prompt_logprobs[p]
        assert abs(entry[prompt[p]].logprob - ref[p - 1, prompt[p]]) < 1e-4
        best = max(entry, key=lambda t: entry[t].logprob)
        assert entry[best].rank == 1 and abs(entry[best].logprob - ref[p - 1].max()) < 1e-4
    runner = llm.engine.runner
    cfg = runner.cfg
    if arch == DEEPSEEK_V3:
        dense = np.asarray(forward_dense(runner.params, cfg,
                                         jnp.asarray([prompt], jnp.int32)))[0]
        np.testing.assert_allclose(dense, logits, atol=1e-4 * max(1.0, np.abs(logits).max()),
                                   rtol=0)
    mla = cfg.mla
    assert runner.cache["k"].shape[1:] == (8, 1, mla.kv_lora_rank)
    assert runner.cache["v"].shape[1:] == (8, 1, mla.qk_rope_head_dim)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == (LONG - 1) // 8 * 8
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    dense_layers = cfg.num_dense_layers
    assert dense_layers == (1 if arch == DEEPSEEK_V3 else 0)
    for r in llm.engine.trace:
        computed = r.prefill_tokens + r.decode_tokens
        assert len(r.expert_tokens) == cfg.num_layers == 3
        assert all(sum(layer) == 0 for layer in r.expert_tokens[:dense_layers])
        assert all(sum(layer) == cfg.num_experts_per_tok * computed
                   for layer in r.expert_tokens[dense_layers:])
    summary = llm.trace_summary(1.0)
    assert summary["kv_layout"] == "mla_latent"
    assert summary["kv_bytes_per_token"] == 3 * (32 + 16) * 4
    assert summary["per_head_kv_bytes_per_token"] == 3 * 4 * (16 + 16 + 24) * 4


TOKEN_BUDGET = dict(policy="token_budget", max_num_partial_prefills=2, async_scheduling=True)
ALTERNATE = dict(policy="alternate", async_scheduling=False, enable_prefix_caching=False)


def test_policies_overlap_and_preemption_equal_transformers():
    """DeepSeek-V3 (the dense layer, the query bottleneck, YaRN): three prompts (one past a chunk) in a cache too small for all three (preemption:
    recomputed over the latent pages), under token_budget (two prompts chunked at once,
    overlapped, prefix caching) and alternate (serial, no prefix caching): the same greedy
    tokens as transformers. (Prompt log-probabilities asked for: the steps compiled for the
    test above serve these too.)"""
    arch = DEEPSEEK_V3
    want = [_expected(arch, i) for i in range(3)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=K)
    for schedule in (TOKEN_BUDGET, ALTERNATE):
        llm = _llm(arch, **schedule)
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == want, schedule
        assert llm.engine.blocks_in_use() == 0
        preempted = sum(len(r.engaged["preempted"]) for r in llm.engine.trace)
        assert preempted > 0, schedule


BLOCK = 16  # the FP8 checkpoint's scale tile (DeepSeek-V3's is 128; the tiny model is small)


def test_fp8_block_checkpoint_loads_as_stored_and_equals_transformers_dequantized():
    """DeepSeek-V3's own FP8 format (e4m3 weights, `weight_scale_inv` per 16 x 16 tile,
    `weight_block_size`) of the tiny V3, beside a float twin of the same weights dequantized:
    loaded as stored, every linear weight of both layer stacks (latent projections, the dense
    layer, experts, shared experts) is a block-scaled FP8 `QuantizedWeight` whose
    dequantization (what the step computes) equals the twin's weight exactly; loaded
    dequantized, the engine gives transformers' greedy tokens and prompt log-probabilities
    on the twin."""
    from arcjax.model.formats.hf_checkpoint import load_hf
    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import load_model
    from arcjax.model.quant import QuantizedWeight, dense

    qdir, fdir = quantized_checkpoint("block", src=tiny_model_dir(DEEPSEEK_V3), block=BLOCK)
    stored = load_model(resolve_model(qdir), dtype=jnp.float32).params
    _, twin = load_hf(fdir)
    checked = 0
    for stack, name in (("dense_layers", "w_gate"), ("layers", "we_down"), ("layers", "ws_up"),
                        ("layers", "wq_a"), ("layers", "wq_b"), ("layers", "wkv_a"),
                        ("layers", "wkv_b"), ("dense_layers", "wo")):
        w = stored[stack][name]
        assert isinstance(w, QuantizedWeight) and w.block == (BLOCK, BLOCK), (stack, name)
        assert w.values.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(dense(w, jnp.float32)),
                                      np.asarray(twin[stack][name]), err_msg=name)
        checked += 1
    assert checked == 8
    llm = LLM(qdir, quantization="dequantize", **GEOMETRY)  # the float engine's compiled steps
    prompt = _prompts()[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True, prompt_logprobs=K),
                       use_tqdm=False)[0]
    assert list(out.token_ids) == hf_greedy(fdir, prompt, MAX_TOKENS)
    ref = _log_softmax(hf_logits(fdir, prompt))
    assert max(abs(out.prompt_logprobs[p][prompt[p]].logprob - ref[p - 1, prompt[p]])
               for p in range(1, len(prompt))) < 1e-4


SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": None}
REGEX = r"[a-z]{2,4}-[0-9]{2}"


def test_speculative_decoding_and_structured_outputs_over_the_latent_cache():
    """n-gram drafts on DeepSeek-V3 (rows verifying K drafted tokens at once: chunks of
    K + 1 through the absorbed path) on a prompt that repeats itself: transformers' greedy
    tokens, drafts proposed and some accepted. A regex-constrained request (a tokenizer
    beside the same weights) completes inside its grammar, with drafts and without, the
    same tokens either way. (Serial steps: structured outputs then run the compiled steps
    of the runs before; overlapped, their forward and sampling would compile apart.)"""
    arch = DEEPSEEK_V3
    prompt = (_prompts()[1] * 4)[:32]
    tokenizer = tiny_model_with_tokenizer(arch)
    llm = LLM(tiny_model_dir(arch), speculative_config=SPEC, tokenizer=tokenizer,
              async_scheduling=False, **GEOMETRY)
    out = llm.generate([prompt], SamplingParams(max_tokens=2 * MAX_TOKENS, temperature=0,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert list(out.token_ids) == hf_greedy(tiny_model_dir(arch), prompt, 2 * MAX_TOKENS)
    assert out.metrics.num_draft_tokens > 0
    assert sum(r.spec_accepted_tokens for r in llm.engine.trace) > 0
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    regex = SamplingParams(max_tokens=24, temperature=0,
                           structured_outputs=StructuredOutputsParams(regex=REGEX))
    got = [(o.text, o.finish_reason, list(o.token_ids)) for o in (
        engine.generate([prompt], regex, use_tqdm=False)[0]
        for engine in (llm, _llm(arch, tokenizer=tokenizer, async_scheduling=False)))]
    assert got[0] == got[1]
    assert re.fullmatch(REGEX, got[0][0]) and got[0][1] == "stop"


@pytest.mark.parametrize("options, field", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(quantization="int8"), "quantization"),  # at load: one layer stack only
    (dict(attention_impl="reference"), "attention_impl"),
    (dict(enable_lora=True), "enable_lora"),
])
def test_what_latent_attention_does_not_run_with_is_a_typed_error(options, field):
    """Refused before any weights load, naming the option."""
    with pytest.raises(EngineConfigError) as e:
        LLM(tiny_model_dir(DEEPSEEK_V2), **{**GEOMETRY, **options})
    assert e.value.field == field
