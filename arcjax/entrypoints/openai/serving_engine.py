"""What the generation endpoints share (vLLM's `serving_engine.OpenAIServing`): preparing
off the event loop, queueing under one admission step, collecting or streaming outputs.

1. An endpoint (`serving_completion`, `serving_chat`) gets the raw body from the app (auth,
   draining and the size cap are checked there) and prepares it in the worker pool
   (`_in_pool`): validated by `protocol` and turned into engine inputs by
   `request_params` (typed errors name the field), every prompt tokenized and checked by
   `Engine.check` (`_engine_check`: all or nothing). A `model` naming a LoRA adapter
   (`OpenAIServingModels.check_model`) runs every prompt with it.
2. `_serve`: back on the loop, one synchronous step checks the queue limit and queues
   every prompt (`_submit`, `AsyncLLM.submit`, with the request's `priority`) under the
   request id ("<prefix>-<request_id or hex>-<prompt index>"); with `n` > 1 the engine
   returns n completions per prompt, choice index prompt_index * n + sample index.
3. Non-streaming (FINAL_ONLY outputs): outputs are collected while a watcher waits for the
   client's `http.disconnect`, then the endpoint's `_response` builds the body. Streaming
   (DELTA outputs): the first output is awaited under the same watcher (so a bad request
   still gets its 400 before any header), then the endpoint's `_chunks` reads the outputs
   through `StreamedChoices` (per-choice deltas, the usage chunk; `streamed_choices.py`) and
   `event_stream` frames
   them as server-sent events (an error event, then `[DONE]`, ends a stream that fails,
   as vLLM's). Either way the request streams are closed when the
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
from arcjax.entrypoints.openai.http_server import (EventStream, HTTPError, close_outputs,
                                                   until_disconnect)
from arcjax.entrypoints.openai.request_params import GenerationDefaults, ParsedRequest
from arcjax.entrypoints.openai.response_logprobs import TokenNames
from arcjax.entrypoints.openai.server_metrics import ServerMetrics
from arcjax.entrypoints.openai.serving_models import OpenAIServingModels
from arcjax.entrypoints.openai.streamed_choices import (ServedRequest, StreamedChoices,
                                                        event_stream)
from arcjax.entrypoints.openai.structured_fields import rename_field
from arcjax.errors import RequestError, StructuredOutputsError
from arcjax.lora.lora_request import LoRARequest
from arcjax.outputs import PoolingRequestOutput, RequestOutput
from arcjax.pooling_params import PoolingParams
from arcjax.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"  # the unknown request fields that were ignored
BODY_PROMPTS = 64  # prompts of max_model_len token ids `max_body_values` leaves room for


def max_body_values(engine) -> int:
    """The most JSON values a request body may hold: room for BODY_PROMPTS prompts of
    max_model_len token ids, for every token id of the vocabulary twice (allowed_token_ids,
    logit_bias), and for the longest text prompt if every character were a comma."""
    return max(BODY_PROMPTS * engine.max_model_len, 2 * engine.runner.cfg.vocab_size,
               engine.inputs.max_text_chars or 0)


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

    def ignored_header(self, ignored: Sequence[str]) -> dict:
        """Logs each unknown field name once; the response header listing this request's
        (`ignored`: its unknown fields)."""
        for name in ignored:
            if name not in self.ignored_logged:
                self.ignored_logged.add(name)
                log.warning("ignoring the unknown request field %r (logged once)", name)
        return {IGNORED_FIELDS_HEADER: ", ".join(ignored)} if ignored else {}


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
      defaults: sampling defaults (generation_config.json) for fields a request leaves unset.
      tokens_as_ids: `return_tokens_as_token_ids` for requests that do not say.
    """

    llm: AsyncLLM
    models: OpenAIServingModels
    metrics: ServerMetrics
    tracker: RequestTracker
    pool: ThreadPoolExecutor
    max_queued_requests: int | None
    max_stop_strings: int
    defaults: GenerationDefaults = GenerationDefaults()
    tokens_as_ids: bool = False


