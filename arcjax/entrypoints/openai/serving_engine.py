"""What the generation endpoints share (vLLM's `serving_engine.OpenAIServing`): preparing
off the event loop, queueing under one admission step, collecting or streaming outputs.

1. An endpoint (`serving_completion`, `serving_chat`) gets the raw body from the app (auth,
   draining and the size cap are checked there) and prepares it in the worker pool
   (`_in_pool`): parsed by `protocol` (typed errors name the field), every prompt
   tokenized and checked by `Engine.check` (`_engine_check`: all or nothing).
2. `_serve`: back on the loop, one synchronous step checks the queue limit and queues
   every prompt (`_submit`, `AsyncLLM.submit`) under a server-chosen request id
   ("<prefix>-<hex>-<prompt index>"); with `n` > 1 the engine returns n completions per
   prompt, choice index prompt_index * n + sample index.
3. Non-streaming (FINAL_ONLY outputs): outputs are collected while a watcher waits for the
   client's `http.disconnect`, then the endpoint's `_response` builds the body. Streaming
   (DELTA outputs): the first output is awaited under the same watcher (so a bad request
   still gets its 400 before any header), then the endpoint's `_chunks` reads the outputs
   through `StreamedChoices` (per-choice deltas, the usage chunk) and `event_stream` frames
   them as server-sent events. Either way the request streams are closed when the
   response ends, however it ends, which aborts the requests not finished: their KV blocks
   are freed at the start of the next engine step at the latest.

NOTE: the event loop never blocks on the engine: streams ask for DELTA outputs, and
`AsyncLLM` hands them over through a one-slot collector per request that merges what a
slow reader has not taken. A dead engine (`EngineDeadError`) ends every stream with an
error event. `RequestTracker` is touched only from the event loop.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arcjax.entrypoints.async_llm import AsyncLLM, RequestStream
from arcjax.entrypoints.openai import protocol as proto
from arcjax.entrypoints.openai.http_server import (EventStream, HTTPError, close_outputs,
                                                   until_disconnect)
from arcjax.entrypoints.openai.response_logprobs import ChoiceStream, completions_of
from arcjax.entrypoints.openai.server_metrics import ServerMetrics
from arcjax.entrypoints.openai.serving_models import OpenAIServingModels
from arcjax.entrypoints.openai.structured_fields import rename_field
from arcjax.errors import EngineDeadError, InputError, RequestError, StructuredOutputsError
from arcjax.outputs import RequestOutput
from arcjax.sampling_params import RequestOutputKind

log = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"  # the unknown request fields that were ignored


class RequestTracker:
    """What the server is serving now (event loop only).

    Attributes:
      active: engine request ids the server waits on (a drain aborts them).
      in_flight: generation requests (HTTP) whose response has not ended.
      ignored_logged: the unknown request field names logged so far (each once).
    """

    def __init__(self):
        self.active: set[str] = set()
        self.in_flight = 0
        self.ignored_logged: set[str] = set()

    def ignored_header(self, parsed: proto.ParsedRequest) -> dict:
        """Logs each unknown field name once; the response header listing this request's."""
        for name in parsed.ignored:
            if name not in self.ignored_logged:
                self.ignored_logged.add(name)
                log.warning("ignoring the unknown request field %r (logged once)", name)
        return {IGNORED_FIELDS_HEADER: ", ".join(parsed.ignored)} if parsed.ignored else {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingContext:
    """What every endpoint of one server shares.

    Attributes:
      llm: the engine loop.
      models: the served model (name, `model` checks).
      metrics: the server's Prometheus metrics (finished and aborted requests).
      tracker: the requests being served.
      pool: where requests are prepared (parsing, rendering, tokenization).
      max_queued_requests: 429 for a request that would make more wait; None = no limit.
      max_stop_strings: a request asking for more stop strings is refused.
    """

    llm: AsyncLLM
    models: OpenAIServingModels
    metrics: ServerMetrics
    tracker: RequestTracker
    pool: ThreadPoolExecutor
    max_queued_requests: int | None
    max_stop_strings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedRequest:
    """One generation request as its response sees it.

    Attributes:
      parsed: what the request asked for.
      request_id: the response's id; the engine's request ids add "-<prompt index>".
      created: the response's creation time (Unix seconds).
      model: the served model's name.
      num_prompts: how many prompts were queued (choices: num_prompts * n).
    """

    parsed: proto.ParsedRequest
    request_id: str
    created: int
    model: str
    num_prompts: int


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """What one streamed choice has new: its index (prompt_index * n + sample index), the
    text, its log-probabilities (None: not asked, or nothing new) and the finish reason
    (None: still running)."""

    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class OutputDeltas:
    """One engine output of a streamed request: its choices' deltas, and the error event to
    send when the output ends its prompt's generation in failure (else None)."""

    choices: tuple[ChoiceDelta, ...]
    failure: dict | None


class StreamedChoices:
    """The outputs of a streamed request read per choice: `async for step in choices`
    gives one `OutputDeltas` per engine output (a choice appears when it has something to
    send: text held back by the detokenizer rides, with its logprobs, in the next one).
    Remembers each prompt's final output and counts the choices' tokens for
    `usage_chunk`."""

    def __init__(self, served: ServedRequest, first: tuple[int, RequestOutput],
                 rest: AsyncIterator[tuple[int, RequestOutput]], *, chat: bool):
        self._served, self._first, self._rest = served, first, rest
        self._choices = ChoiceStream(served.parsed.params.logprobs, chat)
        self._finals: list[RequestOutput | None] = [None] * served.num_prompts

    def __aiter__(self) -> "StreamedChoices":
        return self

    async def __anext__(self) -> OutputDeltas:
        if self._first is not None:
            (i, out), self._first = self._first, None
        else:
            i, out = await self._rest.__anext__()  # StopAsyncIteration after the last
        n = self._served.parsed.params.n
        deltas = []
        for c in completions_of(out):
            index = i * n + c.index
            new = self._choices.delta(index, c)
            if new is not None:
                deltas.append(ChoiceDelta(index, *new))
        failure = None
        if out.finished:
            self._finals[i] = out
            if out.finish_reason == "error":
                failure = proto.error_body(f"generation failed: {out.error}", "internal_error")
        return OutputDeltas(tuple(deltas), failure)

    def usage_chunk(self, obj: str) -> dict:
        """The chunk `stream_options.include_usage` asks for, after every choice's last
        (`obj`: the endpoint's chunk object name)."""
        s = self._served
        return proto.usage_chunk(s.request_id, s.created, s.model, obj, self._finals,
                                 sum(self._choices.tokens.values()))


async def event_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The SSE body of a streamed response: each chunk as one event, then `[DONE]`. An
    error that ends the stream early (a prompt refused when queued, after the first output;
    a dead engine) is its last event instead. Closing the body closes `chunks`."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield proto.sse(chunk)
            yield proto.sse("[DONE]")
        except InputError as e:
            yield proto.sse(proto.error_body(str(e), "invalid_request_error", e.field))
        except EngineDeadError as e:
            yield proto.sse(proto.error_body(str(e), "service_unavailable", code="engine_dead"))


class OpenAIServing(abc.ABC):
    """The base of the generation endpoints (see the module docstring). A subclass sets
    `REQUEST_ID_PREFIX` and `CHAT` and builds its whole response (`_response`) and its
    stream's chunks (`_chunks`)."""

    REQUEST_ID_PREFIX: ClassVar[str]  # the response id's prefix ("cmpl", "chatcmpl")
    CHAT: ClassVar[bool]  # log-probabilities in chat's shape (else completions')

    def __init__(self, context: ServingContext):
        self.llm = context.llm
        self.models = context.models
        self.metrics = context.metrics
        self.tracker = context.tracker
        self.max_stop_strings = context.max_stop_strings
        self._max_queued = context.max_queued_requests
        self._pool = context.pool

    # --- preparation (worker pool) ----------------------------------------------------------
    async def _in_pool(self, fn: Callable[[bytes], tuple], raw: bytes):
        """`fn(raw)` in the worker pool: the event loop serves everyone meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, raw)

    def _engine_check(self, prompt, params, parsed: proto.ParsedRequest,
                      prompt_field: str) -> tuple[int, ...]:
        """`Engine.check` with the request's own field names. Returns the prompt's ids."""
        try:
            return self.llm.engine.check(prompt, params)[1]
        except StructuredOutputsError as e:  # a constraint that does not compile
            raise rename_field(e, parsed.constraint) from None
        except RequestError as e:
            max_field = parsed.max_tokens_field if parsed.max_tokens_given else prompt_field
            field = {"prompt": prompt_field, "max_tokens": max_field}.get(e.field, e.field)
            raise RequestError(field, e.message, limit=e.limit) from None

    # --- generation (event loop) ------------------------------------------------------------
    @abc.abstractmethod
    def _response(self, served: ServedRequest, finals: Sequence[RequestOutput]) -> dict:
        """The whole response's body, from every prompt's final output."""

    @abc.abstractmethod
    def _chunks(self, served: ServedRequest, choices: StreamedChoices) -> AsyncIterator[dict]:
        """The stream's chunks, in order (the SSE framing is `event_stream`'s)."""

    async def _serve(self, request: Request, parsed: proto.ParsedRequest,
                     prompts: Sequence[tuple[int, ...]]) -> Response:
        """Queues the prompts and answers: the whole response, or its event stream."""
        served = ServedRequest(parsed=parsed, request_id=f"{self.REQUEST_ID_PREFIX}-"
                                                        f"{uuid.uuid4().hex}",
                               created=int(time.time()), model=self.models.model_name,
                               num_prompts=len(prompts))
        headers = self.tracker.ignored_header(parsed)
        # streams carry what is new in each step; a whole response needs the final only
        kind = RequestOutputKind.DELTA if parsed.stream else RequestOutputKind.FINAL_ONLY
        streams = self._submit(served.request_id, prompts,
                               dataclasses.replace(parsed.params, output_kind=kind))
        outputs = self._outputs(streams)
        self.tracker.in_flight += 1
        handed_over = False
        try:
            if not parsed.stream:
                ok, finals = await until_disconnect(request, self._collect(outputs,
                                                                           len(prompts)))
                if not ok:
                    return Response(status_code=499)  # nobody is listening
                failed = next((o for o in finals if o.finish_reason == "error"), None)
                if failed is not None:
                    raise HTTPError(500, f"generation failed: {failed.error}", "internal_error")
                return JSONResponse(self._response(served, finals), headers=headers)
            ok, first = await until_disconnect(request, outputs.__anext__())
            if not ok:
                return Response(status_code=499)
            body = event_stream(self._chunks(served, StreamedChoices(served, first, outputs,
                                                                     chat=self.CHAT)))

            async def on_close():
                await close_outputs(outputs, streams)
                self.tracker.in_flight -= 1

            handed_over = True
            return EventStream(body, on_close, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", **headers})
        finally:
            if not handed_over:
                await close_outputs(outputs, streams)
                self.tracker.in_flight -= 1

    def _submit(self, rid: str, prompts, params) -> list[RequestStream]:
        """Checks the queue limit and queues every prompt in one step (no other request
        is admitted in between: exact under concurrency); all or nothing."""
        with self.llm.admission_lock:
            limit = self._max_queued
            n = len(prompts) * params.n
            if limit is not None and self.llm.engine.stats()["waiting"] + n > limit:
                raise HTTPError(429, f"too many requests waiting (limit {limit}); retry later",
                                "rate_limit_error", code="queue_full")
            streams: list[RequestStream] = []
            try:
                for i, p in enumerate(prompts):
                    streams.append(self.llm.submit(p, params, f"{rid}-{i}"))
            except BaseException:
                for s in streams:
                    s.cancel()
                raise
        return streams

    async def _outputs(self, gens: list[RequestStream]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt, as they come. Leaving early aborts the
        requests still running (their streams are closed)."""
        rids = [g.request_id for g in gens]
        self.tracker.active.update(rids)
        finished: set[int] = set()
        tasks: list[asyncio.Task] = []
        try:
            if len(gens) == 1:  # the common case: no merging
                async for out in gens[0]:
                    if out.finished:
                        finished.add(0)
                        self.metrics.on_finished(out)
                    yield 0, out
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, gen):
                try:
                    async for out in gen:
                        queue.put_nowait((i, out, None))
                except Exception as e:  # noqa: BLE001  handed to the consumer
                    queue.put_nowait((i, None, e))

            tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
            while len(finished) < len(gens):
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                if out.finished:
                    finished.add(i)
                    self.metrics.on_finished(out)
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except asyncio.CancelledError:
                    pass
            for i, gen in enumerate(gens):
                if i not in finished:
                    await gen.aclose()  # aborts it
                    self.metrics.requests["abort"].inc()
            self.tracker.active.difference_update(rids)

    @staticmethod
    async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]],
                       num_prompts: int) -> list[RequestOutput]:
        """Every prompt's final output (FINAL_ONLY outputs: the only one)."""
        finals: list[RequestOutput | None] = [None] * num_prompts
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
        return finals
