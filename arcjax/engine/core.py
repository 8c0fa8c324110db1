"""The engine core: the scheduler state, one step, and what a failed step does.

The step is one of two short sequences, chosen once at construction:

  serial:      schedule -> launch -> finish (collect, commit)
  overlapped:  advance(in flight) -> schedule -> launch -> finish(the step before)

`advance` folds the step still on the device into the state with placeholder tokens, so
the next step is planned and launched before the previous one's tokens reach the host
(`scheduler.advance`; the device feeds the placeholders). `launch` packs the plan into a
bucket's host arrays and dispatches it; `finish` collects the tokens, appends them (text,
stops, grammars: `output.append_token`), commits them (`scheduler.commit`) and records
the trace. With speculative decoding (`speculator`, spec.py) the plan is made with draft
tokens for the decode rows, and a row that verified drafts yields 1 + its accepted drafts.

Structured outputs: a constrained row's grammar bitmask goes into the step with it. When
the mask needs the token the step before is still sampling (overlapped, a constrained
decode row fed by the device), the step is launched in two parts: its forward at once,
its sampling once `finish` has committed the step before and the masks are filled
(`_sample_pending`): the device runs the forward while the host commits and fills masks.
A constrained row that verifies drafts has one mask per position (the grammar's state
after the drafts before it; its drafts are cut to what the grammar accepts first).

  overlapped with such rows:  advance -> schedule -> launch forward -> finish(before)
                              -> fill masks -> launch sampling

NOTE: failures travel one road. A stage that fails raises `StepFailed`; `_recover` ends
the requests the step call touched (every step it handled: in flight, launched; everyone
in the scheduler when planning itself failed) with "error" and a message through the one
helper `finish_request`, rolls back tokens a failed commit appended, drops the plans
(`scheduler.abandon`: their blocks are freed) and, when the device failed or the donated
cache died with the call, resets the KV cache and forgets the prefix cache. A failure in
the recovery itself (or a multi-host step failure) escapes as an exception: the engine
(engine.py) is then dead. Per-request failures (detokenization, a sink) end only their
request.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np

import scheduler
from arcjax.engine import logprobs
from arcjax.engine.group import RequestGroup
from arcjax.engine.input_processor import Abort, NewGroup, NewRequest
from arcjax.engine.output_processor import append_token
from arcjax.engine.request_state import FINISH_ERROR, RequestState
from arcjax.spec_decode.speculator import SpecCounts, Speculator, row_tokens
from scheduler.metrics import StepRecord
from arcjax.engine.trace import StepTrace
from arcjax.errors import EngineDeadError
from arcjax.parallel.multihost import plan_digest
from arcjax.runtime.runner import ModelRunner, StepHandle
from arcjax.structured import StructuredOutputManager


class StepFailed(Exception):
    """A stage of a step failed. `everyone`: every request in the scheduler is affected
    (planning failed); `device`: the device's KV is unknown; `rollback`: (request,
    snapshot) pairs to restore."""

    def __init__(self, stage: str, cause: BaseException, *, everyone: bool = False,
                 device: bool = False, rollback: list | None = None):
        super().__init__(f"{stage} failed: {cause!r}")
        self.stage, self.cause, self.everyone, self.device = stage, cause, everyone, device
        self.rollback = rollback or []


@dataclasses.dataclass
class Launched:
    """A step planned (and, once `handle` is set, dispatched) and not committed yet."""

    plan: scheduler.StepPlan
    reqs: list[RequestState]
    start: float
    handle: StepHandle | None = None
    bucket: tuple = (0, 0, 0)
    width: int = 1  # positions sampled per sequence (1 + k in a verification step)
    prompts: list | None = None
    compiled: bool = False
    # Launched as a forward only: (sampling inputs, drafts to verify or None, constrained
    # (position, grammar, drafts) rows, positions);
    # `_sample_pending` fills the masks and launches the sampling.
    pending: tuple | None = None


class EngineCore:
    """Scheduler state, request states, the step and its failures (stepping thread only)."""

    def __init__(self, runner: ModelRunner, tokenizer, sched_config: scheduler.SchedulerConfig,
                 *, clock: Callable[[], float], trace_capacity: int, async_scheduling: bool,
                 eos_token_ids: frozenset, speculator: Speculator | None = None,
                 structured: StructuredOutputManager | None = None):
        self.runner, self.tokenizer, self.sched_config, self.clock = (
            runner, tokenizer, sched_config, clock)
        self.speculator = speculator  # speculative decoding, or None
        self.structured = structured
        self.eos_token_ids, self.async_scheduling = eos_token_ids, async_scheduling
        self.state = scheduler.SchedulerState.empty(sched_config)
        self.requests: dict[str, RequestState] = {}  # in the scheduler, not released
        self.groups: dict[str, RequestGroup] = {}  # n > 1 requests by the user's id
        self.trace = StepTrace(trace_capacity)
        self.in_flight: Launched | None = None  # overlapped: launched, not committed
        self.sync = None  # multi-host: an arcjax.parallel.StepSync
        self._touched: list[Launched] = []  # the steps the current call handles
        self._step = self._step_overlapped if async_scheduling else self._step_serial

    # --- requests in and out -------------------------------------------------------------
    def apply(self, item, now: float, changed: dict) -> None:
        """Applies one inbox item (a new request or group, or an abort)."""
        if isinstance(item, Abort):
            self.end(item.request_id, "abort", None, now, changed)
            return
        if isinstance(item, NewGroup):
            self.groups[item.group.request_id] = item.group
        for req, request in (item.entering if isinstance(item, NewGroup)
                             else [(item.state, item.request)]):
            self.requests[req.request_id] = req
            self.trace.admit(req.request_id)
            try:
                self.state = scheduler.add_request(self.state, request)
            except Exception as e:  # noqa: BLE001  validated at submission: a bug if seen
                self.finish_request(req, FINISH_ERROR, now, f"could not be queued: {e!r}",
                                    changed)

    def end(self, request_id: str, reason: str, message: str | None, now: float,
            changed: dict) -> None:
        """Finishes a user's request (every sample of an n > 1 one) with `reason`."""
        group = self.groups.get(request_id)
        for req in group.children if group else [self.requests.get(request_id)]:
            if req is not None and req.request_id not in self.requests and not req.finished:
                req.finish(reason, now, message)  # an n > 1 sample not admitted yet
                changed[req.request_id] = req
            self.finish_request(req, reason, now, message, changed)
        if group:
            group.waiting.clear()

    def finish_request(self, req: RequestState | None, reason: str, now: float,
                       message: str | None, changed: dict) -> None:
        """The one way a request ends early (abort, error): it leaves the scheduler (its
        blocks are freed) and its final output goes out with the next delivery."""
        if req is None or req.finished or req.request_id not in self.requests:
            return
        if req.request_id in self.state.held:
            self.state = scheduler.abort(self.state, req.request_id)
        req.finish(reason, now, message)
        changed[req.request_id] = req

    def release(self, req: RequestState) -> None:
        """Forgets a finished request whose final output was built."""
        if self.requests.pop(req.request_id, None) is None:
            return
        self.runner.counts.release(req.request_id)
        self.trace.release(req.request_id, len(req.token_ids))
        if self.speculator is not None:
            self.speculator.release(req.request_id)

    # --- the step ------------------------------------------------------------------------
    def step(self, changed: dict) -> None:
        """One step; `changed` gets every request whose output changed."""
        self._touched = [self.in_flight] if self.in_flight is not None else []
        try:
            self._step(changed)
        except StepFailed as failure:
            if self.sync is not None:  # the processes' states would diverge: stop them all
                raise EngineDeadError(f"process {self.sync.process_id}: {failure}") from failure
            self._recover(failure, changed)
        finally:
            self._touched = []
        self._admit_waiting_samples(changed)

    def _step_serial(self, changed: dict) -> None:
        plan = self._schedule(self.state)
        if not plan.is_empty:
            self._finish(self._launch(plan, None), changed)

    def _step_overlapped(self, changed: dict) -> None:
        prev = self.in_flight
        plan = self._schedule(self._advance(prev))
        self.in_flight = None if plan.is_empty else self._launch(plan, prev)
        if prev is not None:
            self._finish(prev, changed)
        if self.in_flight is not None and self.in_flight.pending is not None:
            self._sample_pending(self.in_flight)

    @contextlib.contextmanager
    def _stage(self, name: str, **flags):
        try:
            yield
        except StepFailed:
            raise
        except Exception as e:  # noqa: BLE001  every stage's failure takes one road
            raise StepFailed(name, e, **flags) from e

    def _advance(self, prev: Launched | None) -> scheduler.SchedulerState:
        if prev is None:
            return self.state
        with self._stage("advance"):
            return scheduler.advance(self.state, prev.plan)

    def _schedule(self, state: scheduler.SchedulerState) -> scheduler.StepPlan:
        drafts = None
        if self.speculator is not None:
            with self._stage("propose", everyone=True):
                drafts = self.speculator.drafts(state, self.requests)
        with self._stage("schedule", everyone=True):
            plan = scheduler.schedule(state, self.sched_config, drafts)
            if self.sync is not None:  # every process must have planned this very step
                self.sync.check_plan(plan_digest(plan, [
                    (self.requests[rid].seed, len(self.requests[rid].token_ids))
                    for rid in plan.request_ids]))
        self.state = plan.state
        return plan

    def _launch(self, plan: scheduler.StepPlan, prev: Launched | None) -> Launched:
        """Packs and dispatches `plan`; decode rows whose input is a placeholder take the
        token `prev` samples for them on the device."""
        step = Launched(plan, [self.requests.get(rid) for rid in plan.request_ids], self.clock())
        self._touched.append(step)
        with self._stage("pack"):
            for req, cached in zip(step.reqs, plan.num_cached):
                if req.first_scheduled is None:
                    req.first_scheduled, req.num_cached_tokens = step.start, cached
            ahead = [i for i in range(plan.num_decode_rows)
                     if plan.row_token_ids(i)[0] == scheduler.PLACEHOLDER]
            fed_rows = set(ahead)
            step.prompts = logprobs.prompt_rows(plan, step.reqs)
            rows = logprobs.sampling_rows(plan, step.reqs, self.runner.counts,
                                          self.eos_token_ids, fed_rows)
            prepared = self.runner.prepare(plan, rows, step.prompts)
            feed = None
            if ahead:  # row i's first token is the one `prev` samples for the same request
                position = {rid: j for j, rid in enumerate(prev.plan.request_ids)}
                fed = np.full(prepared[0].tokens, -1, np.int32)
                cu = plan.cu_seqlens
                for i in ahead:  # a row of prev with no drafts: its first sampled position
                    fed[cu[i]] = position[plan.request_ids[i]] * prev.width
                feed = (prev.handle, fed)
            # constrained rows that sample (first position i * W; drafts: a mask each); a
            # grammar fed ahead lacks the token in flight
            width, size = prepared[0].sample_width, prepared[0].seqs * prepared[0].sample_width
            grammars = [(i * width, req.grammar, plan.row_spec_token_ids(i))
                        for i, (req, s) in enumerate(zip(step.reqs, plan.samples))
                        if s and req.grammar is not None]
            lagging = any(i // width in fed_rows for i, _, _ in grammars)
            bitmask = (None if lagging or not grammars
                       else self.structured.bitmask(grammars, size))
        with self._stage("launch"):
            compiled_before = self.runner.num_executables
            if lagging:  # the forward now, the sampling once `prev` is committed
                bucket, batch, sampling, prompt, spec = (*prepared, None, None)[:5]
                step.handle = self.runner.launch_forward(bucket, batch, prompt, feed=feed)
                step.pending = (sampling, spec, grammars, size)
            else:
                step.handle = self.runner.launch(*prepared, feed=feed, bitmask=bitmask)
        b = prepared[0]
        step.bucket, step.width = (b.tokens, b.seqs, b.max_q_len), b.sample_width
        step.compiled = self.runner.num_executables > compiled_before
        return step

    def _sample_pending(self, step: Launched) -> None:
        """Fills the masks of a step launched as a forward only (its constrained rows'
        grammars now hold the tokens of the step before) and launches its sampling."""
        sampling, spec, grammars, size = step.pending
        with self._stage("pack"):
            bitmask = self.structured.bitmask(grammars, size)
        with self._stage("launch"):
            self.runner.launch_sampling(step.handle, sampling, bitmask, spec)
        step.pending = None

    def _finish(self, step: Launched, changed: dict) -> None:
        """Collects a launched step's tokens, appends them and commits them."""
        plan, reqs = step.plan, step.reqs
        with self._stage("collect", device=True):
            if self.sync is not None:  # a peer that fails now must not leave us waiting
                self.sync.wait_until(step.handle.out.tokens.is_ready)
            out = self.runner.collect(step.handle)
            lp = (logprobs.host_logprobs(out.logprobs) if any(
                r.logprobs is not None for r in reqs) else None)
            if step.prompts is not None:
                logprobs.record_prompt_logprobs(plan, reqs, step.prompts, logprobs.host_logprobs(
                    out.prompt_logprobs), self.tokenizer)
        now, tokens = self.clock(), out.tokens
        with self._stage("commit"):
            live = [i for i, (req, s) in enumerate(zip(reqs, plan.samples))
                    if s and not req.finished and req.request_id in self.requests]
            snapshots = [(reqs[i], reqs[i].snapshot()) for i in live]
        with self._stage("commit", rollback=snapshots):
            stopped, kept, spec = [], {}, SpecCounts()
            for i, (req, snap) in zip(live, snapshots):
                tokens = row_tokens(out, plan, i, step.width)
                kept[i] = []
                try:
                    for j, token in enumerate(tokens):
                        entry = logprobs.sampled_entry(lp, i * step.width + j, token, req,
                                                       self.tokenizer)
                        kept[i].append(token)
                        if append_token(req, token, now, self.eos_token_ids, entry):
                            stopped.append(req.request_id)
                            break
                except Exception as e:  # noqa: BLE001  one request's bug stops only it
                    req.restore(snap)  # without this step's tokens
                    req.finish(FINISH_ERROR, now, f"output processing failed: {e!r}")
                    stopped.append(req.request_id)
                    changed[req.request_id] = req
                    del kept[i]
                drafts = plan.row_spec_token_ids(i)
                if drafts:
                    spec.add(len(drafts), len(tokens) - 1)
            sampled = [kept.get(i) or row_tokens(out, plan, i, step.width)
                       for i, s in enumerate(plan.samples) if s]
            if not plan.spec_token_ids:  # one token per row: commit's fast path takes ints
                sampled = [tokens[0] for tokens in sampled]
            state, finished = scheduler.commit(self.state, plan, sampled, now,
                                               finished_ids=tuple(stopped))
        sampled_ids = tuple(reqs[i].request_id for i in kept)
        record = StepRecord(
            index=self.trace.num_steps, start=step.start, end=now,
            prefill_tokens=plan.num_prefill_tokens, decode_tokens=plan.num_decode_tokens,
            num_seqs=plan.num_seqs, bucket=step.bucket, compiled=step.compiled,
            engaged=plan.engaged.as_dict(), sampled=sampled_ids,
            cached_tokens=plan.num_cached_tokens, dispatched=step.handle.dispatched,
            ready=step.handle.wait_ready(), expert_tokens=out.expert_tokens(),
            **spec.record_fields())
        with self._stage("trace sink", rollback=snapshots):
            self.trace.record(record, strict=True)
        self.state = state
        self._touched.remove(step)
        for f in finished:
            self.requests[f.request_id].finish(f.reason, now)
        for i, tokens in kept.items():
            req = reqs[i]
            self.trace.sampled(req.request_id, len(tokens))
            drafts = plan.row_spec_token_ids(i)
            if drafts:
                req.num_draft_tokens += len(drafts)
                req.num_accepted_tokens += len(row_tokens(out, plan, i, step.width)) - 1
            changed[req.request_id] = req

    # --- failures ------------------------------------------------------------------------
    def _recover(self, failure: StepFailed, changed: dict) -> None:
        """Ends the requests of every step this call touched (see the module NOTE)."""
        now, message = self.clock(), str(failure)
        for req, snap in failure.rollback:
            req.restore(snap)
        steps, self._touched, self.in_flight = self._touched, [], None
        self.state = scheduler.abandon(self.state, [s.plan for s in steps])
        doomed = [r for s in steps for r in s.reqs]
        if failure.everyone:
            doomed = list(self.requests.values())
        for req in doomed:
            self.finish_request(req, FINISH_ERROR, now, message, changed)
        if failure.device or self.runner.cache_lost():
            self._reset_device(now, message, changed)
        elif self.speculator is not None:  # a draft model's own KV may be gone with it
            self.speculator.reset()
        for start, plan in [(s.start, s.plan) for s in steps] or [(now, None)]:
            self.trace.record(StepRecord(
                index=self.trace.num_steps, start=start, end=now, prefill_tokens=0, decode_tokens=0,
                num_seqs=plan.num_seqs if plan else 0, bucket=(0, 0, 0), compiled=False,
                engaged=(plan.engaged if plan else scheduler.Engaged()).as_dict(),
                sampled=(), error=message), strict=False)

    def _reset_device(self, now: float, message: str, changed: dict) -> None:
        """The KV cache is lost or unknown: every request holding KV finishes with "error"
        (waiting ones hold none and go on), the cache is rebuilt and the prefix cache
        forgotten (its digests would point at zeroed KV)."""
        waiting = {seq.request_id for seq in self.state.waiting}
        for req in [r for rid, r in self.requests.items() if rid not in waiting]:
            self.finish_request(req, FINISH_ERROR, now, message + " (KV cache reset)", changed)
        self.state = scheduler.forget_prefix_cache(scheduler.abandon(self.state, []))
        self.in_flight = None
        self.runner.reset_cache()
        if self.speculator is not None:
            self.speculator.reset()

    def fail_everything(self, message: str, changed: dict) -> None:
        """Every request (n > 1 samples not admitted yet included) ends with "error"."""
        now = self.clock()
        self.state = scheduler.abandon(self.state, [s.plan for s in [self.in_flight] if s])
        self.in_flight = None
        for rid in [*self.requests, *self.groups]:
            self.end(rid, FINISH_ERROR, message, now, changed)

    def _admit_waiting_samples(self, changed: dict) -> None:
        """n > 1: the samples waiting for child 0's prompt enter once it is computed."""
        now = self.clock()
        for req in list(changed.values()):
            group = self.groups.get(req.parent_id) if req.parent_id is not None else None
            if group is not None and group.ready():
                waiting, group.waiting = group.waiting, []
                for state, request in waiting:
                    self.apply(NewRequest(state, request), now, changed)