async def in_pool(pool: ThreadPoolExecutor, fn: Callable[[bytes], object], raw: bytes):
    """`fn(raw)` in the worker pool: the event loop serves everyone meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(pool, fn, raw)


class OpenAIServingBase:
    """What every endpoint that queues requests shares (generation, the Responses API,
    embeddings): preparing in the worker pool, queueing under the admission step, reading
    the outputs."""

    def __init__(self, context: ServingContext):
        self.llm = context.llm
        self.models = context.models
        self.metrics = context.metrics
        self.tracker = context.tracker
        self.max_stop_strings = context.max_stop_strings
        self.defaults = context.defaults
        self.tokens_as_ids = context.tokens_as_ids
        self._max_queued = context.max_queued_requests
        self._pool = context.pool

    # --- preparation (worker pool) ----------------------------------------------------------
    async def _in_pool(self, fn: Callable[[bytes], object], raw: bytes):
        return await in_pool(self._pool, fn, raw)

    def check_body_values(self, raw: bytes) -> None:
        """Refuses, before it is parsed, a body with more JSON values than any request this
        model can serve holds (`max_body_values`): counted as commas, in C, so a body of
        millions of token ids never becomes millions of Python objects (validating those
        holds the GIL, and so stalls the event loop, for a second or more)."""
        count = raw.count(b",")
        limit = max_body_values(self.llm.engine)
        if count > limit:
            raise RequestError("body", f"about {count} values: more than {limit}, what "
                               f"{BODY_PROMPTS} prompts of max_model_len tokens, the vocabulary "
                               f"or the longest text prompt need", limit=limit)

    def _engine_check(self, prompt, params, parsed: ParsedRequest, prompt_field: str,
                      lora: LoRARequest | None = None) -> tuple[int, ...]:
        """`Engine.check` (with the adapter `model` selects) with the request's own field
        names. Returns the prompt's ids."""
        try:
            return self.llm.engine.check(prompt, params, lora)[1]
        except StructuredOutputsError as e:  # a constraint that does not compile
            raise rename_field(e, parsed.constraint) from None
        except RequestError as e:
            max_field = parsed.max_tokens_field if parsed.max_tokens_given else prompt_field
            field = {"prompt": prompt_field, "max_tokens": max_field}.get(e.field, e.field)
            raise RequestError(field, e.message, limit=e.limit) from None

    # --- queueing and outputs (event loop) -------------------------------------------------
    def _submit(self, rid: str, prompts, params: Sequence[SamplingParams | PoolingParams],
                priority: int = 0, lora: LoRARequest | None = None) -> list[RequestStream]:
        """Checks the queue limit (and that the LoRA adapter `lora` is still served) and
        queues every prompt (with its params and `lora`) in one step (no other request is
        admitted in between: exact under concurrency); all or nothing."""
        self.models.check_served(lora)
        with self.llm.admission_lock:
            limit = self._max_queued
            n = sum(p.n if isinstance(p, SamplingParams) else 1 for p in params)
            if limit is not None and self.llm.engine.stats()["waiting"] + n > limit:
                raise HTTPError(429, f"too many requests waiting (limit {limit}); retry later",
                                "rate_limit_error", code="queue_full")
            streams: list[RequestStream] = []
            try:
                for i, (p, sp) in enumerate(zip(prompts, params)):
                    streams.append(self.llm.submit(p, sp, f"{rid}-{i}", priority,
                                                   lora_request=lora))
            except BaseException:
                for s in streams:
                    s.cancel()
                raise
        return streams

    async def _outputs(self, gens: list[RequestStream],
                       params: Sequence[SamplingParams | PoolingParams],
                       lora: LoRARequest | None = None
                       ) -> AsyncIterator[tuple[int, RequestOutput | PoolingRequestOutput]]:
        """(prompt index, output) of every prompt (queued with `params[i]` and the adapter
        `lora`), as they come. Leaving early aborts the requests still running (their
        streams are closed)."""
        adapter = None if lora is None else lora.lora_name
        rids = [g.request_id for g in gens]
        self.tracker.active.update(rids)
        finished: set[int] = set()
        tasks: list[asyncio.Task] = []
        try:
            if len(gens) == 1:  # the common case: no merging
                async for out in gens[0]:
                    if out.finished:
                        finished.add(0)
                        self.metrics.on_finished(out, params[0], adapter)
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
                    self.metrics.on_finished(out, params[i], adapter)
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
                    self.metrics.on_aborted()
            self.tracker.active.difference_update(rids)

    @staticmethod
    async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput | PoolingRequestOutput]],
                       num_prompts: int) -> list[RequestOutput | PoolingRequestOutput]:
        """Every prompt's final output (FINAL_ONLY outputs: the only one)."""
        finals: list[RequestOutput | None] = [None] * num_prompts
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
        return finals


