"""The fault contract of the engine core, stage by stage, serial and overlapped.

A failure inside a step (planning, packing, launch, collect, commit, detokenization, a
request's sink, the trace sink, advancing the step in flight) ends the requests that step
touched with finish_reason "error" and a message naming the stage, frees their blocks, and
the engine serves on: a request the step did not touch, and every later request, equal the
greedy reference. When the engine cannot go on (a failed KV reset, an error inside the
recovery, a broken loop) it is dead: every waiter gets `EngineDeadError`, later calls raise
it at once, `has_unfinished()` is false, and no thread spins.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import numpy as np
import pytest

import arcjax.engine.core
import scheduler
from arcjax import AsyncLLM, EngineDeadError, SamplingParams
from support.device_caches import device_cache
from support.engines import GEOMETRY
from support.engines import tiny_llm as _llm
from support.hf_models import tiny_model_dir

RUNNING = 8  # GEOMETRY's max_num_seqs: a 9th request waits, untouched by the step
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
STAGES = ["schedule", "pack", "launch", "collect", "commit", "trace sink", "advance",
          "detokenize", "sink"]


def _prompts(n=RUNNING + 2):
    rs = np.random.RandomState(21)
    return [rs.randint(3, 384, rs.randint(2, 20)).tolist() for _ in range(n)]


@device_cache
def _engine(overlapped: bool):
    return _llm(async_scheduling=overlapped)


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

    runner = llm.engine.runner
    targets = {"schedule": (scheduler, "schedule"), "pack": (runner, "prepare"),
               "launch": (runner, "launch"), "collect": (runner, "collect"),
               "commit": (scheduler, "commit"), "advance": (scheduler, "advance")}
    if stage in targets:
        obj, name = targets[stage]
        monkeypatch.setattr(obj, name, once(getattr(obj, name)))
    elif stage == "detokenize":
        monkeypatch.setattr(arcjax.engine.core, "append_token", once(
            arcjax.engine.core.append_token, lambda req, *a: req.request_id == victim))
    elif stage == "trace sink":
        llm.engine.trace_sink = once(lambda record: None)
    return fired


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_stage_ends_exactly_its_requests_and_the_engine_serves_on(
        monkeypatch, stage, overlapped):
    if stage == "advance" and not overlapped:
        pytest.skip("the serial step advances nothing")
    llm, reference, prompts = _engine(overlapped), _reference(), _prompts()
    sinks: dict[str, list] = {}
    ids = []
    for i, p in enumerate(prompts[:RUNNING]):
        sink = None
        if stage == "sink" and i == 5:
            def sink(out, box=sinks.setdefault("r5", [])):
                box.append(out)
                if len(box) == 2:
                    raise ConnectionError("the client went away")
        ids.append(llm.engine.add_request(p, GREEDY, f"r{i}", sink=sink))
    for _ in range(3):  # all eight decode; the ninth waits for a free row
        llm.step()
    llm.engine.add_request(prompts[RUNNING], GREEDY, "waiting")
    fired = _inject(monkeypatch, llm, stage, victim="r3")
    final = _drain(llm, sinks)
    monkeypatch.undo()
    llm.engine.trace_sink = None
    assert fired or stage == "sink"
    per_request = {"detokenize": {"r3"}, "sink": {"r5"}}.get(stage)
    failed = {rid for rid, o in final.items() if o.finish_reason == "error"}
    if per_request is not None:
        assert failed == per_request
    elif stage == "schedule":  # planning looked at every request
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
    later = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
    assert list(later.token_ids) == reference[-1]


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
