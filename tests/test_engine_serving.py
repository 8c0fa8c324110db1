"""The engine as a server uses it: threads, sinks, lifetimes, failed steps, typed validation.
One regression test per finding of the hostile-user review (see WORKSPACE.md, "Threading and
lifetimes")."""

import threading

import numpy as np
import pytest

from arcjax import LLM, EngineConfigError, RequestError, SamplingParams, SamplingParamsError
from arcjax.errors import DuplicateRequestError, UnknownRequestError
from support.engines import run_to_end
from support.hf_models import hf_greedy, tiny_model_dir, tiny_model_with_tokenizer

ARCH = "LlamaForCausalLM"
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto", chunk_tile=16, max_num_batched_tokens=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _llm(**options):
    return LLM(tiny_model_dir(ARCH), **{**GEOMETRY, **options})


def _prompt(i, n=None):
    rs = np.random.RandomState(100 + i)
    return rs.randint(3, 384, n or rs.randint(2, 30)).tolist()


# 1. requests added from another thread while one thread steps are never lost
def test_add_from_other_threads_while_one_thread_steps():
    llm = _llm()
    expected = {f"t{i}": hf_greedy(tiny_model_dir(ARCH), _prompt(i), 6)[:6] for i in range(6)}
    final, done = {}, threading.Event()

    def stepper():
        while not done.is_set() or llm.has_unfinished():
            for o in llm.step():
                if o.finished:
                    final[o.request_id] = o

    def submitter(k):
        for j in range(30):
            llm.add_request(_prompt(j % 6), GREEDY, request_id=f"s{k}-{j}")

    t = threading.Thread(target=stepper)
    t.start()
    subs = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for s in subs:
        s.start()
    for s in subs:
        s.join()
    done.set()
    t.join(timeout=300)
    assert not t.is_alive() and not llm.has_unfinished()
    assert len(final) == 120 and all(o.finish_reason == "length" for o in final.values())
    for rid, o in final.items():
        assert list(o.token_ids) == expected[f"t{int(rid.split('-')[1]) % 6}"]
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.requests
    llm.engine.check_trace()


def test_abort_from_another_thread_stops_generation():
    llm = _llm()
    rid = llm.add_request(_prompt(1), SamplingParams(max_tokens=200, temperature=0,
                                                     ignore_eos=True))
    llm.step()
    t = threading.Thread(target=llm.abort, args=(rid,))
    t.start()
    t.join()
    outs = run_to_end(llm)
    final = outs[rid][-1]
    assert final.finish_reason == "abort" and len(final.token_ids) < 10
    assert llm.engine.blocks_in_use() == 0


# 2. a bad request is refused at submission; it never blocks the others
@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=2**31), "top_k"), (dict(stop=[1]), "stop"), (dict(top_k=True), "top_k"),
    (dict(temperature="1"), "temperature"), (dict(temperature=None), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(seed="1"), "seed"),
    (dict(seed=1.5), "seed"), (dict(ignore_eos="no"), "ignore_eos"),
    (dict(max_tokens=True), "max_tokens"), (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(top_p=float("nan")), "top_p")])
def test_sampling_params_are_type_checked(kwargs, field):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_stop_none_means_no_stop_strings():
    assert SamplingParams(stop=None).stop == ()


@pytest.mark.parametrize("prompt", [[2.7, 5], [True, 5], b"abc", [5, "6"], [[1, 2]], 42])
def test_token_ids_must_be_real_ints(prompt):
    llm = _llm()
    with pytest.raises(RequestError) as err:
        llm.add_request(prompt, GREEDY)
    assert err.value.field == "prompt" and not llm.has_unfinished()


def test_numpy_prompts_and_unencodable_text():
    llm = _llm()
    ids = np.array(_prompt(3), np.int64)
    out = llm.generate(ids, GREEDY, use_tqdm=False)  # one prompt as an array
    assert list(out[0].token_ids) == hf_greedy(tiny_model_dir(ARCH), ids.tolist(), 6)
    outs = llm.generate([ids, np.array(_prompt(4), np.int32)], GREEDY, use_tqdm=False)
    assert len(outs) == 2
    with pytest.raises(RequestError, match="array must be 1-D integers"):
        llm.add_request(np.array([1.5, 2.0]), GREEDY)
    text_llm = LLM(tiny_model_with_tokenizer(ARCH), **GEOMETRY)
    with pytest.raises(RequestError, match="cannot be encoded") as err:
        text_llm.add_request("lone \ud800 surrogate", GREEDY)
    assert err.value.field == "prompt"


@pytest.mark.parametrize("options, field", [
    (dict(block_size=0), "block_size"), (dict(block_size=12), "block_size"),
    (dict(max_model_len=0), "max_model_len"), (dict(dtype="int8"), "dtype"),
    (dict(kv_memory_fraction=0), "kv_memory_fraction"), (dict(policy="fastest"), "policy"),
    (dict(max_num_seqs=True), "max_num_seqs"), (dict(trace_capacity=0), "trace_capacity")])
def test_engine_options_are_validated_before_loading(options, field):
    with pytest.raises(EngineConfigError) as err:
        LLM(tiny_model_dir(ARCH), **options)
    assert err.value.field == field


def test_env_knobs_are_honoured_and_explicit_options_win(monkeypatch):
    from arcjax import EngineConfig

    monkeypatch.setenv("ARC_PREFILL_MAX_SEQS", "3")
    monkeypatch.setenv("ARC_PREFILL_FLOOR_STEPS", "2")
    cfg = EngineConfig.from_options(None, prefill_floor_steps=0)
    assert (cfg.prefill_max_seqs, cfg.prefill_floor_steps) == (3, 0)
    monkeypatch.setenv("ARC_PREFILL_MAX_SEQS", "three")
    with pytest.raises(EngineConfigError) as err:
        EngineConfig.from_options(None)
    assert err.value.field == "prefill_max_seqs"


