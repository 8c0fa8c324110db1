"""A bounded fault soak: thousands of short requests, serial (threads stepping an `LLM`
engine with n-gram speculation) then overlapped (`AsyncLLM` tasks), with faults injected at
random into every stage of the step (proposing drafts, planning, advancing, packing,
launch, collect, appending tokens, commit, building the trace record, the trace sink,
applying the finishes, detokenization, request sinks), aborts, and a KV cache small
enough to force preemption.

Every wait is bounded (no hung request), no KV block or request is left at the end, the
engine stays alive, and every request a fault did not end equals the greedy reference.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time

import scheduler
from arcjax import LLM, AsyncLLM, RequestError, SamplingParams
from support.hf_models import tiny_model_dir
from support.soak_workload import GEOMETRY, MAX_NEW, NUM_PROMPTS, reference  # noqa: F401
from support.soak_workload import soak_prompts as _prompts

ARCH = "LlamaForCausalLM"
PHASE_REQUESTS, PHASE_FAULTS = 1000, 25  # at least, per phase (serial, overlapped)
# Each phase ends when it has its requests and faults (~1-2 minutes on 2 idle cores); this
# bound only keeps a broken engine from running forever, so it is far above that: a slow,
# shared machine must not fail the count check for being slow.
PHASE_TIME_S = 900
STEP_RATE, TOKEN_RATE, ABORT_RATE = 0.012, 0.0015, 0.05
SUBMITTERS, TASKS = 4, 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2, "disable_by_batch_size": None}  # exact: greedy unchanged
STAGES = {"schedule", "pack", "launch", "collect", "append", "commit", "trace record",
          "trace sink", "finish", "detokenize", "sink"}  # both phases


class Faults:
    """Raises an injected error at a random share of the calls of each wrapped stage (and
    at its 50th call if it has not failed yet, so every stage called that often fails)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.fired: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def maybe(self, stage: str, rate: float) -> None:
        self.calls[stage] += 1
        if self.rng.random() < rate or (self.calls[stage] == 50 and not self.fired[stage]):
            self.fired[stage] += 1
            raise RuntimeError(f"injected {stage} fault")

    def wrap(self, stage: str, fn, rate: float = STEP_RATE):
        def faulty(*args, **kwargs):
            self.maybe(stage, rate)
            return fn(*args, **kwargs)
        return faulty

    def install(self, monkeypatch, engine) -> None:
        import arcjax.engine.output_processor as output_processor

        for name in ("schedule", "advance", "commit"):
            monkeypatch.setattr(scheduler, name, self.wrap(name, getattr(scheduler, name)))
        core, runner = engine.core, engine.runner
        for stage, obj, name in (("pack", runner, "prepare"), ("launch", runner, "launch"),
                                 ("collect", runner, "collect"),
                                 ("append", core.outputs, "append"),
                                 ("trace record", core.trace, "step_record"),
                                 ("finish", core.trace, "sampled")):
            monkeypatch.setattr(obj, name, self.wrap(stage, getattr(obj, name)))
        if core.speculator is not None:
            monkeypatch.setattr(core.speculator, "drafts", self.wrap(
                "propose", core.speculator.drafts))
        monkeypatch.setattr(output_processor, "append_token", self.wrap(
            "detokenize", output_processor.append_token, TOKEN_RATE))
        engine.trace_sink = self.wrap("trace sink", lambda record: None)
        real_add = engine.add_request

        def add(prompt, params=None, request_id=None, arrival_time=None, *, sink=None, **kw):
            if sink is not None:  # a consumer that breaks now and then (never on a final)
                inner = sink

                def sink(out):
                    if not out.finished:
                        self.maybe("sink", TOKEN_RATE * 4)
                    inner(out)
            return real_add(prompt, params, request_id, arrival_time, sink=sink, **kw)

        monkeypatch.setattr(engine, "add_request", add)


def _check(out, want: list[int], n: int, touched: collections.Counter) -> None:
    got = list(out.token_ids)
    if out.finish_reason == "error":
        assert "injected" in out.error, out.error
        touched["error"] += 1
        return
    assert got == want[:len(got)], (out.request_id, got, want)
    if out.finish_reason == "length":
        assert len(got) == n
    else:
        assert out.finish_reason == "abort", out.finish_reason
    touched[out.finish_reason] += 1


def _clean(engine) -> None:
    assert engine.dead is None and not engine.has_unfinished() and not engine.requests
    assert engine.blocks_in_use() == 0
    engine.check_trace()


