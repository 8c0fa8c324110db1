"""Prefix caching end to end: greedy tokens are identical with caching on and off, under every
policy, chunk tile, budget and preemption pattern, and equal transformers'."""

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arcjax import LLM, SamplingParams
from support.hf_models import hf_greedy, tiny_model_dir

ARCH = "LlamaForCausalLM"
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto")
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
# A cache small enough to force preemption: 12 blocks, the preempting geometry of the other
# engine tests (tests/support/engines.py), so its steps are compiled once per suite run.
PREEMPTING_BLOCKS = 12


def _prompts(seed: int) -> list[list[int]]:
    """Prompts sharing prefixes of many lengths: block-aligned (16, 32), ending inside a block
    (13, 27), a whole duplicate (entirely cached), a block-aligned whole duplicate, and one
    sharing nothing."""
    rs = np.random.RandomState(seed)
    base = rs.randint(3, 384, 40).tolist()
    tail = lambda n: rs.randint(3, 384, n).tolist()  # noqa: E731
    return [base, base[:16] + tail(9), base[:13] + tail(20), base[:27] + tail(3),
            list(base), base[:32], base[:32] + tail(1), tail(12)]


@functools.lru_cache(maxsize=None)
def _expected(seed: int) -> tuple:
    return tuple(tuple(hf_greedy(tiny_model_dir(ARCH), p, GREEDY.max_tokens))
                 for p in _prompts(seed))


def _run(llm, prompts):
    # Two waves: the first fills the cache, the second (the same prompts again) hits it.
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    if llm.engine.runner.num_blocks == PREEMPTING_BLOCKS:  # the small cache did preempt
        assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0
    return first, second


SCHEDULES = st.tuples(
    st.sampled_from(["prefill_first", "alternate", "token_budget"]),
    st.sampled_from([8, 16, 32]),  # chunk tile
    st.sampled_from([32, 64, 256]),  # token budget
    st.sampled_from([96, PREEMPTING_BLOCKS]),  # KV blocks
    st.integers(0, 3))  # prompt seed


@settings(max_examples=6, suppress_health_check=list(HealthCheck), deadline=None)
@given(SCHEDULES)
def test_caching_on_and_off_give_identical_greedy_tokens_equal_to_transformers(schedule):
    policy, tile, budget, blocks, seed = schedule
    if budget < tile:
        budget = tile
    prompts = _prompts(seed)
    options = dict(GEOMETRY, policy=policy, chunk_tile=tile, max_num_batched_tokens=budget,
                   num_kv_blocks=blocks)
    on = LLM(tiny_model_dir(ARCH), enable_prefix_caching=True, **options)
    off = LLM(tiny_model_dir(ARCH), enable_prefix_caching=False, **options)
    on_first, on_second = _run(on, prompts)
    off_first, off_second = _run(off, prompts)
    want = [list(t) for t in _expected(seed)]
    for outs in (on_first, on_second, off_first, off_second):
        assert [list(o.token_ids) for o in outs] == want
    assert all(o.num_cached_tokens == 0 for o in off_first + off_second)
    if blocks == 96:  # nothing evicted: the second wave must hit for every shared prefix
        cached = [o.num_cached_tokens for o in on_second]
        assert cached[0] == 32 and cached[4] == 32  # 39 computable tokens -> 4 whole blocks
        assert cached[5] == 24  # block-aligned 32-token prompt: its last block is recomputed
        assert all(c % 8 == 0 for c in cached)


def test_prefix_cache_hits_show_in_outputs_and_trace_summary():
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY, chunk_tile=16, max_num_batched_tokens=128)
    shared = np.random.RandomState(7).randint(3, 384, 64).tolist()
    llm.generate([shared + [5, 6, 7]], GREEDY, use_tqdm=False)
    outs = llm.generate([shared + [9, i] for i in range(4)], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [64] * 4
    summary = llm.trace_summary(1.0)["prefix_cache"]
    assert summary["cached_tokens"] == 4 * 64 and 0 < summary["hit_rate"] < 1
    assert any(r.cached_tokens for r in llm.engine.trace)


@pytest.mark.parametrize("enable", [True, False])
def test_option_reaches_the_scheduler(enable):
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY, enable_prefix_caching=enable)
    assert llm.engine.sched_config.enable_prefix_caching is enable
