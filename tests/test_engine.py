"""The engine end to end on tiny random-weight models: exactness across schedules (and
against transformers), sampling, stop conditions, warm-up, bad input, abort, trace."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arcjax
from arcjax import LLM, RequestError, SamplingParams, UnknownRequestError
from arcjax.errors import RequestTooLargeError
from pallas_kernels import cpu_build
from support.engines import ARCH, GEOMETRY, GREEDY, MAX_TOKENS, PROMPT_LENS, engine_prompts
from support.engines import expected_greedy, tiny_llm
from support.hf_models import tiny_model_dir, tiny_model_with_tokenizer


def _run_greedy(llm):
    outs = llm.generate(engine_prompts(), GREEDY, use_tqdm=False)
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    return [list(o.token_ids) for o in outs]


SCHEDULES = st.one_of(
    st.builds(dict, policy=st.just("prefill_first"), prefill_max_seqs=st.sampled_from([0, 2]),
              prefill_floor_steps=st.sampled_from([0, 2])),
    st.builds(dict, policy=st.just("alternate"), max_num_partial_prefills=st.integers(1, 3)),
    st.builds(dict, policy=st.just("token_budget"), max_num_partial_prefills=st.integers(1, 3),
              long_prefill_token_threshold=st.sampled_from([0, 32])),
).flatmap(lambda d: st.tuples(st.just(d), st.sampled_from([16, 32, 64, 128]),
                              st.sampled_from([128, 256, 512, 2048])))


@settings(max_examples=8, suppress_health_check=list(HealthCheck), deadline=None)
@given(SCHEDULES, st.sampled_from(["auto", "xla"]))
def test_greedy_is_identical_under_every_schedule_and_equals_transformers(schedule, attention):
    """Every schedule, on the CPU's kernel ("auto") and on the xla path."""
    options, tile, budget = schedule
    if options.get("long_prefill_token_threshold", 0) and options["long_prefill_token_threshold"] < tile:
        options = {**options, "long_prefill_token_threshold": tile}
    llm = tiny_llm(chunk_tile=tile, max_num_batched_tokens=budget, attention_impl=attention,
                   **options)
    assert _run_greedy(llm) == expected_greedy()


@pytest.mark.parametrize("policy", ["prefill_first", "token_budget"])
def test_tiny_kv_cache_forces_preemption_and_keeps_outputs(policy):
    # 12 blocks of 8 tokens: the 66+8-token prompt alone needs 10, so sequences must
    # be preempted and recomputed.
    llm = tiny_llm(num_kv_blocks=12, chunk_tile=16, max_num_batched_tokens=128, policy=policy)
    assert _run_greedy(llm) == expected_greedy()
    preempted = sum(len(r.engaged["preempted"]) for r in llm.engine.trace)
    assert preempted > 0


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_other_architectures_match_transformers(arch):
    llm = tiny_llm(arch, chunk_tile=16, max_num_batched_tokens=64)
    assert _run_greedy(llm) == expected_greedy(arch)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=128)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = engine_prompts()[2]
    alone = llm.generate([prompt], p, use_tqdm=False)[0].token_ids
    noisy = [SamplingParams(max_tokens=5 + i, temperature=0.7, ignore_eos=True) for i in range(4)]
    batch = llm.generate(engine_prompts()[:4] + [prompt], noisy + [p], use_tqdm=False)
    assert batch[-1].token_ids == alone
    top1 = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=1, ignore_eos=True)
    outs = llm.generate(engine_prompts(), top1, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected_greedy()


def test_stop_token_ids_and_stop_strings():
    llm = LLM(tiny_model_with_tokenizer(ARCH), **GEOMETRY, chunk_tile=16,
              max_num_batched_tokens=128)
    prompt = "def fibonacci(n):"
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                stop_token_ids=(stop_id,)), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    text = free.text
    cut = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    stop = text[cut:cut + 2]  # a non-blank 2-character stop string from the second half
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                ignore_eos=True, stop=(stop,)), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    # Streaming deltas concatenate to the final text.
    deltas = [o.delta_text for o in llm.stream([prompt], SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True))]
    assert "".join(deltas) == text


def test_no_compile_after_warmup_on_a_varied_workload():
    # A cache geometry no other test uses, so every executable is compiled here.
    llm = tiny_llm(chunk_tile=32, max_num_batched_tokens=128, max_num_seqs=8, num_kv_blocks=97)
    llm.warmup()
    runner = llm.engine.runner
    assert runner.num_executables == len(runner.buckets.all()) == 7  # 4 decode, 3 mixed
    ran = []
    real_run = runner.run
    runner.run = lambda *a, **k: ran.append(a[0]) or real_run(*a, **k)
    llm.warmup()  # every bucket is prepared already: nothing runs again
    del runner.run
    assert ran == []
    before = runner.num_executables
    rs = np.random.RandomState(5)
    prompts = [rs.randint(3, 384, rs.randint(1, 120)).tolist() for _ in range(14)]
    params = [SamplingParams(max_tokens=int(rs.randint(1, 20)), temperature=float(t),
                             ignore_eos=True) for t in rs.choice([0.0, 0.8], 14)]
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.num_executables == before
    assert not any(r.compiled for r in llm.engine.trace)


