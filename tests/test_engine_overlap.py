"""Overlapped scheduling in the engine (`async_scheduling`): step N+1 is planned and launched
before step N's tokens reach the host, its placeholder input ids fed on the device.

Exactness: every test model and schedule gives the same greedy tokens with the option on and
off, equal to transformers; seeded sampling with penalties, min_tokens, stop ids and logprobs
gives the same tokens and log-probabilities; failures and aborts while two steps are in
flight leave no block held and the engine serving.
"""

import numpy as np
import pytest

from arcjax import SamplingParams
from arcjax.engine.trace import device_idle_gaps
from support.engines import GREEDY, SCHEDULES, engine_prompts, expected_greedy, run_to_end
from support.engines import tiny_llm
from support.hf_models import ARCHS, hf_greedy, tiny_model_dir


def _generate(llm, params):
    outs = llm.generate(engine_prompts(), params, use_tqdm=False)
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    return outs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("schedule", range(len(SCHEDULES)))
def test_greedy_identical_on_and_off_and_equal_to_transformers(arch, schedule):
    if arch != "LlamaForCausalLM" and schedule not in (0, 3):
        pytest.skip("every schedule on one model, two schedules on the others (suite time)")
    options = SCHEDULES[schedule]
    got = {}
    for on in (False, True):
        llm = tiny_llm(arch, async_scheduling=on, **options)
        assert llm.engine.async_scheduling is on
        got[on] = [list(o.token_ids) for o in _generate(llm, GREEDY)]
        if "num_kv_blocks" in options:
            assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0
    assert got[True] == got[False] == expected_greedy(arch)


def test_stops_mid_flight_drop_the_next_steps_row_and_keep_outputs():
    """Requests stopping on a token (the host learns it one step late) and by max_tokens at
    different steps: the same outputs, finish reasons and logprobs either way."""
    prompts = engine_prompts()
    free = tiny_llm(async_scheduling=False).generate(prompts, GREEDY, use_tqdm=False)
    params = [SamplingParams(max_tokens=3 + i, temperature=0, ignore_eos=True, logprobs=2,
                             stop_token_ids=(o.token_ids[(3 * i) % 8],))
              for i, o in enumerate(free)]
    runs = {}
    for on in (False, True):
        outs = _generate(tiny_llm(async_scheduling=on, chunk_tile=16, max_num_batched_tokens=64),
                         params)
        runs[on] = [(list(o.token_ids), o.finish_reason,
                     [{t: round(lp.logprob, 5) for t, lp in e.items()} for e in o.outputs[0].logprobs]
                         )
                    for o in outs]
    assert runs[True] == runs[False]
    assert {r[1] for r in runs[True]} == {"stop", "length"}


def test_seeded_sampling_with_penalties_and_n_is_identical():
    params = [SamplingParams(max_tokens=6 + i % 3, temperature=0.9, top_p=0.95, seed=100 + i,
                             presence_penalty=0.4, frequency_penalty=0.2,
                             repetition_penalty=1.1, min_tokens=3, n=1 + i % 2,
                             stop_token_ids=(7, 11, 13), logprobs=1)
              for i in range(len(engine_prompts()))]
    runs = {}
    for on in (False, True):
        outs = _generate(tiny_llm(async_scheduling=on, chunk_tile=16, max_num_batched_tokens=64),
                         params)
        runs[on] = [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs]
    assert runs[True] == runs[False]


def test_steps_overlap_and_the_trace_measures_idle_gaps():
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64, async_scheduling=True)
    llm.engine.runner.watch_completion = True
    _generate(llm, GREEDY)
    trace = [r for r in llm.engine.trace]
    assert all(r.dispatched is not None and r.ready is not None for r in trace)
    # overlapped: some step was dispatched before the previous one's tokens were read
    assert any(b.dispatched < a.end for a, b in zip(trace, trace[1:]))
    gaps = device_idle_gaps(trace)
    # each gap is the time the device waited for the next dispatch, and they fit the wall
    assert gaps == [max(0.0, b.dispatched - a.ready) for a, b in zip(trace, trace[1:])]
    assert sum(gaps) < trace[-1].end - trace[0].start
    summary = llm.trace_summary(trace[-1].end - trace[0].start)
    assert summary["device_idle_gap_s"]["watched"]
    assert 0 < summary["step_time_fraction_of_wall"] <= 1
    llm.engine.runner.watch_completion = False


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failure_with_two_steps_in_flight(monkeypatch, where):
    """A failed launch errors its step's requests; a failed collect (the device failed:
    its KV, and blocks already cached from it, are unknown) resets the KV cache and the
    prefix cache, erroring every running request. Either way the engine serves on."""
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64, async_scheduling=True)
    runner = llm.engine.runner
    real = getattr(runner, where)
    prompts = engine_prompts()
    a = llm.add_request(prompts[0], GREEDY)
    llm.step()
    llm.step()  # a decodes, a step in flight
    b = llm.add_request(prompts[1], GREEDY)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, where, flaky)
    outs = run_to_end(llm)
    monkeypatch.setattr(runner, where, real)
    assert outs[a][-1].finish_reason == "error" and "injected" in outs[a][-1].error
    if where == "collect":  # b was in the step launched behind the failed one
        assert outs[b][-1].finish_reason == "error"
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.state.in_flight
    assert llm.engine.state.unfilled is None
    if where == "collect":
        assert not llm.engine.state.pool.cached_free_blocks()  # the prefix cache forgotten
    later = llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0]
    assert list(later.token_ids) == hf_greedy(tiny_model_dir(), prompts[4], 8)
    llm.engine.check_trace()


