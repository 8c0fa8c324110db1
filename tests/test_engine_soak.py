"""A bounded soak of the serving engine: thousands of short requests from several threads and
many asyncio tasks, with aborts, bad requests, early disconnects and a KV cache small enough to
force preemption. Outputs must equal a sequential reference, nothing may leak."""

import asyncio
import gc
import random
import threading
import time
import tracemalloc

import pytest

from arcjax import AsyncLLM, LLM, RequestError, SamplingParams
from support.hf_models import tiny_model_dir
from support.soak_workload import ARCH, GEOMETRY, MAX_NEW, NUM_PROMPTS, reference  # noqa: F401
from support.soak_workload import soak_prompts

SYNC_THREADS, ROUNDS, ROUND = 4, 7, 70
WARM_ROUNDS = 4  # rounds before the heap is measured (paths warm, containers at size)
SYNC_PER_THREAD = ROUNDS * ROUND
ASYNC_TASKS, ASYNC_PER_TASK = 64, 16
ABORT_RATE, BAD_RATE, DISCONNECT_RATE = 0.10, 0.03, 0.10


def _check(out, prompt_index, reference):
    want = reference[prompt_index]
    got = list(out.token_ids)
    if out.finish_reason == "length":
        assert got == want[:len(got)] and len(got) == out.metrics.token_times.__len__()
    elif out.finish_reason == "abort":
        assert got == want[:len(got)]
    else:
        raise AssertionError(f"unexpected finish {out.finish_reason}: {out.error}")