def test_bad_input_is_rejected_with_typed_errors_and_others_continue():
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=128)
    llm.add_request(engine_prompts()[1], GREEDY, request_id="good")
    cases = [
        ([], GREEDY, "empty"),
        ([5] * 300, GREEDY, "max_model_len"),
        ([5] * 10, SamplingParams(max_tokens=250), "max_model_len"),
        ([5, 999], GREEDY, "vocabulary"),
        ([-1, 5], GREEDY, "vocabulary"),
        ([5, 6], "greedy", "SamplingParams"),
    ]
    for prompt, params, match in cases:
        with pytest.raises(RequestError, match=match):
            llm.add_request(prompt, params)
    with pytest.raises(RequestError, match="already in use"):
        llm.add_request([5, 6], GREEDY, request_id="good")
    with pytest.raises(UnknownRequestError, match="nope"):
        llm.abort("nope")
    small = tiny_llm(num_kv_blocks=4, chunk_tile=16, max_num_batched_tokens=128)
    with pytest.raises(RequestTooLargeError, match="can never fit") as err:
        small.add_request([5] * 30, SamplingParams(max_tokens=10))
    assert err.value.field == "max_tokens" and err.value.limit == 4 * 8 + 1
    for kwargs in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    with pytest.raises(RequestError):  # a batch with one bad prompt queues nothing
        llm.generate([engine_prompts()[0], []], GREEDY, use_tqdm=False)
    outs = []
    while llm.has_unfinished():
        outs += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"]
    assert list(outs[0].token_ids) == expected_greedy()[1]
    assert llm.engine.blocks_in_use() == 0


def test_abort_frees_blocks_at_once():
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64)
    ids = [llm.add_request(p, GREEDY) for p in engine_prompts()]
    llm.step()
    llm.step()
    assert llm.engine.blocks_in_use() > 0
    for rid in ids[::2]:
        llm.abort(rid)
    finished = {}
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                finished[o.request_id] = o
    aborted = {rid for rid, o in finished.items() if o.finish_reason == "abort"}
    assert aborted == set(ids[::2])
    for i in range(1, len(ids), 2):
        assert list(finished[ids[i]].token_ids) == expected_greedy()[i]
    assert llm.engine.blocks_in_use() == 0
    with pytest.raises(UnknownRequestError):
        llm.abort(ids[1])


def test_trace_metrics_summary_and_jsonl(tmp_path):
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64, prefill_max_seqs=2,
               long_prefill_token_threshold=32, attention_impl="auto")
    outs = llm.generate(engine_prompts(), GREEDY, use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert m.ttft > 0 and m.queue_time >= 0 and m.e2e_latency >= m.ttft
        assert len(m.token_times) == MAX_TOKENS and len(m.itl) == MAX_TOKENS - 1
        assert m.tpot == pytest.approx(np.mean(m.itl))
    trace = llm.engine.trace
    assert sum(r.prefill_tokens for r in trace) == sum(PROMPT_LENS)
    wall = trace[-1].end - trace[0].start
    summary = llm.trace_summary(wall)
    assert 0 < summary["step_time_fraction_of_wall"] <= 1
    assert summary["knobs"]["prefill_max_seqs"]["engaged"]
    assert summary["knobs"]["long_prefill_token_threshold"]["engaged"]
    # The attention each bucket kind ran ("auto" resolved when the bucket compiled).
    attention = summary["attention"]
    assert attention["configured"] == "auto"
    expected = "cpu" if cpu_build.kernels_unavailable() is None else "xla"
    assert attention["decode"] == [expected] and attention["prefill"] == [expected]
    assert {(b["tokens"], b["seqs"], b["max_q_len"]) for b in attention["buckets"]} == {
        r.bucket for r in trace}
    assert sum(b["steps"] for b in attention["buckets"]) == len(trace)
    # the CPU's kernel: nothing a GPU record would vouch for, nothing unverified
    assert attention["verified"] is True and "verify_command" not in attention
    assert all(b["verified"] is None for b in attention["buckets"])
    llm.export_trace(tmp_path / "trace.jsonl")
    rows = [json.loads(line) for line in open(tmp_path / "trace.jsonl")]
    assert len(rows) == len(trace) and rows[0]["engaged"].keys() == trace[0].engaged.keys()


def test_default_model_is_used_when_model_is_none():
    llm = LLM(max_model_len=128)
    assert llm.model_dir == arcjax.default_model_path()
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length" and out.text


def test_engine_options_are_validated():
    from arcjax import EngineConfigError

    with pytest.raises(EngineConfigError, match="unknown engine option") as err:
        tiny_llm(max_batch_tokens=64)
    assert err.value.field == "max_batch_tokens"
    with pytest.raises(EngineConfigError, match="attention_impl"):
        tiny_llm(attention_impl="reference")
    with pytest.raises(EngineConfigError, match="max_model_len"):
        LLM(tiny_model_dir(ARCH), max_model_len=100_000)
    with pytest.raises(ValueError, match="chunk_tile"):  # the scheduler's own ConfigError
        tiny_llm(chunk_tile=256, max_num_batched_tokens=128)


def test_persistent_compilation_cache_is_written_then_hit(tmp_path):
    import os
    import subprocess
    import sys

    code = ("import arcjax; from arcjax.runtime.runner import enable_persistent_compilation_cache; "
            f"enable_persistent_compilation_cache({str(tmp_path)!r}); "
            f"llm = arcjax.LLM({tiny_model_dir(ARCH)!r}, block_size=8, num_kv_blocks=16, "
            "max_model_len=64, max_num_seqs=8, chunk_tile=64, max_num_batched_tokens=64); "
            "llm.warmup()")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    first = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert len(first) >= 2  # one entry per bucket executable (2 buckets here), at least
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == first  # all hits
