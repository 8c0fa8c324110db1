"""The engine core: the scheduler state, one step, and what a failed step does.

The step is one of two short sequences, chosen once at construction:

  serial:      schedule -> launch -> finish
  overlapped:  advance(in flight) -> schedule -> launch -> finish(the step before)

Each part runs named stages (quoted), each the work of the component that owns it:

1. `_advance` (overlapped), "advance": the step still on the device is folded into the
   state with placeholder tokens (`scheduler.advance`), so the next step is planned and
   launched before the previous one's tokens reach the host.
2. `_schedule`: "propose" (speculative decoding: `Speculator.drafts`), "schedule"
   (`scheduler.schedule`): the plan, kept as a `Launched` step.
3. `_launch`: "pack" (`runner.prepare`: a `PreparedStep`; masks of constrained rows),
   "launch" (`runner.launch`; decode rows whose input is a placeholder take the token the
   step in flight samples for them on the device: a `TokenFeed`). The host tier's copies
   the plan lists go around it: its stores before the launch, its loads right after
   (`runner.store_blocks`, `runner.load_blocks`); a plan that only moves blocks (the
   requests it admitted wait for their loads) runs "move blocks" and no step, and its
   commit ("commit") has no tokens.
4. `_finish`: "collect" (`runner.collect`: `Collected`; pooling rows' sums go into their
   requests' `PooledState`, pooled_state.py), "append"
   (`OutputProcessor.append`: text, stops, grammars; a row that verified drafts yields
   1 + its accepted drafts: `Appended`), "commit" (`scheduler.commit`), "trace record"
   (`StepTrace.step_record`), "trace sink", "finish" (the commit's finishes, a pooling
   request's among them once its last chunk ran, and draft counts applied, the trace's
   tally, then the committed state).
The records are in step_records.py and output_processor.py.

Structured outputs: a constrained row's grammar bitmask goes into the step with it. When
the mask needs the token the step before is still sampling (overlapped, a constrained
decode row fed by the device), the step is launched in two parts: its forward at once
("launch": `runner.launch_forward`; the step keeps a `PendingSampling`), its sampling once
`_finish` has committed the step before (`_sample_pending`: "mask", "launch sampling"):
the device runs the forward while the host commits and fills masks. A constrained row
that verifies drafts has one mask per position (the grammar's state after the drafts
before it; its drafts are cut to what the grammar accepts first).

  overlapped with such rows:  advance -> schedule -> launch forward -> finish(before)
                              -> mask -> launch sampling

NOTE: failures travel one road. Every line of a step runs inside a stage (`_stage`); a
stage that fails raises `StepFailed`, and `_recover` ends the requests the step call
touched (every step it handled: in flight, launched; everyone in the scheduler when
proposing or planning failed) with "error" and a message naming the stage, through the
one helper `finish_request`, rolls back what the failed step did to its requests
(appended tokens, finishes, draft counts: `RequestState.snapshot`), drops the plans
(`scheduler.abandon`: their blocks are freed) and, when the device failed or the donated
cache died with the call, resets the KV cache and forgets the prefix cache. The last
lines of "finish" move the core to the committed state and cannot fail, so a failure
anywhere before leaves the step to be abandoned. A failure in the recovery itself (or a
multi-host step failure) escapes as an exception: the engine (engine.py) is then dead.
Per-request failures (detokenization, a sink) end only their request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import scheduler
from arcjax.engine import logprobs
from arcjax.engine.group import RequestGroup
from arcjax.engine.input_processor import Abort, NewGroup, NewRequest
from arcjax.engine.output_processor import Appended, OutputProcessor, SampledRow
from arcjax.engine.pooled_state import add_pooled, pooling_rows
from arcjax.engine.request_state import FINISH_ERROR, RequestState
from arcjax.engine.step_records import Collected, Launched, PendingSampling, StepFailed
from arcjax.engine.trace import StepTrace
from arcjax.errors import EngineDeadError
from arcjax.lora.adapter_cache import AdapterCache
from arcjax.parallel.multihost import plan_digest
from arcjax.runtime.runner import ModelRunner
from arcjax.runtime.step_handle import TokenFeed
from arcjax.spec_decode.speculator import SpecCounts, Speculator, row_tokens
from arcjax.structured import StructuredOutputManager


class EngineCore:
    """Scheduler state, request states, the step and its failures (stepping thread only)."""

    def __init__(self, runner: ModelRunner, tokenizer, sched_config: scheduler.SchedulerConfig,
                 *, clock: Callable[[], float], trace_capacity: int, async_scheduling: bool,
                 eos_token_ids: frozenset, speculator: Speculator | None = None,
                 structured: StructuredOutputManager | None = None,
                 adapters: AdapterCache | None = None):
        self.runner, self.tokenizer, self.sched_config, self.clock = (
            runner, tokenizer, sched_config, clock)
        self.speculator = speculator  # speculative decoding, or None
        self.structured = structured
        self.adapters = adapters  # LoRA: the loaded adapters (runner.lora: their slots)
        self.eos_token_ids, self.async_scheduling = eos_token_ids, async_scheduling
        self.state = scheduler.SchedulerState.empty(sched_config)
        self.requests: dict[str, RequestState] = {}  # in the scheduler, not released
        self.groups: dict[str, RequestGroup] = {}  # n > 1 requests by the user's id
        # appends each step's tokens; the engine delivers the outputs through it
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, self.groups, self.release)
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
        """Forgets a finished request whose final output was built (and unpins its LoRA
        adapter, also for an n > 1 sample that never entered the scheduler)."""
        if req.adapter is not None:
            self.adapters.release(req.adapter)
            req.adapter = None
        if self.requests.pop(req.request_id, None) is None:
            return
        self.runner.counts.release(req.request_id)
        self.trace.release(req.request_id, len(req.token_ids))
        if self.speculator is not None:
            self.speculator.release(req.request_id)

    def drop_all(self) -> None:
        """Forgets every request and group without finishing them (the engine died: its
        waiters learn it from the engine, nothing is delivered any more)."""
        self.requests.clear()
        self.groups.clear()

    # --- monitoring ----------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """The scheduler's side of `Engine.stats` (any thread: it reads one immutable
        state): requests waiting and running, KV blocks in use and in all, steps; with a
        host tier its slots and what it moved; with LoRA its device slots, the adapters
        written into them (swaps), read from disk and loaded on the host now."""
        state = self.state
        out = {"waiting": len(state.waiting), "running": state.num_running,
               "kv_blocks_in_use": state.pool.num_in_use,
               "kv_blocks_total": self.sched_config.num_blocks,
               "steps": self.trace.num_steps}
        pool = self.runner.host_pool
        if pool is not None:  # the host tier: blocks and bytes each way, load latency
            tier = pool.stats
            out |= {"kv_host_blocks_total": pool.num_host_slots,
                    "kv_host_hit_blocks": tier.blocks_loaded,
                    "kv_host_stored_blocks": tier.blocks_stored,
                    "kv_bytes_to_host": tier.bytes_to_host,
                    "kv_bytes_to_device": tier.bytes_to_device,
                    "kv_load_seconds_sum": tier.load_seconds,
                    "kv_loads_timed": tier.loads_timed}
        table = self.runner.lora
        if table is not None:  # LoRA: device slots and their swaps, host loads
            out |= {"lora_slots_total": table.num_slots - 1, "lora_slot_swaps": table.swaps,
                    "lora_adapter_loads": self.adapters.loads,
                    "lora_adapters_loaded": len(self.adapters.loaded())}
        return out

    def blocks_in_use(self) -> int:
        """KV blocks held by running sequences."""
        return self.sched_config.num_blocks - self.state.pool.num_free

    def check_trace(self) -> int:
        """`StepTrace.check` against the requests held now. Returns how many are held."""
        return self.trace.check({rid: len(r.token_ids) for rid, r in self.requests.items()})

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
        step = self._schedule(self.state)
        if step is not None:
            self._launch(step, None)
            self._finish(step, changed)

    def _step_overlapped(self, changed: dict) -> None:
        prev = self.in_flight
        step = self._schedule(self._advance(prev))
        if step is not None:
            self._launch(step, prev)
        self.in_flight = step
        if prev is not None:
            self._finish(prev, changed)
        if step is not None and step.pending is not None:
            self._sample_pending(step)

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

    def _schedule(self, state: scheduler.SchedulerState) -> Launched | None:
        """Plans the next step from `state` (drafts proposed first); None: nothing to run."""
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
            step = None if plan.is_empty else Launched(
                plan, [self.requests.get(rid) for rid in plan.request_ids], self.clock())
            self.state = plan.state  # NOTE: from here on, the step is abandoned if it fails
            if step is not None:
                self._touched.append(step)
            return step

    def _launch(self, step: Launched, prev: Launched | None) -> None:
        """Packs and dispatches `step`; decode rows whose input is a placeholder take the
        token `prev` samples for them on the device."""
        plan = step.plan
        if plan.moves_only:
            with self._stage("move blocks"):
                self.runner.store_blocks(plan)
                self.runner.load_blocks(plan)
            return
        with self._stage("pack"):
            for req, cached in zip(step.reqs, plan.num_cached):
                if req.first_scheduled is None:
                    req.first_scheduled, req.num_cached_tokens = step.start, cached
            fed_rows = {i for i in range(plan.num_decode_rows)
                        if plan.row_token_ids(i)[0] == scheduler.PLACEHOLDER}
            step.prompts = logprobs.prompt_rows(plan, step.reqs)
            rows = logprobs.sampling_rows(plan, step.reqs, self.runner.counts,
                                          self.eos_token_ids, fed_rows)
            prepared = self.runner.prepare(plan, rows, step.prompts,
                                           pooling_rows(plan, step.reqs), self._lora_slots(step))
            step.bucket = prepared.bucket
            feed = self._feed(step, prev, fed_rows) if fed_rows else None
            # constrained rows that sample (first position i * W; drafts: a mask each); a
            # grammar fed ahead lacks the token in flight
            grammars = [(i * step.width, req.grammar, plan.row_spec_token_ids(i))
                        for i, (req, s) in enumerate(zip(step.reqs, plan.samples))
                        if s and req.grammar is not None]
            lagging = any(i // step.width in fed_rows for i, _, _ in grammars)
            bitmask = (None if lagging or not grammars
                       else self.structured.bitmask(grammars, prepared.bucket.num_samples))
        with self._stage("launch"):
            compiled_before = self.runner.num_executables
            self.runner.store_blocks(plan)  # out before the step may overwrite them
            if lagging:  # the forward now, the sampling once `prev` is committed
                step.handle = self.runner.launch_forward(prepared, feed=feed)
                step.pending = PendingSampling(prepared, grammars)
            else:
                step.handle = self.runner.launch(prepared, feed=feed, bitmask=bitmask)
            self.runner.load_blocks(plan)  # in after it, before the next step
            step.compiled = self.runner.num_executables > compiled_before

    def _lora_slots(self, step: Launched) -> list[int] | None:
        """With LoRA: every row's adapter in a device slot (`SlotTable.assign`; the adapters
        of running sequences keep theirs), and each row's slot (0: the base model)."""
        if self.runner.lora is None:
            return None
        keys = [req.adapter.key if req.adapter is not None else None for req in step.reqs]
        slot_of = self.runner.lora.assign([k for k in keys if k is not None],
                                          self.state.running_adapters(), self.adapters.weights)
        return [slot_of[k] if k is not None else 0 for k in keys]

    @staticmethod
    def _feed(step: Launched, prev: Launched, fed_rows: set[int]) -> TokenFeed:
        """Row i's first token is the one `prev` samples for the same request (a row of
        `prev` with no drafts: its first sampled position)."""
        position = {rid: j for j, rid in enumerate(prev.plan.request_ids)}
        plan, cu = step.plan, step.plan.cu_seqlens
        return TokenFeed.build(prev.handle, step.bucket.tokens, {
            cu[i]: position[plan.request_ids[i]] * prev.width for i in fed_rows})

    def _sample_pending(self, step: Launched) -> None:
        """Fills the masks of a step launched as a forward only (its constrained rows'
        grammars now hold the tokens of the step before) and launches its sampling."""
        pending = step.pending
        with self._stage("mask"):
            bitmask = self.structured.bitmask(pending.grammars,
                                              pending.prepared.bucket.num_samples)
        with self._stage("launch sampling"):
            self.runner.launch_sampling(step.handle, pending.prepared, bitmask)
            step.pending = None

    # --- the commit path: collect -> append -> commit -> trace -> finish -----------------
    def _finish(self, step: Launched, changed: dict) -> None:
        """Collects a launched step's tokens, appends them to their requests, commits them,
        records the step and applies its finishes (stages; see the module docstring)."""
        if step.handle is None:  # it only moved blocks: nothing sampled, nothing to record
            with self._stage("commit"):
                state, _ = scheduler.commit(self.state, step.plan, [], self.clock())
            self.state = state
            self._touched.remove(step)
            return
        collected = self._collect(step)
        appended = self._append(step, collected, changed)
        state, finished = self._commit(step, collected, appended)
        self._record(step, collected, appended)
        self._apply(step, collected, appended, state, finished, changed)

    def _collect(self, step: Launched) -> Collected:
        """The step's tokens (and the logprobs asked for) on the host."""
        plan, reqs = step.plan, step.reqs
        with self._stage("collect", device=True):
            if self.sync is not None:  # a peer that fails now must not leave us waiting
                self.sync.wait_until(step.handle.out.tokens.is_ready)
            out = self.runner.collect(step.handle)
            lp = (logprobs.host_logprobs(out.logprobs) if any(
                r.logprobs is not None for r in reqs) else None)
            prompt_lp = (logprobs.host_logprobs(out.prompt_logprobs)
                         if step.prompts is not None else None)
        with self._stage("collect"):
            if prompt_lp is not None:
                logprobs.record_prompt_logprobs(plan, reqs, step.prompts, prompt_lp,
                                                self.tokenizer)
            if out.pooled is not None:  # pooling rows' sums into their requests
                add_pooled(plan, reqs, out.pooled)
            yielded = {i: row_tokens(out, plan, i, step.width)
                       for i, s in enumerate(plan.samples) if s}
            return Collected(out, yielded, lp, self.clock())

    def _append(self, step: Launched, collected: Collected, changed: dict) -> Appended:
        """The live rows' tokens into their requests (`OutputProcessor.append`)."""
        reqs = step.reqs
        with self._stage("append"):
            rows = [SampledRow(i, reqs[i], tokens, i * step.width, reqs[i].snapshot())
                    for i, tokens in collected.yielded.items()
                    if not reqs[i].finished and reqs[i].request_id in self.requests]
        with self._stage("append", rollback=[(row.req, row.snapshot) for row in rows]):
            return self.outputs.append(rows, collected.logprobs, collected.now, changed)

    def _commit(self, step: Launched, collected: Collected, appended: Appended
                ) -> tuple[scheduler.SchedulerState, tuple]:
        """The scheduler's commit (pure): the state after the step, and the requests it
        finished. A row the host cut keeps its appended tokens; the others commit all."""
        plan = step.plan
        with self._stage("commit", rollback=appended.rollback):
            sampled = [appended.kept.get(i) or tokens for i, tokens in collected.yielded.items()]
            if not plan.spec_token_ids:  # one token per row: commit's fast path takes ints
                sampled = [tokens[0] for tokens in sampled]
            return scheduler.commit(self.state, plan, sampled, collected.now,
                                    finished_ids=tuple(appended.stopped))

    def _record(self, step: Launched, collected: Collected, appended: Appended) -> None:
        """The step's trace record, built (`StepTrace.step_record`) and recorded (a failing
        trace sink fails the step)."""
        with self._stage("trace record", rollback=appended.rollback):
            record = self.trace.step_record(
                step.plan, start=step.start, end=collected.now, bucket=step.bucket,
                compiled=step.compiled, handle=step.handle, out=collected.out,
                sampled=tuple(step.reqs[i].request_id for i in appended.kept),
                spec=SpecCounts.of(step.plan, {row.index: row.tokens for row in appended.rows}))
        with self._stage("trace sink", rollback=appended.rollback):
            self.trace.record(record, strict=True)

    def _apply(self, step: Launched, collected: Collected, appended: Appended,
               state: scheduler.SchedulerState, finished: tuple, changed: dict) -> None:
        """Ends the requests the commit finished, adds each kept row's draft counts to its
        request and its tokens to the trace's tally, then moves to the committed state."""
        plan, reqs, now = step.plan, step.reqs, collected.now
        with self._stage("finish", rollback=appended.rollback):
            for f in finished:  # (a pooling request's final chunk sampled nothing)
                self.requests[f.request_id].finish(f.reason, now)
                changed[f.request_id] = self.requests[f.request_id]
            for i in appended.kept:
                drafts = plan.row_spec_token_ids(i)
                if drafts:
                    reqs[i].num_draft_tokens += len(drafts)
                    reqs[i].num_accepted_tokens += len(collected.yielded[i]) - 1
                changed[reqs[i].request_id] = reqs[i]
            self.trace.sampled({reqs[i].request_id: len(tokens)
                                for i, tokens in appended.kept.items()})
            self.state = state  # NOTE: the step is done: nothing below may fail
            self._touched.remove(step)

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
            self.trace.record(self.trace.failed_record(plan, start=start, end=now,
                                                       error=message), strict=False)

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