def test_fault_soak_serial_threads_then_overlapped_tasks(monkeypatch, reference):  # noqa: F811
    prompts = _prompts()
    t0 = time.perf_counter()
    report = {}

    # --- serial: 4 threads submit, one thread steps ---------------------------------------
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY, async_scheduling=False,
              speculative_config=NGRAM)
    faults = Faults(1)
    faults.install(monkeypatch, llm.engine)
    finals, lock, errors = {}, threading.Lock(), []
    submitted = collections.Counter()
    stop = threading.Event()

    def record(out):
        with lock:
            finals[out.request_id] = out

    def stepper():
        deadline = time.monotonic() + PHASE_TIME_S + 60
        while (not stop.is_set() or llm.has_unfinished()) and time.monotonic() < deadline:
            for out in llm.step():
                if out.finished:
                    record(out)

    def submitter(k):
        rs = random.Random(100 + k)
        j = 0
        while not stop.is_set():
            i, n = rs.randrange(NUM_PROMPTS), rs.randrange(1, MAX_NEW + 1)
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            sink = (lambda out: out.finished and record(out)) if j % 3 == 0 else None
            rid = llm.engine.add_request(prompts[i], params, f"{k}-{j}-{i}-{n}", sink=sink)
            with lock:
                submitted["requests"] += 1
            if rs.random() < ABORT_RATE:
                try:
                    llm.abort(rid)
                except RequestError:  # finished first
                    pass
            j += 1
            while llm.engine.num_unfinished > 48 and not stop.is_set():
                time.sleep(0.002)

    threads = [threading.Thread(target=stepper)] + [
        threading.Thread(target=submitter, args=(k,)) for k in range(SUBMITTERS)]
    for t in threads:
        t.start()
    phase_end = time.monotonic() + PHASE_TIME_S
    while time.monotonic() < phase_end and (submitted["requests"] < PHASE_REQUESTS or
                                            sum(faults.fired.values()) < PHASE_FAULTS):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    for out in llm.step():
        record(out)
    touched = collections.Counter()
    for rid, out in finals.items():
        try:
            _, _, i, n = map(int, rid.split("-"))
            _check(out, reference[i], n, touched)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, errors[:5]
    assert len(finals) == submitted["requests"] >= PHASE_REQUESTS  # none hung
    assert sum(faults.fired.values()) >= PHASE_FAULTS
    assert set(faults.fired) >= STAGES | {"propose"}, faults.fired
    _clean(llm.engine)
    report["serial"] = dict(requests=len(finals), faults=dict(faults.fired), **touched)
    monkeypatch.undo()

    # --- overlapped: AsyncLLM, 48 concurrent tasks ---------------------------------------
    allm = AsyncLLM(tiny_model_dir(ARCH), **GEOMETRY, async_scheduling=True)
    faults = Faults(2)
    faults.install(monkeypatch, allm.engine)
    touched = collections.Counter()
    count = collections.Counter()

    async def client(k, phase_end):
        rs = random.Random(1000 + k)
        while loop_time() < phase_end and (count["requests"] < PHASE_REQUESTS or sum(
                faults.fired.values()) < PHASE_FAULTS):
            i, n = rs.randrange(NUM_PROMPTS), rs.randrange(1, MAX_NEW + 1)
            count["requests"] += 1
            leave = rs.random() < ABORT_RATE

            async def one():
                last = None
                async for out in allm.generate(prompts[i], SamplingParams(
                        max_tokens=n, temperature=0, ignore_eos=True)):
                    last = out
                    if leave:
                        return None  # the client goes away mid-stream
                return last

            last = await asyncio.wait_for(one(), 60)  # bounded: a hung request fails here
            if last is not None:
                assert last.finished
                _check(last, reference[i], n, touched)

    def loop_time():
        return time.monotonic()

    async def main():
        phase_end = loop_time() + PHASE_TIME_S
        await asyncio.wait_for(asyncio.gather(*(client(k, phase_end) for k in range(TASKS))),
                               PHASE_TIME_S + 120)
        for _ in range(500):  # disconnect aborts are applied by the engine thread
            if allm.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert count["requests"] >= PHASE_REQUESTS
        assert sum(faults.fired.values()) >= PHASE_FAULTS
        _clean(allm.engine)
        assert allm.is_running() and allm.step_errors == 0
    finally:
        allm.shutdown()
    report["overlapped"] = dict(requests=count["requests"], faults=dict(faults.fired),
                                **touched)
    print(f"\nfault soak: {report}; wall {time.perf_counter() - t0:.1f} s")
    assert set(report["overlapped"]["faults"]) >= STAGES | {"advance"}, report
