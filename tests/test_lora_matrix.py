"""LoRA adapters under the engine's other features: greedy tokens equal transformers + PEFT
for six adapters (ranks 2 to 16, all projections, attention or MLP only, rsLoRA) and the
base model mixed in one `generate` call, in two device slots and three host slots: 48
requests at once (token_budget, overlapped), every other
policy (serial, overlapped), preemption; a structured-output constraint and
log-probabilities with an adapter; speculative decoding verified with each row's adapter,
drafts from n-grams or from a draft model run without adapters. The
engines have tests/test_lora_engine.py's shapes (`LORA_OPTIONS`): compiled steps are shared."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from arcjax import LLM, LoRARequest, SamplingParams
from arcjax.engine.trace import summarize
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
    adapter: every output is PEFT's, drafts both accepted and rejected."""
    llm = _llm(speculative_config=NGRAM, async_scheduling=False)
    cases = _cases(len(NAMES))
    outs = _run(llm, cases)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == [_expected(n, i) for n, i in cases]
    counts = summarize(list(llm.engine.trace), 1.0)["spec_decode"]
    assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0
    assert llm.engine.adapters.pinned() == 0
    llm.engine.check_trace()


def test_a_draft_model_proposes_without_adapters_and_the_target_verifies_with_them():
    """The draft model is the base model itself, run without adapters: the base model's rows
    accept every draft, the adapters' rows reject some (a draft run with the row's adapter
    would be accepted in full), and every output is PEFT's."""
    llm = _llm(speculative_config={"method": "draft_model", "model": tiny_model_dir(ARCH),
                                   "num_speculative_tokens": 3}, async_scheduling=False)
    cases = _cases(len(NAMES))
    outs = _run(llm, cases)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == [_expected(n, i) for n, i in cases]
    drafted = {True: [0, 0], False: [0, 0]}  # adapter row? -> [draft tokens, accepted]
    for (name, _), out in zip(cases, outs):
        drafted[name is not None][0] += out.metrics.num_draft_tokens
        drafted[name is not None][1] += out.metrics.num_accepted_tokens
    assert drafted[False][0] == drafted[False][1] > 0
    assert drafted[True][0] > drafted[True][1]
    assert llm.engine.adapters.pinned() == 0
    llm.engine.check_trace()


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_base_weights_with_adapters_equal_peft_on_the_dequantized_model(fmt):
    """An FP8 / INT8 checkpoint (per output channel) stays quantized on the device, the
    adapter's slots in the compute dtype: each row's tokens are PEFT's on the same weights
    dequantized in float32."""
    from support.quantized_models import quantized_checkpoint

    qdir, fdir = quantized_checkpoint("channel", fmt, src=tiny_model_dir(ARCH))
    adapters = {"q4": peft_adapter_dir(ARCH, rank=4, seed=80, model_dir=fdir),
                "q16": peft_adapter_dir(ARCH, rank=16, seed=81, model_dir=fdir)}
    llm = LLM(qdir, **{**GEOMETRY, **LORA_OPTIONS})
    wq = llm.engine.runner.params["layers"]["wq"].layers[0]  # one CPU device: per layer
    assert str(wq.values.dtype) == ("float8_e4m3fn" if fmt == "fp8" else "int8")
    assert {str(b.dtype) for pair in llm.engine.runner.lora.buffers.values()
            for b in pair.values()} == {"float32"}
    cases = [(name, _prompts()[name][1]) for name in (None, "a4", "a16")]
    names = [None, "q4", "q16"]
    outs = llm.generate([list(ids) for _, ids in cases], GREEDY, use_tqdm=False,
                        lora_request=[None if n is None else LoRARequest(n, 200 + i, adapters[n])
                                      for i, n in enumerate(names)])
    want = [peft_greedy(fdir, adapters[n] if n else None, ids, MAX_TOKENS)
            for n, (_, ids) in zip(names, cases)]
    assert len({tuple(w) for w in want}) == len(want)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_bfloat16_adapters_score_like_peft_in_float32():
    """bfloat16 weights and slots: a prompt of the adapter's PEFT greedy continuation is
    scored (prompt log-probabilities) within bfloat16's error of PEFT's float32 scores,
    which the base model's scores are not (greedy tokens in bfloat16 may differ)."""
    llm = LLM(tiny_model_dir(ARCH), **{**GEOMETRY, **LORA_OPTIONS, "dtype": "bfloat16"})
    assert {str(b.dtype) for pair in llm.engine.runner.lora.buffers.values()
            for b in pair.values()} == {"bfloat16"}
    name, ids = "a16", _prompts()["a16"][1]
    continuation = _expected(name, ids)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    seq = [*ids, *continuation]
    out = _run(llm, [(name, tuple(seq))], params)[0]
    got = np.array([out.prompt_logprobs[len(ids) + i][t].logprob
                    for i, t in enumerate(continuation)])
    want = np.array(peft_logprobs(tiny_model_dir(ARCH), _dirs()[name], ids, continuation))
    base = np.array(peft_logprobs(tiny_model_dir(ARCH), None, ids, continuation))
    tolerance = 0.1
    assert np.abs(got - want).max() < tolerance
    assert np.abs(base - want).max() > 2 * tolerance, "the adapter changes too little"
