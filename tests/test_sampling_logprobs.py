"""Log-probabilities (sampled + top-k, prompt) against transformers' log_softmax, in chunked
and preempted schedules; raw logprobs ignore penalties and temperature."""

import numpy as np
import pytest

from arcjax import LLM, SamplingParams
from support.hf_models import hf_logits, tiny_model_dir

ARCH = "LlamaForCausalLM"
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto")
PROMPT_LENS = (3, 17, 40, 9, 66)
K = 5


def _prompts():
    rs = np.random.RandomState(5)
    return [rs.randint(3, 384, n).tolist() for n in PROMPT_LENS]


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _check_entry(entry, chosen, ref_row, k):
    assert chosen in entry and len(entry) in (k, k + 1)
    assert abs(entry[chosen].logprob - ref_row[chosen]) < 1e-4
    assert entry[chosen].rank == 1 + int((ref_row > ref_row[chosen] + 1e-6).sum())
    top = np.argsort(-ref_row)[:k]
    got_top = sorted((t for t in entry if entry[t].rank <= k), key=lambda t: entry[t].rank)
    assert len(got_top) >= k - 1  # the chosen token may be one of them
    for t in got_top:
        assert abs(entry[t].logprob - ref_row[t]) < 1e-4
    np.testing.assert_allclose(sorted((ref_row[t] for t in got_top), reverse=True),
                               ref_row[top][:len(got_top)], atol=1e-4)


@pytest.mark.parametrize("schedule", [
    dict(chunk_tile=16, max_num_batched_tokens=32, policy="token_budget"),  # chunked
    dict(num_kv_blocks=12, chunk_tile=16, max_num_batched_tokens=128),  # preempted
])
def test_logprobs_equal_transformers(schedule):
    path = tiny_model_dir(ARCH)
    llm = LLM(path, **{**GEOMETRY, **schedule})
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True,
                            logprobs=K, prompt_logprobs=K, repetition_penalty=1.3)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    if "num_kv_blocks" in schedule:
        assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0
    assert llm.engine.blocks_in_use() == 0
    for prompt, out in zip(_prompts(), outs):
        ids = prompt + list(out.token_ids)
        ref = _log_softmax(hf_logits(path, ids))  # [L, V]
        comp = out.outputs[0]
        assert len(comp.logprobs) == len(out.token_ids) == 8
        for j, (tok, entry) in enumerate(zip(out.token_ids, comp.logprobs)):
            _check_entry(entry, tok, ref[len(prompt) - 1 + j], K)
        assert abs(comp.cumulative_logprob - sum(
            ref[len(prompt) - 1 + j][t] for j, t in enumerate(out.token_ids))) < 1e-3
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            _check_entry(out.prompt_logprobs[p], prompt[p], ref[p - 1], K)


def test_logprobs_zero_gives_only_the_sampled_token_and_absent_means_none():
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY)
    a, b = llm.generate([_prompts()[1]] * 2, [
        SamplingParams(max_tokens=4, temperature=0, logprobs=0),
        SamplingParams(max_tokens=4, temperature=0)], use_tqdm=False)
    assert all(len(e) == 1 and e[t].rank == 1 for t, e in zip(a.token_ids, a.outputs[0].logprobs))
    assert b.outputs[0].logprobs is None and b.prompt_logprobs is None
    assert a.token_ids == b.token_ids