def test_soak_sync_threads_then_async_tasks(reference):  # noqa: F811
    prompts = soak_prompts()
    t_start = time.perf_counter()
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY)
    llm.warmup()
    # NOTE: nothing here grows per request (ids encode what the checker needs; finals are
    # checked on arrival and dropped), so the heap measurement sees the engine's growth only.
    stats = {"requests": 0, "aborted": 0, "bad": 0, "finals": 0}
    seen = bytearray(SYNC_THREADS * SYNC_PER_THREAD)
    lock, done, errors = threading.Lock(), threading.Event(), []
    preempted = [0]  # preemptions seen by the trace sink (the trace ring keeps only 64 steps)
    llm.engine.trace_sink = lambda r: preempted.__setitem__(0, preempted[0]
                                                              + len(r.engaged["preempted"]))

    def on_final(out):
        k, j, i, n = map(int, out.request_id.split("-"))
        try:
            _check(out, i, reference)
            assert out.finish_reason != "length" or len(out.token_ids) == n
            assert not seen[k * SYNC_PER_THREAD + j], f"{out.request_id} finished twice"
        except AssertionError as e:
            errors.append(str(e))
        seen[k * SYNC_PER_THREAD + j] = 1
        stats["finals"] += 1

    def stepper():
        while not done.is_set() or llm.has_unfinished():
            for out in llm.step():
                if out.finished:
                    on_final(out)

    def submitter(k, r):
        rs = random.Random(1000 * r + k)
        for j in range(ROUND * r, ROUND * (r + 1)):
            if rs.random() < BAD_RATE:
                with pytest.raises(RequestError):
                    llm.add_request([1.5, 2], SamplingParams(max_tokens=2))
                with lock:
                    stats["bad"] += 1
                seen[k * SYNC_PER_THREAD + j] = 1
                continue
            i, n = rs.randrange(NUM_PROMPTS), rs.randrange(1, MAX_NEW + 1)
            rid = llm.add_request(prompts[i], SamplingParams(max_tokens=n, temperature=0,
                                                             ignore_eos=True),
                                  request_id=f"{k}-{j}-{i}-{n}")
            with lock:
                stats["requests"] += 1
            if rs.random() < ABORT_RATE:
                try:
                    llm.abort(rid)
                    with lock:
                        stats["aborted"] += 1
                except RequestError:  # finished first
                    pass

    def round_(r):  # SYNC_THREADS threads submit ROUND requests each, concurrently
        subs = [threading.Thread(target=submitter, args=(k, r)) for k in range(SYNC_THREADS)]
        for t in subs:
            t.start()
        for t in subs:
            t.join()
        while llm.has_unfinished():
            time.sleep(0.005)

    step_thread = threading.Thread(target=stepper)
    step_thread.start()
    # Round 0 warms every path up; the next rounds let capacities (id sets, dicts, the trace
    # ring) reach their steady size; the growth is measured over the remaining rounds.
    round_(0)
    tracemalloc.start()
    for r in range(1, WARM_ROUNDS):
        round_(r)
    # NOTE: a leak grows the heap by the same amount every request; the bounded containers
    # (the trace ring, id sets and dicts at a new capacity, JAX's dispatch buffers) move it up
    # or down by a bounded amount whatever the count (one measured round went from +52 to -4
    # bytes per request and back). So the growth is taken over all measured rounds together:
    # a leak adds up, the bounded variation does not. The bound: a leaked request (its
    # RequestState, token lists, detokenizer, ids) is over 1 KB; the engine's heap itself
    # still moves by 20-110 bytes per request between runs (allocations inside JAX's
    # dispatch of each step, e.g. `copy_to_host_async` and the step's host inputs, not yet
    # shown to be bounded: see WORKSPACE's open ends), so the bound is 250 bytes.
    per_round = []
    for r in range(WARM_ROUNDS, ROUNDS):
        gc.collect()  # count retained memory only, not cycles not collected yet
        heap, requests = tracemalloc.get_traced_memory()[0], stats["requests"]
        round_(r)
        gc.collect()
        per_round.append(((tracemalloc.get_traced_memory()[0] - heap)
                          / max(1, stats["requests"] - requests), stats["requests"] - requests))
    tracemalloc.stop()
    done.set()
    step_thread.join(timeout=300)
    assert not step_thread.is_alive()
    for out in llm.step():  # anything handed out after the stepper's last look
        on_final(out)
    growth = sum(g * n for g, n in per_round) / sum(n for _, n in per_round)
    assert not errors, errors[:5]
    assert stats["finals"] == stats["requests"] and all(seen)
    preemptions = preempted[0]
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.requests
    assert not llm.has_unfinished()
    llm.engine.check_trace()
    assert growth < 250, f"heap grew {per_round} bytes per request in the measured rounds"

    # --- the async front end: 64 concurrent tasks, disconnects and aborts ---------------------
    allm = AsyncLLM(tiny_model_dir(ARCH), **GEOMETRY)
    async_stats = {"requests": 0, "disconnected": 0, "aborted": 0}

    async def client(k):
        rs = random.Random(1000 + k)
        for _ in range(ASYNC_PER_TASK):
            i, n = rs.randrange(NUM_PROMPTS), rs.randrange(1, MAX_NEW + 1)
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            async_stats["requests"] += 1
            roll = rs.random()
            last = None
            async for out in allm.generate(prompts[i], params):
                last = out
                if roll < DISCONNECT_RATE:  # the client goes away mid-stream
                    async_stats["disconnected"] += 1
                    break
                if roll < DISCONNECT_RATE + ABORT_RATE and not out.finished:
                    try:
                        await allm.abort(out.request_id)
                        async_stats["aborted"] += 1
                    except RequestError:
                        pass
            if roll >= DISCONNECT_RATE:
                assert last.finished
                _check(last, i, reference)

    async def main():
        await asyncio.gather(*(client(k) for k in range(ASYNC_TASKS)))
        for _ in range(200):  # disconnect aborts are applied by the engine thread
            if allm.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert allm.num_unfinished == 0 and allm.engine.blocks_in_use() == 0
    assert not allm.engine.requests and allm.step_errors == 0
    allm.engine.check_trace()
    allm.shutdown()
    wall = time.perf_counter() - t_start
    print(f"\nsoak: sync {stats}, preemptions {preemptions}, heap growth {growth:.1f} B/request (rounds: {[round(g, 1) for g, _ in per_round]}); "
          f"async {async_stats}; wall {wall:.1f} s")
    assert preemptions > 0 and stats["aborted"] > 0 and async_stats["disconnected"] > 0
