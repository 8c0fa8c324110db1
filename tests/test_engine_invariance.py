"""The engine's batch-invariant mode (`batch_invariant=True`, docs/design/batch-invariance.md):
a probe request's per-token logprobs are bitwise equal to its solo run whatever else the
engine does around it (random other requests arriving at random steps, some aborted,
crowds that preempt the probe, chunked prompts, prefix-cache hits, overlapped scheduling,
n-gram speculation), on the tiny Llama in float32 and on each of `CASES` (bfloat16 with
soft-caps and sliding windows; a mixture of experts with a sliding window on FP8 KV pages);
the same workload with the mode off does differ (so the property can fail); the option's
checks and its flag."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pallas_kernels
from arcjax import LLM, SamplingParams
from arcjax.errors import EngineConfigError
from support.device_caches import device_cache
from support.engines import GEOMETRY as ENGINE_GEOMETRY, SCHEDULES
from support.hf_models import DEEPSEEK_V2, tiny_model_dir

# (architecture, dtype, kv_cache_dtype) of a model and its cache.
LLAMA_F32 = ("LlamaForCausalLM", "float32", "auto")
# Two cases cover bfloat16, experts, sliding windows, soft-caps and FP8 pages (each case
# compiles its own steps: the suite's time budget).
CASES = [("Gemma2ForCausalLM", "bfloat16", "auto"),  # soft-caps, sliding and full layers
         ("MixtralForCausalLM", "float32", "fp8")]  # experts, a sliding window, FP8 KV pages
# The engine tests' cache geometry and first schedule: the mode-off engines share their
# compiled steps with the other engine tests (and every engine of a case here with each
# other: the variations change scheduling only).
GEOMETRY = {**ENGINE_GEOMETRY, **SCHEDULES[0]}
SMALL_POOL = SCHEDULES[3]["num_kv_blocks"]  # the engine tests' preempting pool: 12 blocks of 8
PROBE_TOKENS = 6
PROBE = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
SPEC = {"method": "ngram", "num_speculative_tokens": 2}
_PROBES = itertools.count()  # request ids: engines are reused across examples


def probe_prompt() -> list[int]:
    """A 40-token prompt of a repeated 7-token pattern (the n-gram proposer drafts from it)."""
    pattern = np.random.RandomState(5).randint(3, 384, 7).tolist()
    return (pattern * 6)[:40]


def _bits(output) -> np.ndarray:
    """The probe's sampled tokens' logprobs as int32 bit patterns."""
    done = output.outputs[0]
    lp = [entry[t].logprob for entry, t in zip(done.logprobs, done.token_ids)]
    return np.asarray(lp, np.float32).view(np.int32)


def _options(case, invariant: bool) -> dict:
    arch, dtype, kv_dtype = case
    return dict(GEOMETRY, dtype=dtype, kv_cache_dtype=kv_dtype, batch_invariant=invariant)


@device_cache
def _engine(invariant: bool, chunk: int | None, overlapped: bool, speculative: bool,
            case=LLAMA_F32, small_pool: bool = False) -> LLM:
    """One engine per case and schedule, reused across examples (what an earlier example
    left in its prefix cache is one more variation the probe must not see); `small_pool`:
    the preempting schedule's KV pool (`SMALL_POOL`)."""
    options = dict(_options(case, invariant), async_scheduling=overlapped,
                   enable_prefix_caching=True)
    if small_pool:
        options["num_kv_blocks"] = SMALL_POOL
    if chunk is not None:
        options["long_prefill_token_threshold"] = chunk
    if speculative:
        options["speculative_config"] = SPEC
    return LLM(tiny_model_dir(case[0]), **options)