def test_abort_while_a_step_is_in_flight_frees_blocks_at_once():
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64, async_scheduling=True)
    prompts = engine_prompts()
    ids = [llm.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
           for p in prompts[:3]]
    for _ in range(4):
        llm.step()
    assert llm.engine.core.in_flight is not None
    llm.abort(ids[1])
    held = llm.engine.blocks_in_use()
    outs = run_to_end(llm)
    assert outs[ids[1]][-1].finish_reason == "abort"
    assert [outs[i][-1].finish_reason for i in (ids[0], ids[2])] == ["length", "length"]
    assert held > 0 and llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()


def test_option_is_validated_and_reported():
    from arcjax.errors import EngineConfigError
    from arcjax.engine.engine_config import EngineConfig

    with pytest.raises(EngineConfigError) as err:
        EngineConfig.from_options(None, async_scheduling="yes")
    assert err.value.field == "async_scheduling"
    assert EngineConfig.from_options(None).async_scheduling is None  # auto
    from arcjax.engine.build import _overlap_pays

    # auto: on with an accelerator or more than one core (this suite's CI machine has two)
    np.testing.assert_equal(tiny_llm().engine.async_scheduling, _overlap_pays())


def test_bench_throughput_script_reports_both_arms(tmp_path):
    """scripts/bench_throughput.py on a tiny model: both arms run, their outputs agree (and
    agree with transformers), idle gaps, the lone-request figure and the prefill/decode split
    are reported."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_throughput.py"
    out = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, str(script), f"--model={tiny_model_dir()}", "--num_requests=6",
         "--prompt_len=4,40", "--output_len=2,12", "--max_num_seqs=8",
         "--max_num_batched_tokens=128", "--hf_batch=4", "--lone", "--lone_prompt=16",
         "--lone_tokens=6", "--lone_repeats=2", "--phase_split", f"--out={out}"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    arms = res["arms"]
    assert set(arms) == {"async_scheduling=true", "async_scheduling=false"}
    for arm in arms.values():
        assert arm["outputs_equal_first_arm"] and arm["identical_to_transformers"] == 6
        # the device's idle time between steps is a part of the wall time (in seconds)
        assert 0 <= arm["idle_fraction_of_wall"] < 1 and len(arm["lone_tpot_ms"]) == 2
        assert arm["tok_s_median"] > 0 and arm["ratio_vs_transformers"] > 0
        split = arm["phase_split"]  # the prompt-only runs' median, and the rest of the wall
        assert len(split["prefill_s_all"]) == 1 and split["prefill_s"] > 0
        # the split is of the measured run (its wall and tokens), not of another one
        assert split["wall_s"] * arm["tok_s_median"] == pytest.approx(arm["output_tokens"])
        after_first = arm["output_tokens"] - res["num_requests"]
        assert after_first > 0 and split["decode_tok_s"] == pytest.approx(
            after_first / split["decode_s"])


def test_a_failing_trace_sink_fails_its_step_and_is_detached():
    """A trace sink that raises is a failed step (its requests end with "error"); it is
    detached, so every later step runs and its requests equal the reference."""
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64, async_scheduling=True)

    def broken(record):
        raise OSError("disk full")

    llm.engine.trace_sink = broken
    outs = _generate(llm, GREEDY)
    failed = [o for o in outs if o.finish_reason == "error"]
    assert failed and all("trace sink failed" in o.error and "disk full" in o.error
                          for o in failed)
    for o, want in zip(outs, expected_greedy()):
        assert o.finish_reason == "error" or list(o.token_ids) == want
    assert llm.engine.trace_sink is None and "disk full" in llm.engine.trace_sink_error
    assert [list(o.token_ids) for o in _generate(llm, GREEDY)] == expected_greedy()


def test_fail_all_with_a_step_in_flight_leaves_a_clean_state():
    llm = tiny_llm(chunk_tile=16, max_num_batched_tokens=64, async_scheduling=True)
    prompts = engine_prompts()
    for p in prompts[:3]:
        llm.add_request(p, GREEDY)
    llm.step()
    llm.step()
    assert llm.engine.core.in_flight is not None
    llm.engine.fail_all("stopped by the test")
    assert not llm.engine.has_unfinished() and llm.engine.core.in_flight is None
    assert not llm.engine.state.in_flight and llm.engine.state.unfilled is None
    assert llm.engine.blocks_in_use() == 0
    out = llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0]
    assert list(out.token_ids) == hf_greedy(tiny_model_dir(), prompts[4], 8)


def test_a_reused_id_right_after_an_abort_samples_like_a_fresh_request():
    """The per-request random counter counts an in-flight token only for rows that feed
    one, not by id: a new request reusing an aborted id gets a fresh counter."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    prompt = engine_prompts()[1]
    fresh = tiny_llm(async_scheduling=False).generate([prompt], params, use_tqdm=False)[0]
    llm = tiny_llm(async_scheduling=True)
    llm.add_request(prompt, params, request_id="x")
    for _ in range(3):
        llm.step()
    llm.abort("x")
    llm.step()  # the abort's output
    llm.add_request(prompt, params, request_id="x")
    outs = run_to_end(llm)
    assert list(outs["x"][-1].token_ids) == list(fresh.token_ids)