class OpenAIServing(OpenAIServingBase, abc.ABC):
    """The base of the generation endpoints (see the module docstring). A subclass sets
    `REQUEST_ID_PREFIX` and `CHAT` and builds its whole response (`_response`) and its
    stream's chunks (`_chunks`)."""

    REQUEST_ID_PREFIX: ClassVar[str]  # the response id's prefix ("cmpl", "chatcmpl")
    CHAT: ClassVar[bool]  # log-probabilities in chat's shape (else completions')

    # --- generation (event loop) ------------------------------------------------------------
    @abc.abstractmethod
    def _response(self, served: ServedRequest, finals: Sequence[RequestOutput]) -> dict:
        """The whole response's body, from every prompt's final output."""

    @abc.abstractmethod
    def _chunks(self, served: ServedRequest, choices: StreamedChoices) -> AsyncIterator[dict]:
        """The stream's chunks, in order (the SSE framing is `event_stream`'s)."""

    def fill_max_tokens(self, parsed: ParsedRequest, params: SamplingParams,
                        prompt: Sequence[int]) -> SamplingParams:
        """`params` with max_tokens up to the context left after `prompt` when the request
        leaves it to the server (capped by generation_config's max_new_tokens)."""
        if not parsed.fill_max_tokens:
            return params
        limit = self.llm.engine.max_model_len
        keep = params.truncate_prompt_tokens
        length = len(prompt) if keep is None else min(len(prompt), limit if keep == -1 else keep)
        room = max(limit - length, 1)
        return dataclasses.replace(params, max_tokens=min(room, self.defaults.max_tokens
                                                          or room))

    async def _serve(self, request: Request, parsed: ParsedRequest,
                     prompts: Sequence[tuple[int, ...]], params: Sequence[SamplingParams],
                     prompt_text: str | None = None, lora: LoRARequest | None = None
                     ) -> Response:
        """Queues the prompts (each with its params, all with the LoRA adapter `lora`, None:
        the base model) and answers: the whole response, or its event stream."""
        rid = parsed.request.request_id or uuid.uuid4().hex
        as_ids = parsed.request.return_tokens_as_token_ids
        served = ServedRequest(parsed=parsed, request_id=f"{self.REQUEST_ID_PREFIX}-{rid}",
                               created=int(time.time()), model=self.models.model_name_of(lora),
                               prompts=tuple(tuple(p) for p in prompts),
                               names=TokenNames(self.tokens_as_ids if as_ids is None
                                                else as_ids), prompt_text=prompt_text)
        headers = self.tracker.ignored_header(parsed.ignored)
        # streams carry what is new in each step; a whole response needs the final only
        kind = RequestOutputKind.DELTA if parsed.stream else RequestOutputKind.FINAL_ONLY
        streams = self._submit(served.request_id, prompts,
                               [dataclasses.replace(p, output_kind=kind) for p in params],
                               parsed.request.priority, lora)
        outputs = self._outputs(streams, params, lora)
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