# 3. a failed step is undone for the others: its requests error out, the rest go on
def test_failed_device_step_finishes_its_requests_with_error_and_others_continue(monkeypatch):
    llm = _llm()
    runner = llm.engine.runner
    real_launch = runner.launch
    a = llm.add_request(_prompt(1), GREEDY)
    llm.step()
    doomed = llm.add_request(_prompt(2), GREEDY)
    aborted = llm.add_request(_prompt(3), GREEDY)
    llm.abort(aborted)  # pending abort: must survive the failing step
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", flaky)
    outs = run_to_end(llm)
    assert outs[aborted][-1].finish_reason == "abort"
    assert outs[a][-1].finish_reason == "error" and "injected" in outs[a][-1].error
    assert outs[doomed][-1].finish_reason == "error"
    later = llm.generate([_prompt(4)], GREEDY, use_tqdm=False)[0]
    assert list(later.token_ids) == hf_greedy(tiny_model_dir(ARCH), _prompt(4), 6)
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    assert any(r.error for r in llm.engine.trace)


@pytest.mark.parametrize("overlapped", [False, True])
def test_failed_commit_rolls_tokens_back(monkeypatch, overlapped):
    """The failing commit's tokens are rolled back, its request errors, nothing stays in
    flight and the engine serves on. Serial, the commit that fails is the second step's;
    overlapped, the third step commits the second (the first step's commit ran in the
    second)."""
    import scheduler

    llm = _llm(async_scheduling=overlapped)
    rid = llm.add_request(_prompt(5), GREEDY)
    for _ in range(2 if overlapped else 1):
        llm.step()
    real = scheduler.commit
    monkeypatch.setattr(scheduler, "commit", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("injected commit failure")))
    outs = llm.step()
    monkeypatch.setattr(scheduler, "commit", real)
    final = [o for o in outs if o.request_id == rid][-1]
    assert final.finish_reason == "error"
    assert len(final.token_ids) == 1  # the prefill's token only: the failed step's was rolled back
    llm.engine.check_trace()
    assert llm.engine.blocks_in_use() == 0
    assert not llm.engine.state.in_flight and llm.engine.state.unfilled is None
    later = llm.generate([_prompt(6)], GREEDY, use_tqdm=False)[0]
    assert list(later.token_ids) == hf_greedy(tiny_model_dir(ARCH), _prompt(6), 6)


# 4. memory: finished requests are released, the trace is a ring, ids are reusable
def test_finished_requests_are_released_and_the_trace_is_bounded():
    llm = _llm(trace_capacity=5)
    llm.generate([_prompt(i) for i in range(6)], GREEDY, use_tqdm=False)
    assert not llm.engine.requests and not llm.has_unfinished()
    assert len(llm.engine.trace) == 5 and llm.engine.num_steps > 5
    llm.add_request(_prompt(1), GREEDY, request_id="again")
    run_to_end(llm)
    llm.add_request(_prompt(1), GREEDY, request_id="again")  # reusable once finished
    with pytest.raises(DuplicateRequestError):
        llm.add_request(_prompt(1), GREEDY, request_id="again")
    run_to_end(llm)


# 5. outputs go to their owner, whoever steps
def test_generate_does_not_swallow_online_outputs_and_stream_aborts_when_abandoned():
    llm = _llm()
    online = llm.add_request(_prompt(7), GREEDY)
    outs = llm.generate([_prompt(8)], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] != [online]
    mine = run_to_end(llm)[online]
    assert mine[-1].finished and list(mine[-1].token_ids) == hf_greedy(
        tiny_model_dir(ARCH), _prompt(7), 6)
    stream = llm.stream([_prompt(9), _prompt(10)], SamplingParams(max_tokens=100, temperature=0,
                                                                  ignore_eos=True))
    next(stream)
    assert llm.has_unfinished()
    stream.close()  # the caller walks away
    assert not llm.has_unfinished() and llm.engine.blocks_in_use() == 0


def test_generate_that_raises_aborts_its_requests(monkeypatch):
    llm = _llm()
    calls = []
    real = llm.engine.run_step

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(llm.engine, "run_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([_prompt(1), _prompt(2)], SamplingParams(max_tokens=50, temperature=0,
                                                              ignore_eos=True), use_tqdm=False)
    assert not llm.has_unfinished() and llm.engine.blocks_in_use() == 0


# 6. auto ids never collide with ids a user chose
def test_auto_ids_skip_ids_in_use():
    llm = _llm()
    llm.add_request(_prompt(1), GREEDY, request_id="0")
    llm.add_request(_prompt(1), GREEDY, request_id="1")
    auto = llm.add_request(_prompt(2), GREEDY)
    assert auto not in ("0", "1")
    with pytest.raises(UnknownRequestError):
        llm.abort("never-added")
    with pytest.raises(RequestError) as err:  # reserved for the ids of n > 1 samples
        llm.add_request(_prompt(2), GREEDY, request_id="a\x1fn0")
    assert err.value.field == "request_id"
    run_to_end(llm)


def test_aborting_twice_before_a_step_is_harmless():
    llm = _llm()
    rid = llm.add_request(_prompt(1), GREEDY)
    llm.engine._step_lock.acquire()  # a step is "running": both aborts wait in the inbox
    try:
        llm.abort(rid)
        llm.abort(rid)
    finally:
        llm.engine._step_lock.release()
    outs = llm.step()
    assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert llm.engine.blocks_in_use() == 0 and not llm.has_unfinished()
