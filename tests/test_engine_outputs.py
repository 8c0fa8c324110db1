"""Outputs as deltas: `SamplingParams.output_kind` (CUMULATIVE, DELTA, FINAL_ONLY), stop
strings held back from deltas, n > 1, prompt logprobs once, O(1) cumulative outputs, and
AsyncLLM's one-slot collector merging what a slow reader missed."""

from __future__ import annotations

import asyncio

import pytest

from arcjax import (LLM, AsyncLLM, RequestOutputKind, SamplingParams, SamplingParamsError)
from support.device_caches import device_cache
from support.engines import GEOMETRY
from support.hf_models import tiny_model_with_tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)
PROMPT = "def fibonacci(n):"


@device_cache
def _llm():
    return LLM(tiny_model_with_tokenizer("LlamaForCausalLM"), **GEOMETRY)


def _params(kind, **kw):
    base = dict(max_tokens=20, temperature=0, ignore_eos=True)
    return SamplingParams(**{**base, **kw}, output_kind=kind)


def _joined(outs):
    """(text, token ids, logprob entries) of each sample, accumulated over DELTA outputs."""
    acc = {}
    for o in outs:
        for c in o.outputs:
            text, ids, lps = acc.setdefault(c.index, ["", [], []])
            acc[c.index][0] = text + c.text
            ids.extend(c.token_ids)
            lps.extend(c.logprobs or [])
    return acc


def test_kinds_agree_and_delta_outputs_carry_only_the_new_part():
    llm = _llm()
    kw = dict(logprobs=2, prompt_logprobs=1)
    full = llm.generate([PROMPT], _params(CUMULATIVE, **kw), use_tqdm=False)[0]
    cumulative = list(llm.stream([PROMPT], _params(CUMULATIVE, **kw)))
    delta = list(llm.stream([PROMPT], _params(DELTA, **kw)))
    final = list(llm.stream([PROMPT], _params(FINAL_ONLY, **kw)))
    assert len(final) == 1 and final[0].finished and final[0].text == full.text
    assert list(final[0].token_ids) == list(full.token_ids)
    # CUMULATIVE: every output extends the previous one
    for a, b in zip(cumulative, cumulative[1:]):
        assert list(b.token_ids[:len(a.token_ids)]) == list(a.token_ids)
        assert b.text.startswith(a.text) and b.text == a.text + b.delta_text
    assert cumulative[-1].text == full.text and len(cumulative) > 3
    # DELTA: the new tokens, text and logprobs of each step; together, everything
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    text, ids, lps = _joined(delta)[0]
    assert text == full.text and ids == list(full.token_ids)
    assert [sorted(e) for e in lps] == [sorted(e) for e in full.outputs[0].logprobs]
    assert all(o.text == o.delta_text and len(o.token_ids) <= 1 for o in delta[1:])
    assert sum(o.prompt_logprobs is not None for o in delta) == 1  # sent once
    assert list(delta[0].prompt_logprobs) == list(full.prompt_logprobs)
    assert delta[-1].finish_reason == full.finish_reason == "length"
    assert len(delta[-1].metrics.token_times) == 20  # metrics are the request's, whole


def test_cumulative_outputs_share_the_request_lists_instead_of_copying():
    llm = _llm()
    outs = list(llm.stream([PROMPT], _params(CUMULATIVE, logprobs=1)))
    a, b = outs[2], outs[-1]
    assert len(a.token_ids) < len(b.token_ids)
    assert a.token_ids._items is b.token_ids._items  # one list, two fixed-length views
    assert a.outputs[0].logprobs._items is b.outputs[0].logprobs._items
    assert a.token_ids == tuple(b.token_ids[:len(a.token_ids)])  # equal to the tuple
    assert hash(a.token_ids) == hash(tuple(a.token_ids))
    assert len({a.token_ids, tuple(a.token_ids)}) == 1


def test_stop_strings_are_held_back_from_deltas():
    llm = _llm()
    text = llm.generate([PROMPT], _params(CUMULATIVE, max_tokens=24), use_tqdm=False)[0].text
    cut = next(i for i in range(len(text) // 2, len(text) - 2) if text[i:i + 3].strip())
    stop = text[cut:cut + 3]
    for kind in (DELTA, CUMULATIVE):
        outs = list(llm.stream([PROMPT], _params(kind, max_tokens=24, stop=[stop])))
        assert outs[-1].finish_reason == "stop"
        assert "".join(o.delta_text for o in outs) == text[:text.index(stop)]
        # no output before the last ever showed a character of the stop string
        shown = "".join(o.delta_text for o in outs[:-1])
        assert text[:len(shown)] == shown and len(shown) <= text.index(stop)


def test_n_samples_as_deltas():
    llm = _llm()
    params = dict(n=3, temperature=1.0, seed=5, max_tokens=8)
    full = llm.generate([PROMPT], _params(CUMULATIVE, **params), use_tqdm=False)[0]
    joined = _joined(llm.stream([PROMPT], _params(DELTA, **params)))
    assert sorted(joined) == [0, 1, 2]
    for c in full.outputs:
        assert joined[c.index][0] == c.text and joined[c.index][1] == list(c.token_ids)


def test_output_kind_is_validated():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(output_kind="delta")
    assert err.value.field == "output_kind"
    assert SamplingParams(output_kind=1).output_kind is DELTA


def test_async_collector_merges_what_a_slow_reader_missed():
    llm = AsyncLLM(tiny_model_with_tokenizer("LlamaForCausalLM"), **GEOMETRY)
    try:
        async def read(kind, slow):
            outs = []
            async for out in llm.generate(PROMPT, _params(kind, max_tokens=40, logprobs=1)):
                outs.append(out)
                if slow:
                    await asyncio.sleep(0.05)  # the engine thread runs on meanwhile
            return outs

        fast = asyncio.run(read(DELTA, False))
        slow = asyncio.run(read(DELTA, True))
        slow_cumulative = asyncio.run(read(CUMULATIVE, True))
    finally:
        llm.shutdown()
    assert len(slow) < len(fast) and slow[-1].finished
    assert _joined(slow)[0][:2] == _joined(fast)[0][:2]
    assert len(_joined(slow)[0][2]) == 40  # every token's logprob entry, once
    assert "".join(o.delta_text for o in slow_cumulative) == slow_cumulative[-1].text
    assert list(slow_cumulative[-1].token_ids) == _joined(fast)[0][1]