@device_cache
def solo(invariant: bool, case=LLAMA_F32) -> tuple[tuple[int, ...], bytes]:
    """The probe alone on a fresh engine: one chunk, serial, no prefix cache."""
    llm = LLM(tiny_model_dir(case[0]), **_options(case, invariant), async_scheduling=False,
              enable_prefix_caching=False)
    out = llm.generate([probe_prompt()], PROBE, use_tqdm=False)[0]
    return tuple(out.outputs[0].token_ids), _bits(out).tobytes()


def run_probe(llm: LLM, others: list[tuple[int, int, int, int | None]], prefix_hit: int,
              seed: int, preempted: set | None = None):
    """The probe among `others` ((arrival step, prompt length, new tokens, steps after its
    arrival it is aborted at or None) each), after a request that leaves its first
    `prefix_hit` tokens in the prefix cache. Returns the probe's (tokens, logprob bits);
    the ids of the requests the scheduler preempted are added to `preempted`."""
    rs = np.random.RandomState(seed)
    prompt = probe_prompt()
    if prefix_hit:
        warm = prompt[:prefix_hit] + rs.randint(3, 384, 3).tolist()
        llm.generate([warm], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    pending, aborts = sorted(others, key=lambda o: o[:3]), []
    probe_id = f"probe-{next(_PROBES)}"
    if preempted is not None:
        llm.engine.trace_sink = lambda record: preempted.update(
            record.engaged.get("preempted") or ())
    final, step = None, -1  # requests arriving at step -1 come before the probe
    try:
        while step < 1 or llm.has_unfinished() or pending:
            if step == 0:
                llm.add_request(prompt, PROBE, request_id=probe_id)
            while pending and pending[0][0] <= step:
                _, length, new, abort_after = pending.pop(0)
                rid = llm.add_request(rs.randint(3, 384, length).tolist(), SamplingParams(
                    max_tokens=new, temperature=0, ignore_eos=True))
                if abort_after is not None:
                    aborts.append((step + abort_after, rid))
            for at, rid in [a for a in aborts if a[0] <= step]:
                llm.abort(rid)
                aborts.remove((at, rid))
            for out in llm.step() if step >= 0 else ():
                if out.request_id == probe_id and out.finished:
                    final = out
            step += 1
    finally:
        llm.engine.trace_sink = None
    assert final is not None
    return tuple(final.outputs[0].token_ids), _bits(final).tobytes()


# Other requests: (arrival step, -1 before the probe; prompt length; new tokens; aborted that
# many steps after arrival, or never).
_abort_after = st.one_of(st.none(), st.integers(0, 4))
_others = st.lists(st.tuples(st.integers(-1, 3), st.integers(1, 60), st.integers(1, 6),
                             _abort_after), max_size=4)
workloads = st.fixed_dictionaries(dict(
    others=_others,
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


case_workloads = st.fixed_dictionaries(dict(
    others=_others, chunk=st.sampled_from([None, 16]), prefix_hit=st.sampled_from([0, 16, 24]),
    overlapped=st.booleans(), seed=st.integers(0, 2 ** 16)))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(w=case_workloads)
def test_probe_logprobs_are_bitwise_its_solo_run_on_each_case(case, w):
    llm = _engine(True, w["chunk"], w["overlapped"], False, case)
    tokens, bits = run_probe(llm, w["others"], w["prefix_hit"], w["seed"])
    assert (tokens, bits) == solo(True, case)


GEMMA2_F32 = ("Gemma2ForCausalLM", "float32", "auto")
# Seven others beside the probe (max_num_seqs 8): its decode rows run in buckets of every
# size from 1 to 8 rows as they arrive and finish.
CROWD = [(-1, 30, 6, None), (0, 12, 2, None), (1, 50, 3, None), (1, 5, 8, None),
         (2, 25, 4, None), (3, 9, 1, None), (3, 44, 5, None)]


def test_gemma2_float32_rows_do_not_follow_the_bucket_size():
    """Gemma 2 in float32 (soft-caps, sliding and full layers) in a crowd whose decode
    buckets change size step by step, the CPU's small buckets running the layers unrolled:
    bitwise its solo run. Row tiles whose one-tile buckets XLA hoisted out of their loop
    made this case differ in the last bit (arcjax/model/row_tiles.py)."""
    llm = _engine(True, None, False, False, GEMMA2_F32)
    assert run_probe(llm, CROWD, 0, 3) == solo(True, GEMMA2_F32)
    loops = llm.engine.runner.layer_loops
    assert {seqs for (_, seqs, q), loop in loops.items() if q == 1 and loop == "unrolled"} \
        >= {1, 8}  # one-tile decode buckets of one and of eight rows, unrolled


def test_a_preempted_probe_is_bitwise_its_solo_run(case=LLAMA_F32):
    """In the small pool an earlier request's growth preempts the probe (the largest key):
    its prompt and the tokens it had are computed again as one prefill, beside the other's
    decodes; in the second run the other request is aborted mid-run instead of finishing."""
    llm = _engine(True, 16, False, False, case, small_pool=True)
    for other in ((-1, 47, 8, None), (-1, 47, 20, 8)):
        preempted: set = set()
        tokens, bits = run_probe(llm, [other], 0, 0, preempted)
        assert any(rid.startswith("probe-") for rid in preempted), preempted
        assert (tokens, bits) == solo(True, case)


def test_the_same_workloads_differ_with_the_mode_off():
    """Without the mode the probe's bits follow its chunking (its prompt in 16-token
    chunks runs in narrower attention tiles than its solo prefill, and XLA:CPU's products
    follow a tile's row count), while its greedy tokens do not: what the property above
    would catch if the mode broke. (On this tiny model the batches tried without chunking
    leave the bits alone: every key step is 128 keys from position 0, prefill or decode.)"""
    base_tokens, base_bits = solo(False)
    tokens, bits = run_probe(_engine(False, 16, False, False),
                             [(0, 30, 6, None), (0, 50, 6, None), (1, 12, 6, None)], 0, 1)
    assert tokens == base_tokens
    assert bits != base_bits


def test_the_mode_is_a_checked_option_and_a_server_flag():
    from arcjax.engine.engine_config import EngineConfig
    from arcjax.entrypoints.cli import parse_serve

    for options, field in ((dict(batch_invariant="yes"), "batch_invariant"),
                           (dict(batch_invariant=True, packed_matmul_impl="w4a16"),
                            "packed_matmul_impl"),
                           (dict(batch_invariant=True, enable_lora=True), "enable_lora"),
                           (dict(batch_invariant=True, tensor_parallel_size=4),
                            "tensor_parallel_size"),
                           (dict(batch_invariant=True, expert_parallel_size=2),
                            "expert_parallel_size")):
        with pytest.raises(EngineConfigError) as e:
            EngineConfig.from_options(None, **options)
        assert e.value.field == field
    with pytest.raises(EngineConfigError) as e:  # latent attention: refused before loading
        LLM(tiny_model_dir(DEEPSEEK_V2), batch_invariant=True)
    assert e.value.field == "batch_invariant"
    # "auto" in the mode: the compiled CPU kernel (invariant by construction) on the CPU,
    # the xla path's fixed tiles on a GPU (the GPU kernels' mode has had no GPU run yet);
    # an explicit GPU kernel keeps its own invariant plan.
    shapes = dict(head_dim=64, block_size=16, max_q_len=None, dtype=jnp.float32,
                  num_heads=4, num_kv_heads=2, batch_invariant=True)
    assert pallas_kernels.choose_impl("auto", platform="cpu", **shapes).impl == "cpu"
    assert pallas_kernels.choose_impl("auto", platform="gpu", **shapes).impl == "xla"
    assert pallas_kernels.choose_impl("triton", platform="gpu", **shapes).impl == "triton"
    assert parse_serve(["serve", "--batch-invariant"]).engine_options == {
        "batch_invariant": True}
