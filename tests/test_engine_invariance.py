"""The engine's batch-invariant mode (`batch_invariant=True`, docs/design/batch-invariance.md):
a probe request's per-token logprobs are bitwise equal to its solo run whatever else the
engine does around it (random other requests arriving at random steps, chunked prompts,
prefix-cache hits, overlapped scheduling, n-gram speculation), and the same workload with
the mode off does differ (so the property can fail); the option's checks and its flag."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from arcjax import LLM, SamplingParams
from arcjax.errors import EngineConfigError
from support.engines import GEOMETRY as ENGINE_GEOMETRY, SCHEDULES
from support.hf_models import DEEPSEEK_V2, tiny_model_dir

ARCH = "LlamaForCausalLM"
# The engine tests' cache geometry and first schedule: the mode-off engines share their
# compiled steps with the other engine tests (and every engine here with each other).
GEOMETRY = {**ENGINE_GEOMETRY, **SCHEDULES[0]}
PROBE_TOKENS = 6
PROBE = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
SPEC = {"method": "ngram", "num_speculative_tokens": 2}


def probe_prompt() -> list[int]:
    """A 40-token prompt of a repeated 7-token pattern (the n-gram proposer drafts from it)."""
    pattern = np.random.RandomState(5).randint(3, 384, 7).tolist()
    return (pattern * 6)[:40]


def _bits(output) -> np.ndarray:
    """The probe's sampled tokens' logprobs as int32 bit patterns."""
    done = output.outputs[0]
    lp = [entry[t].logprob for entry, t in zip(done.logprobs, done.token_ids)]
    return np.asarray(lp, np.float32).view(np.int32)


@functools.lru_cache(maxsize=None)
def _engine(invariant: bool, chunk: int | None, overlapped: bool, speculative: bool) -> LLM:
    """One engine per schedule, reused across examples (what an earlier example left in its
    prefix cache is one more variation the probe must not see)."""
    options = dict(GEOMETRY, batch_invariant=invariant, async_scheduling=overlapped,
                   enable_prefix_caching=True)
    if chunk is not None:
        options["long_prefill_token_threshold"] = chunk
    if speculative:
        options["speculative_config"] = SPEC
    return LLM(tiny_model_dir(ARCH), **options)


@functools.lru_cache(maxsize=None)
def solo(invariant: bool) -> tuple[tuple[int, ...], bytes]:
    """The probe alone on a fresh engine: one chunk, serial, no prefix cache."""
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY, batch_invariant=invariant,
              async_scheduling=False, enable_prefix_caching=False)
    out = llm.generate([probe_prompt()], PROBE, use_tqdm=False)[0]
    return tuple(out.outputs[0].token_ids), _bits(out).tobytes()


def run_probe(llm: LLM, others: list[tuple[int, int, int]], prefix_hit: int, seed: int):
    """The probe among `others` ((arrival step, prompt length, new tokens) each), after a
    request that leaves its first `prefix_hit` tokens in the prefix cache. Returns the
    probe's (tokens, logprob bits)."""
    rs = np.random.RandomState(seed)
    prompt = probe_prompt()
    if prefix_hit:
        warm = prompt[:prefix_hit] + rs.randint(3, 384, 3).tolist()
        llm.generate([warm], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    pending = sorted(others)
    probe_id = f"probe-{seed}-{prefix_hit}"
    llm.add_request(prompt, PROBE, request_id=probe_id)
    final, step = None, 0
    while llm.has_unfinished() or pending:
        while pending and pending[0][0] <= step:
            _, length, new = pending.pop(0)
            llm.add_request(rs.randint(3, 384, length).tolist(),
                            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        for out in llm.step():
            if out.request_id == probe_id and out.finished:
                final = out
        step += 1
    assert final is not None
    return tuple(final.outputs[0].token_ids), _bits(final).tobytes()


workloads = st.fixed_dictionaries(dict(
    others=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 6)),
                    max_size=4),
    chunk=st.sampled_from([None, 16, 32]),
    prefix_hit=st.sampled_from([0, 8, 16, 24]),
    overlapped=st.booleans(),
    speculative=st.booleans(),
    seed=st.integers(0, 2 ** 16)))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_probe_logprobs_are_bitwise_its_solo_run(w):
    llm = _engine(True, w["chunk"], w["overlapped"], w["speculative"])
    tokens, bits = run_probe(llm, w["others"], w["prefix_hit"], w["seed"])
    assert (tokens, bits) == solo(True)


def test_the_same_workloads_differ_with_the_mode_off():
    """Without the mode the probe's bits follow its batch and its chunking (XLA:CPU's
    products follow the row count; the attention's tiles follow the chunk), while its
    greedy tokens do not: what the property above would catch if the mode broke."""
    base_tokens, base_bits = solo(False)
    tokens, bits = run_probe(_engine(False, None, False, False),
                             [(0, 30, 6), (0, 50, 6), (1, 12, 6)], 0, 1)
    assert tokens == base_tokens
    assert bits != base_bits


def test_the_mode_is_a_checked_option_and_a_server_flag():
    from arcjax.engine.engine_config import EngineConfig
    from arcjax.entrypoints.cli import parse_serve

    for options, field in ((dict(batch_invariant="yes"), "batch_invariant"),
                           (dict(batch_invariant=True, packed_matmul_impl="w4a16"),
                            "packed_matmul_impl"),
                           (dict(batch_invariant=True, enable_lora=True), "enable_lora"),
                           (dict(batch_invariant=True, tensor_parallel_size=2),
                            "tensor_parallel_size"),
                           (dict(batch_invariant=True, expert_parallel_size=2),
                            "expert_parallel_size")):
        with pytest.raises(EngineConfigError) as e:
            EngineConfig.from_options(None, **options)
        assert e.value.field == field
    with pytest.raises(EngineConfigError) as e:  # latent attention: refused before loading
        LLM(tiny_model_dir(DEEPSEEK_V2), batch_invariant=True)
    assert e.value.field == "batch_invariant"
    config = EngineConfig.from_options(None, batch_invariant=True)
    assert config.step_attention_impl == "xla"
    config = EngineConfig.from_options(None, batch_invariant=True, attention_impl="triton")
    assert config.step_attention_impl == "triton"  # the kernel's batch-invariant plan
    assert EngineConfig.from_options(None).step_attention_impl == "auto"
    assert parse_serve(["serve", "--batch-invariant"]).engine_options == {
        "batch_invariant": True}
