"""The engine loop: the imperative shell around the pure scheduler.

One `step()`:
  1. plan = scheduler.schedule(state, config)        pure: chunks, blocks, engaged
  2. bucket, batch = runner.prepare(plan's chunks)   host arrays padded to a bucket
  3. tokens = runner.run(bucket, batch, sampling)    one jitted executable per bucket
  4. state, finished = scheduler.commit(...)         cursors, tokens, frees blocks
  5. trace record + incremental RequestOutputs       (stop strings, detokenization)

NOTE: invariants.
- The scheduler owns sequences, cursors and KV blocks; the engine owns only what the
  scheduler must not know: text, sampling params, stop conditions, timings.
- Every rejected request is rejected in `add_request`, before the scheduler sees it,
  so a bad request never disturbs the others.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import zlib
from typing import Sequence


import scheduler
from arcjax.batching import SeqChunk
from arcjax.errors import RequestError, UnknownRequestError
from arcjax.outputs import RequestMetrics, RequestOutput
from arcjax.runner import ModelRunner
from arcjax.sampling import SamplingParams
from arcjax.tokenizer import IncrementalDetokenizer, Tokenizer
from arcjax.trace import StepRecord


@dataclasses.dataclass
class _Request:
    """Engine-side bookkeeping of one request (mutable; lives in the shell only)."""

    request_id: str
    prompt: str | None
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival: float
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_len: int = 0  # chars of `text` already returned as delta_text
    token_times: list[float] = dataclasses.field(default_factory=list)
    first_scheduled: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None

    def output(self) -> RequestOutput:
        delta, self.emitted_len = self.text[self.emitted_len:], len(self.text)
        metrics = RequestMetrics(self.arrival, self.first_scheduled,
                                 self.token_times[0] if self.token_times else None,
                                 tuple(self.token_times), self.finished_time)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.text,
                             tuple(self.token_ids), self.finish_reason is not None,
                             self.finish_reason, metrics, delta)


class Engine:
    """Online engine: `add_request`, `step`, `abort`, `has_unfinished`."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None,
                 sched_config: "scheduler.SchedulerConfig", *, max_model_len: int,
                 seed: int = 0, clock=time.perf_counter):
        self.runner, self.tokenizer = runner, tokenizer
        self.sched_config, self.max_model_len = sched_config, max_model_len
        self.state = scheduler.SchedulerState.empty(sched_config)
        self.requests: dict[str, _Request] = {}
        self.trace: list[StepRecord] = []
        self.clock = clock
        self._seed, self._ids = seed, itertools.count()
        self._aborted: list[str] = []  # aborted since the last step, reported by it
        eos = tokenizer.eos_token_ids if tokenizer else runner.cfg.eos_token_ids
        self.eos_token_ids = frozenset(eos)

    # --- submission -------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validates and queues one request. Returns its id. Raises RequestError."""
        params = params if params is not None else SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        text, ids = self.check(prompt, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        seed = params.seed if params.seed is not None else zlib.crc32(
            f"{self._seed}:{request_id}".encode())
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        request = scheduler.Request(request_id=request_id, prompt_token_ids=ids,
                                    max_tokens=params.max_tokens, arrival_time=arrival)
        try:
            self.state = scheduler.add_request(self.state, request)
        except ValueError as e:
            raise RequestError(str(e)) from e
        self.requests[request_id] = _Request(request_id, text, ids, params, seed, arrival, detok)
        return request_id

    def check(self, prompt, params: SamplingParams) -> tuple[str | None, tuple[int, ...]]:
        """Validates a request without queueing it. Returns (prompt text, token ids)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        self._validate(ids, params)
        return text, ids

    def _tokenize(self, prompt) -> tuple[str | None, tuple[int, ...]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: a string prompt needs a tokenizer; pass token ids")
            return prompt, tuple(self.tokenizer.encode(prompt))
        try:
            ids = tuple(int(t) for t in prompt)
        except (TypeError, ValueError) as e:
            raise RequestError(f"prompt must be a string or a list of token ids ({e})") from e
        return None, ids

    def _validate(self, ids: tuple[int, ...], params: SamplingParams) -> None:
        vocab = self.runner.cfg.vocab_size
        if not ids:
            raise RequestError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens, more than max_model_len "
                               f"{self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                               f"exceeds max_model_len {self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})")
        limit = self.sched_config.max_request_tokens
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"prompt + max_tokens ({len(ids) + params.max_tokens} tokens) "
                               f"exceeds the KV cache's capacity of {limit} tokens per request")

    def abort(self, request_id: str) -> None:
        """Aborts a waiting or running request; its KV blocks are freed at once."""
        req = self.requests.get(str(request_id))
        if req is None or req.finish_reason is not None:
            raise UnknownRequestError(f"request_id {request_id!r} is not an unfinished request")
        self.state = scheduler.abort(self.state, req.request_id)
        req.finish_reason, req.finished_time = "abort", self.clock()
        self._aborted.append(req.request_id)

    def has_unfinished(self) -> bool:
        return any(r.finish_reason is None for r in self.requests.values())

    # --- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine iteration; returns outputs of requests that changed."""
        changed = {rid: self.requests[rid] for rid in self._aborted}
        self._aborted = []
        plan = scheduler.schedule(self.state, self.sched_config)
        if plan.is_empty:
            self.state = plan.state
            return self._emit(changed)
        start = self.clock()
        plan_chunks = plan.chunks
        chunks, rows = [], []
        for c in plan_chunks:
            req = self.requests[c.request_id]
            if req.first_scheduled is None:
                req.first_scheduled = start
            chunks.append(SeqChunk(c.token_ids, c.start, c.block_table))
            rows.append((req.params, req.seed, len(req.token_ids)))
        bucket, batch, sampling = self.runner.prepare(chunks, rows)
        compiles_before = self.runner.compile_count
        tokens = self.runner.run(bucket, batch, sampling)
        now = self.clock()
        compiled = self.runner.compile_count > compiles_before
        sampled, stopped = [], []
        for i, c in enumerate(plan_chunks):
            if c.samples:
                req = self.requests[c.request_id]
                sampled.append(int(tokens[i]))
                if self._append(req, int(tokens[i]), now):
                    stopped.append(req.request_id)
                changed[req.request_id] = req
        self.state, finished = scheduler.commit(plan.state, plan, sampled, now,
                                                finished_ids=tuple(stopped))
        for f in finished:
            req = self.requests[f.request_id]
            req.finish_reason = req.finish_reason or f.reason
            req.finished_time = now
            if req.detok is not None and req.finish_reason == "length":
                req.text += req.detok.flush()
        self.trace.append(StepRecord(
            index=len(self.trace), start=start, end=now,
            prefill_tokens=plan.num_prefill_tokens, decode_tokens=plan.num_decode_tokens,
            num_seqs=plan.num_seqs, bucket=(bucket.tokens, bucket.seqs, bucket.max_q_len),
            compiled=compiled, engaged=plan.engaged.as_dict(),
            sampled=tuple(c.request_id for c in plan_chunks if c.samples)))
        return self._emit(changed)

    def _append(self, req: _Request, token: int, now: float) -> bool:
        """Records one sampled token; returns True if it ends the request with "stop"."""
        req.token_ids.append(token)
        req.token_times.append(now)
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            if req.detok is not None:  # the stop token's own text is left out (as vLLM)
                req.text += req.detok.flush()
            req.finish_reason = "stop"
            return True
        if req.detok is not None:
            old_len = len(req.text)
            req.text += req.detok.add(token)
            for s in p.stop:
                cut = req.text.find(s, max(0, old_len - len(s) + 1))
                if cut >= 0:
                    req.text = req.text[:cut]
                    req.emitted_len = min(req.emitted_len, cut)
                    req.finish_reason = "stop"
                    return True
        return False

    def _emit(self, changed: dict[str, _Request]) -> list[RequestOutput]:
        outs = [r.output() for r in changed.values()]
        for r in changed.values():
            if r.finish_reason is not None and r.detok is not None:
                r.detok = None  # free the detokenizer's history
        return outs

    def check_trace(self) -> dict[str, int]:
        """Self-check: every request's token count equals the tokens the trace sampled."""
        counts = collections.Counter(rid for rec in self.trace for rid in rec.sampled)
        bad = {rid: (len(r.token_ids), counts.get(rid, 0)) for rid, r in self.requests.items()
               if len(r.token_ids) != counts.get(rid, 0)}
        if bad:
            raise AssertionError(f"trace disagrees with outputs (tokens, traced): {bad}")
        return counts

    def blocks_in_use(self) -> int:
        return self.sched_config.num_blocks - self.state.pool.num_free
