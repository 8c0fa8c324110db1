"""LoRA adapters under the engine's other features: greedy tokens equal transformers + PEFT
for six adapters (ranks 2 to 16, all projections, attention or MLP only, rsLoRA) and the
base model mixed in one `generate` call, in two device slots and three host slots: 48
requests at once (token_budget, overlapped), every other
policy (serial, overlapped), preemption; a structured-output constraint and
log-probabilities with an adapter; n-gram speculative decoding verified with each row's
adapter (a draft model is refused with adapters). The
engines have tests/test_lora_engine.py's shapes (`LORA_OPTIONS`): compiled steps are shared."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from arcjax import LLM, LoRARequest, SamplingParams
from arcjax.engine.trace import summarize
from arcjax.errors import EngineConfigError
from arcjax.sampling_params import StructuredOutputsParams
from support.engines import GEOMETRY
from support.hf_models import tiny_model_dir, tiny_model_with_tokenizer
from support.lora_adapters import (ALL_TARGETS, ATTENTION_TARGETS, LORA_OPTIONS,
                                   peft_adapter_dir, peft_greedy, peft_logprobs)

ARCH = "LlamaForCausalLM"
MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# name -> (rank, targets, use_rslora)
ADAPTERS = {"a4": (4, ALL_TARGETS, False), "a16": (16, ALL_TARGETS, False),
            "q8": (8, ATTENTION_TARGETS, False), "m4": (4, ALL_TARGETS[4:], False),
            "rs8": (8, ALL_TARGETS, True), "a2": (2, ALL_TARGETS, False)}
NAMES = (None, *ADAPTERS)
# Engine options of the other policies (LORA_OPTIONS' is token_budget): one serial, one
# overlapped.
POLICIES = {"prefill_first": dict(policy="prefill_first", prefill_max_seqs=2,
                                  async_scheduling=False),
            "alternate-overlapped": dict(policy="alternate", max_num_partial_prefills=2,
                                         async_scheduling=True)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None}  # on for whole batches


@functools.lru_cache(maxsize=None)
def _dirs() -> dict[str, str]:
    return {name: peft_adapter_dir(ARCH, rank=r, seed=60 + i, targets=t, rslora=rs)
            for i, (name, (r, t, rs)) in enumerate(ADAPTERS.items())}


@functools.lru_cache(maxsize=None)
def _requests() -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, 100 + i, path) for i, (name, path) in
            enumerate(_dirs().items())}


@functools.lru_cache(maxsize=None)
def _prompts() -> dict[str | None, tuple[tuple[int, ...], ...]]:
    """Two prompts per name, all opening with one shared block of 8 tokens."""
    rs = np.random.RandomState(17)
    shared = rs.randint(3, 384, 8).tolist()
    return {name: tuple(tuple(shared + rs.randint(3, 384, n).tolist()) for n in (2, 7))
            for name in NAMES}


def _cases(n: int) -> list[tuple[str | None, tuple[int, ...]]]:
    """n requests cycling over the base model and every adapter, each name's two prompts
    in turn."""
    return [(NAMES[i % len(NAMES)], _prompts()[NAMES[i % len(NAMES)]][i // len(NAMES) % 2])
            for i in range(n)]


@functools.lru_cache(maxsize=None)
def _expected(name: str | None, ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(peft_greedy(tiny_model_dir(ARCH), _dirs()[name] if name else None, ids,
                             MAX_TOKENS))


def _llm(**options) -> LLM:
    return LLM(tiny_model_with_tokenizer(ARCH), **{**GEOMETRY, **LORA_OPTIONS,
                                                   "max_cpu_loras": 3, **options})


def _run(llm: LLM, cases, params=GREEDY):
    reqs = _requests()
    return llm.generate([list(ids) for _, ids in cases], params, use_tqdm=False,
                        lora_request=[reqs[name] if name else None for name, _ in cases])


def _check(llm: LLM, cases) -> None:
    """Every case's tokens equal PEFT's; nothing pinned after; slots swapped and host
    slots reloaded (six adapters in two device slots and three host slots)."""
    want = [_expected(name, ids) for name, ids in cases]
    assert [tuple(o.outputs[0].token_ids) for o in _run(llm, cases)] == want
    assert llm.engine.adapters.pinned() == 0
    stats = llm.engine.stats()
    assert stats["lora_slot_swaps"] > len(ADAPTERS)
    assert stats["lora_adapter_loads"] > len(ADAPTERS)
    llm.engine.check_trace()


@pytest.fixture(scope="module")
def llm():
    """token_budget, overlapped."""
    return _llm(async_scheduling=True)


def test_six_adapters_48_requests_two_slots_equal_peft(llm):
    cases = _cases(48)
    assert len({_expected(name, ids) for name, ids in cases}) == 2 * len(NAMES), \
        "two names gave the same tokens: the comparison would prove less"
    _check(llm, cases)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_gives_each_adapter_its_peft_tokens(policy):
    _check(_llm(**POLICIES[policy]), _cases(2 * len(NAMES)))


def test_preempted_sequences_keep_their_adapters():
    """Eight prompts of 126 tokens (base model and two adapters) in 96 KV blocks of 8: a
    sequence is preempted, recomputed later with its adapter, and every output is PEFT's."""
    rs = np.random.RandomState(23)
    cases = [(name, tuple(rs.randint(3, 384, 126).tolist()))
             for name in (None, None, "a4", "a4", "a16", "a16", None, "a4")]
    llm = _llm(**POLICIES["prefill_first"])
    outs = _run(llm, cases)
    assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0
    assert [tuple(o.outputs[0].token_ids) for o in outs] == [_expected(n, i) for n, i in cases]
    assert llm.engine.adapters.pinned() == 0


