"""The fault contract of the engine core, stage by stage, serial and overlapped.

A failure inside a step (proposing drafts, planning, packing, launch, collect, appending
tokens, commit, building the trace record, the trace sink, applying the finishes,
advancing the step in flight; in a step launched in two parts, its forward, its masks and
its sampling; detokenization and a request's sink, per request) ends the requests that
step touched with finish_reason "error" and a message naming the stage, rolls back what
the step did to them, frees their blocks, and the engine serves on: a request the step did
not touch, and every later request, equal the greedy reference. When the engine cannot go
on (a failed KV reset, an error inside the recovery, a broken loop) it is dead: every
waiter gets `EngineDeadError`, later calls raise it at once, `has_unfinished()` is false,
and no thread spins.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import numpy as np
import pytest

import arcjax.engine.output_processor
import scheduler
from arcjax import LLM, AsyncLLM, EngineDeadError, SamplingParams
from arcjax.engine.request_state import RequestState
from support.device_caches import device_cache
from support.engines import GEOMETRY, SCHEDULES
from support.engines import tiny_llm as _llm
from support.hf_models import tiny_model_dir, tiny_model_with_tokenizer

STRUCTURED_GEOMETRY = {**GEOMETRY, **SCHEDULES[0]}  # tests/test_structured_engine.py's
RUNNING = 8  # GEOMETRY's max_num_seqs: a 9th request waits, untouched by the step
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
STAGES = ["propose", "schedule", "pack", "launch", "collect", "append", "commit",
          "trace record", "trace sink", "finish", "advance", "detokenize", "sink"]
# A step launched in two parts (overlapped, constrained rows fed by the step in flight)
SPLIT_STAGES = ["launch", "mask", "launch sampling"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None}
# 24 tokens of at most a few characters never complete it: constrained rows run to length
LONG_REGEX = {"regex": "[a-z ]{300}"}


def _prompts(n=RUNNING + 2):
    rs = np.random.RandomState(21)
    return [rs.randint(3, 384, rs.randint(2, 20)).tolist() for _ in range(n)]


@device_cache
def _engine(overlapped: bool, speculative: bool = False):
    """The engine of a stage's test: with n-gram speculation for "propose" (exact: the same
    greedy tokens)."""
    return _llm(async_scheduling=overlapped, speculative_config=NGRAM if speculative else None)


@functools.lru_cache(maxsize=None)
def _reference() -> list[list[int]]:
    outs = _engine(False).generate(_prompts(), GREEDY, use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def _drain(llm, sinks: dict) -> dict:
    final = {}
    for _ in range(500):
        for o in llm.step():
            if o.finished:
                final[o.request_id] = o
        for rid, outs in sinks.items():
            if outs and outs[-1].finished:
                final[rid] = outs[-1]
        if not llm.has_unfinished():
            return final
    raise AssertionError("requests did not finish")


def _inject(monkeypatch, llm, stage: str, victim: str):
    """Makes `stage` fail once (for `victim` only, for per-request stages)."""
    fired = []

    def once(real, test=lambda *a, **k: True):
        def flaky(*args, **kwargs):
            if not fired and test(*args, **kwargs):
                fired.append(stage)
                raise RuntimeError(f"injected {stage} failure")
            return real(*args, **kwargs)
        return flaky

    core, runner = llm.engine.core, llm.engine.runner
    targets = {"propose": (core.speculator, "drafts"), "schedule": (scheduler, "schedule"),
               "pack": (runner, "prepare"), "launch": (runner, "launch"),
               "collect": (runner, "collect"), "append": (core.outputs, "append"),
               "commit": (scheduler, "commit"), "trace record": (core.trace, "step_record"),
               "finish": (core.trace, "sampled"), "advance": (scheduler, "advance")}
    if stage in targets:
        obj, name = targets[stage]
        monkeypatch.setattr(obj, name, once(getattr(obj, name)))
    elif stage == "detokenize":
        monkeypatch.setattr(arcjax.engine.output_processor, "append_token", once(
            arcjax.engine.output_processor.append_token,
            lambda req, *a: req.request_id == victim))
    elif stage == "trace sink":
        llm.engine.trace_sink = once(lambda record: None)
    return fired


def _run_with_fault(monkeypatch, llm, stage: str, params: list, inject):
    """Eight requests decoding and a ninth waiting for a row, then `inject()` arms the
    fault (returning what fired) and the engine runs until every request finished.
    Returns (the eight ids, what fired, the final output of every request)."""
    prompts = _prompts()
    sinks: dict[str, list] = {}
    ids = []
    for i, p in enumerate(prompts[:RUNNING]):
        sink = None
        if stage == "sink" and i == 5:
            def sink(out, box=sinks.setdefault("r5", [])):
                box.append(out)
                if len(box) == 2:
                    raise ConnectionError("the client went away")
        ids.append(llm.engine.add_request(p, params[i], f"r{i}", sink=sink))
    for _ in range(3):  # all eight decode; the ninth waits for a free row
        llm.step()
    llm.engine.add_request(prompts[RUNNING], params[RUNNING], "waiting")
    fired = inject()
    final = _drain(llm, sinks)
    monkeypatch.undo()
    llm.engine.trace_sink = None
    return ids, fired, final


def _check_outcome(llm, stage: str, ids: list, final: dict, reference: list, params: list):
    """The requests the failed stage touched ended with "error" naming it, the others (and
    a later request) equal the reference, and nothing is left behind."""
    per_request = {"detokenize": {"r3"}, "sink": {"r5"}}.get(stage)
    failed = {rid for rid, o in final.items() if o.finish_reason == "error"}
    if per_request is not None:
        assert failed == per_request
    elif stage in ("propose", "schedule"):  # planning looked at every request
        assert failed == set(ids) | {"waiting"}
    else:
        assert failed == set(ids)
    name = {"sink": "output sink", "detokenize": "output processing"}.get(stage, stage)
    for rid in failed:
        assert name in final[rid].error and final[rid].finished
    for i, rid in enumerate(ids + ["waiting"]):
        if rid not in failed:
            assert final[rid].finish_reason == "length"
            assert list(final[rid].token_ids) == reference[i]
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.requests
    assert llm.engine.state.unfilled is None and not llm.engine.state.in_flight
    llm.engine.check_trace()
    assert any(r.error and name.split()[0] in r.error for r in llm.engine.trace) or \
        per_request is not None
    later = llm.generate([_prompts()[-1]], params[-1], use_tqdm=False)[0]
    assert list(later.token_ids) == reference[-1]


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_stage_ends_exactly_its_requests_and_the_engine_serves_on(
        monkeypatch, stage, overlapped):
    if stage == "advance" and not overlapped:
        pytest.skip("the serial step advances nothing")
    llm, params = _engine(overlapped, stage == "propose"), [GREEDY] * len(_prompts())
    ids, fired, final = _run_with_fault(monkeypatch, llm, stage, params,
                                        lambda: _inject(monkeypatch, llm, stage, victim="r3"))
    assert fired or stage == "sink"
    _check_outcome(llm, stage, ids, final, _reference(), params)


@device_cache
def _structured_engine(overlapped: bool):
    return LLM(tiny_model_with_tokenizer(), **STRUCTURED_GEOMETRY, async_scheduling=overlapped)


def _structured_params() -> list[SamplingParams]:
    """Every other request constrained (the waiting one and the later one too)."""
    constrained = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                 structured_outputs=LONG_REGEX)
    return [constrained if i % 2 == 0 else GREEDY for i in range(len(_prompts()))]


@functools.lru_cache(maxsize=None)
def _structured_reference() -> list[list[int]]:
    outs = _structured_engine(False).generate(_prompts(), _structured_params(), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("stage", SPLIT_STAGES)
def test_a_failed_stage_of_a_step_launched_in_two_parts(monkeypatch, stage):
    """Overlapped with constrained rows fed by the step in flight: the step's forward is
    launched at once (`launch_forward`), its masks filled and its sampling launched once
    the step before is committed (`launch_sampling`). A failure of any of the three ends
    the requests of the steps it touched, and the engine serves on."""
    llm, params = _structured_engine(True), _structured_params()
    core, runner = llm.engine.core, llm.engine.runner
    calls = {"launch forward": 0, "launch sampling": 0}

    def count(name, real):
        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return counted

    def inject():
        fired = []
        target = {"launch": (runner, "launch_forward"), "launch sampling": (
            runner, "launch_sampling"), "mask": (core.structured, "bitmask")}[stage]
        real = getattr(*target)

        def flaky(*args, **kwargs):  # "mask": only the masks of a step launched in two parts
            pending = core.in_flight is not None and core.in_flight.pending is not None
            if not fired and (stage != "mask" or pending):
                fired.append(stage)
                raise RuntimeError(f"injected {stage} failure")
            return real(*args, **kwargs)

        monkeypatch.setattr(*target, flaky)
        return fired

    monkeypatch.setattr(runner, "launch_forward", count("launch forward", runner.launch_forward))
    monkeypatch.setattr(runner, "launch_sampling", count("launch sampling",
                                                         runner.launch_sampling))
    ids, fired, final = _run_with_fault(monkeypatch, llm, stage, params, inject)
    assert fired == [stage]
    assert calls["launch forward"] > 0 and calls["launch sampling"] > 0  # the split path ran
    _check_outcome(llm, stage, ids, final, _structured_reference(), params)


def test_a_failed_finish_stage_rolls_back_the_finishes_it_applied(monkeypatch):
    """The last stage fails after it ended some requests of the step ("length"): they are
    rolled back with the step's tokens and end with "error"; the tally of sampled tokens
    (`check_trace`) still agrees with every output."""
    llm = _engine(False)
    prompts = _prompts()
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [llm.engine.add_request(p, short if i < 3 else GREEDY, f"f{i}")
           for i, p in enumerate(prompts[:RUNNING])]
    ended = []
    real = RequestState.finish

    def finish(req, reason, now, error=None):
        if reason == "length":
            ended.append(req.request_id)
            if len(ended) == 2:  # the first one was finished already in this stage
                raise RuntimeError("injected finish failure")
        return real(req, reason, now, error)

    monkeypatch.setattr(RequestState, "finish", finish)
    final = _drain(llm, {})
    monkeypatch.undo()
    assert len(ended) >= 2
    failed = {rid for rid, o in final.items() if o.finish_reason == "error"}
    assert failed == set(ids)  # the step held all eight
    for rid in ids[:3]:  # rolled back: without the failed step's token
        assert "finish failed" in final[rid].error and len(final[rid].token_ids) == 5
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.requests
    llm.engine.check_trace()
    later = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
    assert list(later.token_ids) == _reference()[-1]


def test_a_failed_kv_reset_kills_the_engine_and_every_call_says_so(monkeypatch):
    llm = _llm(async_scheduling=False)
    runner = llm.engine.runner
    stream = llm.stream(_prompts()[:3], GREEDY)
    assert not next(stream).finished  # a waiter in the middle of its requests
    monkeypatch.setattr(runner, "collect", lambda h: (_ for _ in ()).throw(
        RuntimeError("device lost")))
    monkeypatch.setattr(runner, "reset_cache", lambda: (_ for _ in ()).throw(
        RuntimeError("cannot allocate the cache")))
    with pytest.raises(EngineDeadError, match="cannot allocate the cache") as err:
        list(stream)
    assert not llm.has_unfinished() and not llm.engine.requests
    for call in (lambda: llm.add_request([5, 6], GREEDY), llm.step,
                 lambda: llm.generate([[5, 6]], GREEDY, use_tqdm=False),
                 lambda: list(llm.stream([[5, 6]], GREEDY)), lambda: llm.abort("0"),
                 lambda: llm.engine.check([5, 6], GREEDY)):
        with pytest.raises(EngineDeadError) as again:
            call()
        assert again.value is err.value


def test_an_error_inside_the_recovery_kills_the_engine(monkeypatch):
    llm = _llm(async_scheduling=True)
    ids = [llm.add_request(p, GREEDY) for p in _prompts()[:2]]
    llm.step()
    monkeypatch.setattr(scheduler, "commit", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("commit bug")))
    monkeypatch.setattr(scheduler, "abandon", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("abandon bug")))
    with pytest.raises(EngineDeadError, match="abandon bug"):
        for _ in range(5):
            llm.step()
    assert ids and not llm.has_unfinished()
    with pytest.raises(EngineDeadError):
        llm.add_request([5], GREEDY)


def test_async_llm_waiters_get_engine_dead_and_the_thread_ends(monkeypatch):
    llm = AsyncLLM(tiny_model_dir("LlamaForCausalLM"), **GEOMETRY, async_scheduling=False)
    started = threading.Event()
    real = llm.engine.runner.collect

    def dying(handle):
        if started.is_set():
            raise RuntimeError("device lost")
        return real(handle)

    monkeypatch.setattr(llm.engine.runner, "collect", dying)
    monkeypatch.setattr(llm.engine.runner, "reset_cache", lambda: (_ for _ in ()).throw(
        RuntimeError("no memory for a new cache")))
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def waiter(prompt):
        outs = []
        async for out in llm.generate(prompt, params):
            outs.append(out)
            started.set()
        return outs

    async def main():
        results = await asyncio.wait_for(asyncio.gather(
            *(waiter(p) for p in _prompts()[:4]), return_exceptions=True), 60)
        with pytest.raises(EngineDeadError):  # at once, after the death
            await asyncio.wait_for(waiter([5, 6]), 5)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "no memory" in str(r) for r in results)
    llm._thread.join(10)
    assert not llm._thread.is_alive() and not llm.is_running()
    assert llm.num_unfinished == 0 and llm.step_errors == 1
    llm.shutdown()
