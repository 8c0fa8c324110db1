"""The engine loop: the imperative shell around the pure scheduler.

One `step()` (the stepping thread; one step at a time):
  1. drain the inbox: queued requests enter the scheduler, queued aborts leave it
  2. plan = scheduler.schedule(state, config)        pure: rows, blocks, engaged
  3. bucket, batch = runner.prepare(plan, rows)      host arrays padded to a bucket
  4. out = runner.run(bucket, batch, sampling)       one compiled executable per bucket;
     tokens, raw logprobs (sampled + top 20; prompt rows when asked), count-table update
  5. append tokens (stop strings, detokenization), then state = scheduler.commit(...)
  6. trace record; every changed request's output goes to its sink, or to the list the
     next `step()` returns; a finished request is released once its final output is out

NOTE: threading and lifetimes (WORKSPACE.md, "Threading and lifetimes").
- `add_request` and `abort` may be called from any thread while one thread steps. They
  validate in the caller's thread (errors raise there, synchronously) and enter through
  an inbox that the stepping thread drains at the start of each step; only the stepping
  thread touches the scheduler state and the request states.
- A step is atomic: it commits fully, or (device call or commit failed) every appended
  token is rolled back, the step's requests finish with reason "error" and release their
  blocks, and the engine keeps serving the others. Aborts drained before a failure are
  not lost (their outputs were already emitted).
- Memory is bounded: finished requests are released once their final output is handed
  out, the trace is a ring of `trace_capacity` steps, `has_unfinished()` is O(1).
- Multi-host (`self.sync`, an `arcjax.parallel.StepSync`): process 0 alone admits; step 1
  takes its inbox to every process, and every process checks that all planned the same
  step before the device call (`arcjax/parallel/multihost.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import numpy as np

import scheduler
from arcjax.engine import logprobs
from arcjax.engine.group import CHILD_SEP, RequestGroup, child_id, child_seed
from arcjax.engine.outputs import RequestOutput
from arcjax.engine.request import FINISH_ABORT, FINISH_ERROR, RequestState
from arcjax.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from arcjax.engine.trace import StepRecord
from arcjax.errors import DuplicateRequestError, RequestError, UnknownRequestError
from arcjax.parallel.multihost import plan_digest
from arcjax.runtime.buckets import Bucket
from arcjax.runtime.runner import ModelRunner, StepHandle
from arcjax.runtime.sampling import SamplingParams

Sink = Callable[[RequestOutput], None]


@dataclasses.dataclass
class _Launched:
    """A step dispatched to the device and not yet committed."""

    plan: scheduler.StepPlan
    reqs: list[RequestState]
    handle: StepHandle
    bucket: Bucket
    prompts: list | None
    start: float
    compiled: bool


def _feed_rows(plan, ahead: list[int], prev: _Launched,
               num_tokens: int) -> tuple[StepHandle, np.ndarray]:
    """For each decode row of `plan` in `ahead` (its input is a placeholder), the row of
    `prev` that samples that token: the device feeds it."""
    rows = np.full(num_tokens, -1, np.int32)
    position = {rid: j for j, rid in enumerate(prev.plan.request_ids)}
    for i in ahead:
        rows[i] = position[plan.request_ids[i]]
    return prev.handle, rows


class Engine:
    """Online engine: `add_request`, `step`, `abort`, `has_unfinished` (see module NOTE)."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None,
                 sched_config: scheduler.SchedulerConfig, *, max_model_len: int,
                 seed: int = 0, clock=time.perf_counter, model_dir=None,
                 trace_capacity: int = 10_000):
        self.runner, self.tokenizer, self.model_dir = runner, tokenizer, model_dir
        self.sched_config, self.max_model_len = sched_config, max_model_len
        self.clock = clock
        self.state = scheduler.SchedulerState.empty(sched_config)
        self.requests: dict[str, RequestState] = {}  # in the scheduler, unfinished
        self.trace: collections.deque[StepRecord] = collections.deque(maxlen=trace_capacity)
        self.trace_sink: Callable[[StepRecord], None] | None = None  # e.g. a JSONL writer
        self.trace_sink_error: str | None = None  # why a failing sink was detached
        self.num_steps = 0
        self._seed = seed
        self._lock = threading.Lock()  # guards the inbox, the id set and the pending list
        self._step_lock = threading.Lock()  # one step (or inbox drain) at a time
        # ("add", RequestState, scheduler.Request) | ("group", RequestGroup, entering pairs)
        # | ("abort", id)
        self._inbox: list[tuple] = []
        self._groups: dict[str, RequestGroup] = {}  # n > 1 requests by the user's id
        self._unfinished: set[str] = set()  # ids submitted and not yet finished
        self._pending: list[RequestOutput] = []  # outputs of requests without a sink
        self._auto_ids = itertools.count()
        self._traced: dict[str, int] = {}  # tokens the trace sampled, per held request
        self.sync = None  # multi-host: an arcjax.parallel.StepSync (build_engine sets it)
        self._trace_errors: list[str] = []
        # Overlapped scheduling (plan step N+1 while step N runs); build_engine sets it from
        # EngineConfig.async_scheduling. `_in_flight`: the step launched and not committed.
        self.async_scheduling = False
        self._in_flight: _Launched | None = None
        eos = tokenizer.eos_token_ids if tokenizer else runner.cfg.eos_token_ids
        self.eos_token_ids = frozenset(eos)

    # --- submission (any thread) --------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    sink: Sink | None = None, priority: int = 0) -> str:
        """Validates and queues one request. Returns its id.

        Args:
          prompt: text, or token ids (ints, or a 1-D numpy integer array).
          params: sampling params; None = SamplingParams().
          request_id: unique among unfinished requests; None = a fresh id.
          arrival_time: on the engine's clock; None = now.
          sink: receives every output of this request (from the stepping thread); without
            one, outputs are returned by `step()`.
          priority: smaller is served first (the scheduler's order); equal: FCFS.

        Raises:
          RequestError (a ValueError naming `.field`): the request is refused; nothing is queued.
        """
        params = SamplingParams() if params is None else params
        text, ids = self.check(prompt, params)
        if request_id is not None and (not isinstance(request_id, (str, int))
                                       or isinstance(request_id, bool)):
            raise RequestError("request_id", f"must be a str, got {request_id!r}")
        arrival = self.clock() if arrival_time is None else arrival_time
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool):
            raise RequestError("arrival_time", f"must be a number, got {arrival!r}")
        if not isinstance(priority, (int, np.integer)) or isinstance(priority, (bool, np.bool_)):
            raise RequestError("priority", f"must be an int, got {priority!r}")
        if self.sync is not None and params.n > 1:
            raise RequestError("n", "n > 1 is not supported across several hosts yet", limit=1)
        with self._lock:
            if request_id is None:
                request_id = next(i for i in map(str, self._auto_ids) if i not in self._unfinished)
            request_id = str(request_id)
            if CHILD_SEP[0] in request_id:
                raise RequestError("request_id", "must not contain the control character "
                                   f"{CHILD_SEP[0]!r} (it names n > 1 samples)")
            if request_id in self._unfinished:
                raise DuplicateRequestError("request_id", f"{request_id!r} is already in use")
            request = scheduler.Request(request_id=request_id, prompt_token_ids=ids,
                                        max_tokens=params.max_tokens, arrival_time=arrival,
                                        priority=int(priority))
            scheduler.validate_request(request, self.sched_config)
            seed = params.seed if params.seed is not None else zlib.crc32(
                f"{self._seed}:{request_id}".encode())
            self._unfinished.add(request_id)
            if params.n == 1:
                state = self._state(request_id, text, ids, params, seed, arrival)
                state.sink = sink
                self._inbox.append(("add", state, request))
            else:
                self._inbox.append(("group", *self._group(request, text, params, seed, sink)))
        return request_id

    def _state(self, rid: str, text, ids, params: SamplingParams, seed: int,
               arrival: float) -> RequestState:
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        ) if self.tokenizer else None
        return RequestState(rid, text, ids, params, seed, float(arrival), detok)

    def _group(self, request: scheduler.Request, text, params: SamplingParams, seed: int,
               sink) -> tuple[RequestGroup, list]:
        """n children of one request (group.py): child i has its own seed stream. Returns the
        group and the (state, scheduler request) pairs that enter the scheduler now."""
        pairs = []
        for i in range(params.n):
            cid = child_id(request.request_id, i)
            cp = dataclasses.replace(params, n=1, seed=child_seed(seed, i), prompt_logprobs=(
                params.prompt_logprobs if i == 0 else None))  # the group reports child 0's
            state = self._state(cid, text, request.prompt_token_ids, cp, cp.seed,
                                request.arrival_time)
            state.index, state.parent_id = i, request.request_id
            pairs.append((state, dataclasses.replace(request, request_id=cid)))
        hold = 1 if self.sched_config.enable_prefix_caching else params.n
        group = RequestGroup(request.request_id, [st for st, _ in pairs], pairs[hold:], sink)
        return group, pairs[:hold]

    def check(self, prompt, params: SamplingParams) -> tuple[str | None, tuple[int, ...]]:
        """Validates a request without queueing it. Returns (prompt text, token ids)."""
        if not isinstance(params, SamplingParams):
            raise RequestError("params", f"must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        vocab = self.runner.cfg.vocab_size
        if len(ids) > self.max_model_len:
            raise RequestError("prompt", f"{len(ids)} tokens, more than max_model_len "
                               f"{self.max_model_len}", limit=self.max_model_len)
        if ids and len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens "
                               f"({params.max_tokens}) exceeds max_model_len "
                               f"{self.max_model_len}", limit=self.max_model_len - len(ids))
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt", f"token id {bad} is outside the vocabulary "
                               f"[0, {vocab})", limit=vocab)
        if any(not t < vocab for t in params.stop_token_ids):
            raise RequestError("stop_token_ids", f"token ids must be in [0, {vocab})",
                               limit=vocab)
        return text, ids

    def _tokenize(self, prompt) -> tuple[str | None, tuple[int, ...]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "a string prompt needs a tokenizer; pass token ids")
            try:
                prompt.encode("utf-8")
                ids = tuple(self.tokenizer.encode(prompt))
            except (UnicodeError, TypeError) as e:
                raise RequestError("prompt", f"text cannot be encoded ({e})") from None
            if not ids:
                raise RequestError("prompt", "must not be empty", limit=1)
            return prompt, ids
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise RequestError("prompt", f"a token-id array must be 1-D integers, got "
                                   f"{prompt.dtype} with shape {prompt.shape}")
            ids = tuple(int(t) for t in prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
                       for t in prompt):
                bad = next(t for t in prompt if not isinstance(t, (int, np.integer))
                           or isinstance(t, (bool, np.bool_)))
                raise RequestError("prompt", f"token ids must be ints, got {bad!r}")
            ids = tuple(int(t) for t in prompt)
        else:
            raise RequestError("prompt", "must be a string or a list of token ids, got "
                               f"{type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt", "must not be empty", limit=1)
        return None, ids

    def abort(self, request_id: str) -> None:
        """Aborts an unfinished request (any thread). Its blocks are freed at once when no
        step is running, else at the start of the next step; its final output has reason
        "abort".

        Raises:
          UnknownRequestError: the id is not an unfinished request.
        """
        rid = str(request_id)
        with self._lock:
            if rid not in self._unfinished:
                raise UnknownRequestError(rid, f"{rid!r} is not an unfinished request")
            self._inbox.append(("abort", rid))
        if self.sync is None and self._step_lock.acquire(blocking=False):  # apply it now
            try:
                self._deliver(self._drain())
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        """Whether any submitted request has not finished (O(1))."""
        return bool(self._unfinished)

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    def unfinished_ids(self) -> list[str]:
        """Ids of every unfinished request (a snapshot)."""
        with self._lock:
            return list(self._unfinished)

    def fail_all(self, message: str) -> None:
        """Finishes every unfinished request with reason "error" and frees its blocks (after
        a step raised: the engine's state stays consistent, its requests do not go on)."""
        with self._step_lock:
            changed = self._drain() if self.sync is None else {}  # multi-host: in a step only
            now = self.clock()
            for rid, req in list(self.requests.items()):
                if not req.finished:
                    self.state = scheduler.abort(self.state, rid)
                    req.finish(FINISH_ERROR, now, message)
                    changed[rid] = req
            # every request is aborted: nothing in flight can matter any more
            self.state = scheduler.abandon(self.state, [])
            self._in_flight = None
            for group in self._groups.values():  # n > 1 children not yet in the scheduler
                for req, _ in group.waiting:
                    req.finish(FINISH_ERROR, now, message)
                    changed[req.request_id] = req
                group.waiting.clear()
            self._deliver(changed)

    # --- the step (one thread at a time) ---------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine iteration; returns the outputs of requests without a sink
        (those of this step and any not yet returned)."""
        self.run_step()
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def run_step(self) -> None:
        """Runs one engine iteration; outputs go to sinks or to the pending list."""
        with self._step_lock:
            changed = self._drain()
            changed.update(self._iterate())
            self._deliver(changed)

    def _drain(self) -> dict[str, RequestState]:
        """Applies queued adds and aborts (stepping thread). Returns the aborted requests."""
        with self._lock:
            items, self._inbox = self._inbox, []
        if self.sync is not None:
            items = self._exchange_inbox(items)
        changed = {}
        now = self.clock()
        for item in items:
            if item[0] == "group":
                group = item[1]
                self._groups[group.request_id] = group
                for req, request in item[2]:
                    self._enter(req, request, changed, now)
                continue
            if item[0] == "add":
                self._enter(item[1], item[2], changed, now)
                continue
            rid = item[1]
            group = self._groups.get(rid)
            for req in (group.children if group else [self.requests.get(rid)]):
                if req is None or req.finished:  # already finished, or aborted twice
                    continue
                if req.request_id in self.requests:
                    self.state = scheduler.abort(self.state, req.request_id)
                req.finish(FINISH_ABORT, now)
                changed[req.request_id] = req
            if group:
                group.waiting.clear()
        return changed

    def _enter(self, req: RequestState, request: scheduler.Request, changed: dict,
               now: float) -> None:
        """Puts one request into the scheduler (stepping thread)."""
        self.requests[req.request_id] = req
        self._traced[req.request_id] = 0
        try:
            self.state = scheduler.add_request(self.state, request)
        except Exception as e:  # noqa: BLE001  validated at submission: a bug if seen
            req.finish(FINISH_ERROR, now, f"could not be queued: {e!r}")
            changed[req.request_id] = req

    def _exchange_inbox(self, items: list) -> list:
        """Multi-host: the leader's inbox items, in order, the same on every process."""
        wire = [("add", it[1].request_id, it[1].prompt, it[1].prompt_ids, it[1].params,
                 it[1].seed, it[1].arrival, it[2].max_tokens, it[2].priority)
                if it[0] == "add" else it for it in items]
        received = self.sync.exchange_inbox(wire)
        if self.sync.is_leader:
            return items
        out = []
        for item in received:
            if item[0] != "add":
                out.append(item)
                continue
            _, rid, text, ids, params, seed, arrival, max_tokens, priority = item
            with self._lock:
                self._unfinished.add(rid)
            out.append(("add", self._state(rid, text, ids, params, seed, arrival),
                        scheduler.Request(request_id=rid, prompt_token_ids=ids,
                                          max_tokens=max_tokens, arrival_time=arrival,
                                          priority=priority)))
        return out

    def _iterate(self) -> dict[str, RequestState]:
        """Plans and launches one step; commits the step before it (overlapped) or this one.

        Serial: schedule -> launch -> collect -> commit. Overlapped (`async_scheduling`): the
        step launched by the previous call is still running; it is advanced with placeholder
        tokens (`scheduler.advance`), the next step is planned and launched behind it (its
        placeholder ids fed on the device), and only then is the previous step collected and
        committed, while the device runs the new one.
        """
        prev = self._in_flight
        ahead = self.state
        if prev is not None:
            try:
                ahead = scheduler.advance(self.state, prev.plan)
            except Exception as e:  # noqa: BLE001  a bug: drop the step's requests
                self._in_flight = None
                return self._abandon([prev], f"advance failed: {e!r}")
        plan = scheduler.schedule(ahead, self.sched_config)
        if self.sync is not None:  # every process must have planned this very step
            self.sync.check_plan(plan_digest(plan, [
                (self.requests[rid].seed, len(self.requests[rid].token_ids))
                for rid in plan.request_ids]))
        self.state = plan.state
        changed: dict[str, RequestState] = {}
        launched = None
        if not plan.is_empty:
            launched = self._launch(plan, prev)
            if not isinstance(launched, _Launched):  # packing or dispatch failed: plan dropped
                self.state = ahead
                changed = self._fail(plan, *launched)
                launched = None
        # Registered before `prev` is finished: whatever happens there, the step launched
        # behind it is known (to commit next time, or to abandon).
        self._in_flight = launched if self.async_scheduling else None
        if prev is not None and self.state.unfilled is not None:  # (a reset dropped it)
            done, ok = self._finish(prev, launched)
            changed.update(done)
            if not ok:  # the failure took the step launched behind it down too
                self._in_flight = launched = None
        if launched is not None and not self.async_scheduling:
            changed.update(self._finish(launched, None)[0])
        return changed

    def _launch(self, plan, prev: "_Launched | None"):
        """Packs and dispatches `plan`. Returns a `_Launched`, or (reqs, start, message) when
        packing or dispatch failed."""
        start = self.clock()
        reqs = [self.requests.get(rid) for rid in plan.request_ids]
        compiled_before = self.runner.num_executables
        try:
            for req, cached in zip(reqs, plan.num_cached):
                if req.first_scheduled is None:
                    req.first_scheduled = start
                    req.num_cached_tokens = cached
            # decode rows whose input token is the previous step's, still on the device
            ahead = [i for i in range(plan.num_decode_rows)
                     if plan.row_token_ids(i)[0] == scheduler.PLACEHOLDER]
            prompts = logprobs.prompt_rows(plan, reqs)
            prepared = self.runner.prepare(plan, logprobs.sampling_rows(
                plan, reqs, self.runner.counts, self.eos_token_ids, set(ahead)), prompts)
            feed = _feed_rows(plan, ahead, prev, prepared[0].tokens) if ahead else None
            handle = self.runner.launch(*prepared, feed=feed)
        except Exception as e:  # noqa: BLE001  the step fails, the engine goes on
            return reqs, start, f"device step failed: {e!r}"
        return _Launched(plan, reqs, handle, prepared[0], prompts, start,
                         self.runner.num_executables > compiled_before)

    def _finish(self, step: "_Launched", after: "_Launched | None"
                ) -> tuple[dict[str, RequestState], bool]:
        """Collects a launched step's tokens and commits them. `after`: the step launched
        behind it (overlapped), which a failure here takes down too. Returns the changed
        requests and whether it succeeded."""
        plan, reqs = step.plan, step.reqs
        try:
            out = self.runner.collect(step.handle)
            tokens = out.tokens
            lp = (logprobs.host_logprobs(out.logprobs) if any(
                r.logprobs is not None for r in reqs) else None)
            if step.prompts is not None:
                logprobs.record_prompt_logprobs(plan, reqs, step.prompts, logprobs.host_logprobs(
                    out.prompt_logprobs), self.tokenizer)
        except Exception as e:  # noqa: BLE001  the step fails, the engine goes on
            return self._abandon([step, after], f"device step failed: {e!r}", device=True), False
        now = self.clock()
        live = [i for i, (req, s) in enumerate(zip(reqs, plan.samples))
                if s and not req.finished and req.request_id in self.requests]
        snapshots = [(reqs[i], reqs[i].snapshot()) for i in live]
        sampled = [int(tokens[i]) for i, s in enumerate(plan.samples) if s]
        stopped, changed = [], {}
        try:
            for i in live:
                req, token = reqs[i], int(tokens[i])
                try:
                    entry = logprobs.sampled_entry(lp, i, token, req, self.tokenizer)
                    if req.append(token, now, self.eos_token_ids, entry):
                        stopped.append(req.request_id)
                except Exception as e:  # noqa: BLE001  one request's bug stops only it
                    req.finish(FINISH_ERROR, now, f"output processing failed: {e!r}")
                    stopped.append(req.request_id)
                changed[req.request_id] = req
            state, finished = scheduler.commit(self.state, plan, sampled, now,
                                               finished_ids=tuple(stopped))
        except Exception as e:  # noqa: BLE001  commit failed: roll every request back
            for req, snap in snapshots:
                req.restore(snap)
            return self._abandon([step, after], f"commit failed: {e!r}"), False
        self.state = state
        for f in finished:
            self.requests[f.request_id].finish(f.reason, now)
        sampled_ids = tuple(reqs[i].request_id for i in live)
        for rid in sampled_ids:
            self._traced[rid] += 1
        bucket = step.bucket
        self._record(StepRecord(
            index=self.num_steps, start=step.start, end=now,
            prefill_tokens=plan.num_prefill_tokens, decode_tokens=plan.num_decode_tokens,
            num_seqs=plan.num_seqs, bucket=(bucket.tokens, bucket.seqs, bucket.max_q_len),
            compiled=step.compiled, engaged=plan.engaged.as_dict(), sampled=sampled_ids,
            cached_tokens=plan.num_cached_tokens, dispatched=step.handle.dispatched,
            ready=step.handle.wait_ready(), expert_tokens=out.expert_tokens()))
        return changed, True

    def _abandon(self, steps: list["_Launched | None"], message: str, *,
                 device: bool = False) -> dict[str, RequestState]:
        """A launched step failed (device, commit, or advance): every request of `steps` (the
        step and, overlapped, the one launched behind it) finishes with "error", and their
        plans leave the scheduler state (`scheduler.abandon`); the others go on, unless the
        device failed (`device`) or the call consumed the cache: then `_reset_device`."""
        now = self.clock()
        changed = {}
        steps = [s for s in steps if s is not None]
        for s in steps:
            for req in s.reqs:
                if req is not None and req.request_id in self.requests and not req.finished:
                    req.finish(FINISH_ERROR, now, message)
                    changed[req.request_id] = req
        self.state = scheduler.abandon(self.state, [s.plan for s in steps])
        if device or self.runner.cache_lost():
            # The KV of the failed step (and of blocks `advance` already cached from it) is
            # unknown: start afresh.
            self._reset_device(now, message, changed)
        for s in steps:
            self._record_failure(s.plan, s.start, now, message)
        return changed

    def _fail(self, plan, reqs: list[RequestState], start: float,
              message: str) -> dict[str, RequestState]:
        """A failed step: its requests finish with "error" and free their blocks."""
        now = self.clock()
        changed = {}
        for req in reqs:
            if req is not None and req.request_id in self.requests and not req.finished:
                self.state = scheduler.abort(self.state, req.request_id)
                req.finish(FINISH_ERROR, now, message)
                changed[req.request_id] = req
        if self.runner.cache_lost():  # the donated cache died with the call: start afresh
            self._reset_device(now, message, changed)
        self._record_failure(plan, start, now, message)
        return changed

    def _record_failure(self, plan, start: float, now: float, message: str) -> None:
        """The trace record of a failed step (nothing ran, nothing sampled)."""
        self._record(StepRecord(
            index=self.num_steps, start=start, end=now, prefill_tokens=0, decode_tokens=0,
            num_seqs=plan.num_seqs, bucket=(0, 0, 0), compiled=False,
            engaged=plan.engaged.as_dict(), sampled=(), error=message))

    def _reset_device(self, now: float, message: str, changed: dict) -> None:
        """The KV cache is lost or unknown: every running request finishes with "error", the
        step in flight is dropped, the cache is rebuilt and the prefix cache forgotten (its
        digests would point at zeroed KV)."""
        for rid, req in list(self.requests.items()):
            if not req.finished:
                self.state = scheduler.abort(self.state, rid)
                req.finish(FINISH_ERROR, now, message + " (KV cache reset)")
                changed[rid] = req
        self.state = scheduler.forget_prefix_cache(scheduler.abandon(self.state, []))
        self._in_flight = None
        self.runner.reset_cache()

    def _record(self, record: StepRecord) -> None:
        self.num_steps += 1
        self.trace.append(record)
        if self.trace_sink is not None:
            try:
                self.trace_sink(record)
            except Exception as e:  # noqa: BLE001  a broken sink must not stop the engine
                self.trace_sink_error = f"trace_sink failed and was detached: {e!r}"
                self.trace_sink = None

    def _deliver(self, changed: dict[str, RequestState]) -> None:
        """Hands every changed request's output to its sink (or the pending list) and
        releases finished requests. A child of an n > 1 request is reported through its
        group's output (once per call), whose waiting children enter when ready."""
        pending, groups = [], {}
        for rid, req in changed.items():
            out = req.output() if req.parent_id is None else None
            if req.finished:
                self.requests.pop(rid, None)
                self.runner.counts.release(rid)
                traced = self._traced.pop(rid, 0)
                if traced != len(req.token_ids):
                    self._trace_errors.append(f"{rid}: {len(req.token_ids)} tokens, "
                                              f"{traced} traced")
            if req.parent_id is not None:
                groups[req.parent_id] = self._groups[req.parent_id]
                continue
            self._emit(rid, out, req.sink, pending)
        now = self.clock()
        for gid, group in groups.items():
            if group.ready():  # child 0's prompt is computed: the others share its blocks
                waiting, group.waiting = group.waiting, []
                for req, request in waiting:
                    self._enter(req, request, {}, now)
            if group.finished:
                del self._groups[gid]
            self._emit(gid, group.output(), group.sink, pending)
        if pending:
            with self._lock:
                self._pending.extend(pending)

    def _emit(self, rid: str, out: RequestOutput, sink, pending: list) -> None:
        if out.finished:
            with self._lock:
                self._unfinished.discard(rid)
        if sink is None:
            pending.append(out)
            return
        try:
            sink(out)
        except Exception:  # noqa: BLE001  its consumer is gone: stop generating for it
            if not out.finished:
                with self._lock:
                    self._inbox.append(("abort", rid))

    # --- checks -------------------------------------------------------------------------
    def check_trace(self) -> int:
        """Self-check: every request released so far had exactly as many tokens as the
        trace sampled for it, and every held request agrees so far. Returns the number of
        requests held. Raises AssertionError listing disagreements."""
        bad = list(self._trace_errors)
        bad += [f"{rid}: {len(r.token_ids)} tokens, {self._traced.get(rid)} traced"
                for rid, r in self.requests.items() if len(r.token_ids) != self._traced.get(rid)]
        if bad:
            raise AssertionError(f"trace disagrees with outputs: {bad}")
        return len(self.requests)

    def stats(self) -> dict[str, int]:
        """A consistent snapshot for monitoring (any thread): requests waiting (queued in the
        inbox or the scheduler), running, unfinished; KV blocks in use and in all; steps."""
        state = self.state  # an immutable snapshot
        with self._lock:
            queued = sum(1 for item in self._inbox if item[0] in ("add", "group"))
            unfinished = len(self._unfinished)
        return {"waiting": len(state.waiting) + queued, "running": state.num_running,
                "unfinished": unfinished, "kv_blocks_in_use": state.pool.num_in_use,
                "kv_blocks_total": self.sched_config.num_blocks, "steps": self.num_steps}

    def blocks_in_use(self) -> int:
        """KV blocks held by running sequences."""
        return self.sched_config.num_blocks - self.state.pool.num_free