def test_structured_outputs_with_an_adapter(llm):
    """`choice` between the adapter's greedy text and the base model's: under the
    constraint each row's argmax stays allowed, so each gives its own model's text."""
    tok = llm.engine.tokenizer
    name, ids = "a16", _prompts()["a16"][1]
    texts = {n: tok.decode(list(_expected(n, ids))) for n in (None, name)}
    assert texts[None] != texts[name] and all("\ufffd" not in t for t in texts.values())
    params = SamplingParams(max_tokens=MAX_TOKENS + 2, temperature=0, structured_outputs=
                            StructuredOutputsParams(choice=list(texts.values())))
    outs = _run(llm, [(None, ids), (name, ids)], params)
    assert [o.outputs[0].text for o in outs] == [texts[None], texts[name]]


def test_logprobs_with_adapters_equal_peft(llm):
    cases = [(name, _prompts()[name][0]) for name in ("a4", None, "rs8")]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    for (name, ids), out in zip(cases, _run(llm, cases, params)):
        c = out.outputs[0]
        assert tuple(c.token_ids) == _expected(name, ids)
        got = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
        want = peft_logprobs(tiny_model_dir(ARCH), _dirs()[name] if name else None, ids,
                             c.token_ids)
        np.testing.assert_allclose(got, want, atol=2e-4)



def test_ngram_drafts_are_verified_with_each_rows_adapter():
    """Drafts from each request's own tokens, verified by the target with the row's
    adapter: every output is PEFT's, drafts both accepted and rejected. A draft model is
    refused with adapters (typed)."""
    llm = _llm(speculative_config=NGRAM, async_scheduling=False)
    cases = _cases(len(NAMES))
    outs = _run(llm, cases)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == [_expected(n, i) for n, i in cases]
    counts = summarize(list(llm.engine.trace), 1.0)["spec_decode"]
    assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0
    assert llm.engine.adapters.pinned() == 0
    llm.engine.check_trace()
    with pytest.raises(EngineConfigError) as e:
        _llm(speculative_config={"method": "draft_model", "model": tiny_model_dir(ARCH),
                                 "num_speculative_tokens": 3})
    assert e.value.field == "speculative_config"
