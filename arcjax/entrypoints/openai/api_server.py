"""`arcjax serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) around `AsyncLLM`.

1. `OpenAIServer(llm, ServeConfig)` builds the FastAPI app. A POST body is read under a
   size cap (413 before parsing), then, in a worker pool (never on the event loop), decoded
   and parsed by `openai_protocol` (one place for validation; typed errors name the field),
   chat messages rendered by `chat.ChatTemplate`, and every prompt tokenized and checked by
   `Engine.check` (all-or-nothing). Back on the loop, one synchronous step checks the queue
   limit and queues every prompt (`AsyncLLM.submit`) under a server-chosen request id; with
   `n` > 1 the engine returns n completions per prompt (choice index prompt_index * n +
   sample index) and `openai_logprobs` shapes them, their log-probabilities and deltas.
   Structured outputs (`response_format`, `structured_outputs`, `guided_*`) go to the
   engine as `SamplingParams.structured_outputs`; chat `tools` render through the chat
   template and the request's `ToolPlan` reads each completion into content and
   `tool_calls` (streamed as `delta.tool_calls` by `structured.tools.ToolCallStream`).
2. Non-streaming (FINAL_ONLY outputs): outputs are collected while a watcher waits for the
   client's `http.disconnect`; streaming (DELTA outputs): the first output is awaited under
   the same watcher (so a bad request still gets its 400 before any header), then
   server-sent events follow; on a disconnect starlette cancels the stream. Either way the
   request streams are closed early, which aborts the requests: their KV blocks are freed
   at the start of the next engine step at the latest.
3. Metrics (`metrics.ServerMetrics`): the engine's `trace_sink` counts every step's knob
   engagement and preemptions; finished requests feed latency histograms and token counters;
   gauges are read from `Engine.stats()` at scrape time.
4. Shutdown (SIGTERM/SIGINT, or `request_shutdown()`): the server keeps listening but answers
   503 (`/health` too), waits up to `shutdown_timeout` for requests in flight, aborts the
   rest (their responses end with finish_reason "abort"), then uvicorn exits and the engine
   thread stops; the process exits 0. A second signal exits at once.

NOTE: the event loop never blocks on the engine: streams ask for DELTA outputs, and
`AsyncLLM` hands them over through a one-slot collector per request that merges what a
slow reader has not taken (TCP backpressure stalls its response, nothing else; it holds one
merged output). A dead engine (`EngineDeadError`) ends every stream with an error event,
answers 503 to new requests, and /health answers 503. All server state (`active`,
`in_flight`, `draining`) is touched only from the event loop, except `draining`, also read
by handlers. The HTTP plumbing (errors, SSE, disconnects, uvicorn) is in serve_http.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from arcjax.outputs import RequestOutput
from arcjax.engine.trace import attention_report
from arcjax.entrypoints.openai import protocol as proto
from arcjax.entrypoints.async_llm import AsyncLLM, RequestStream
from arcjax.entrypoints.chat_template import ChatTemplate
from arcjax.entrypoints.openai.server_metrics import ServerMetrics
from arcjax.entrypoints.openai.response_logprobs import ChoiceStream, completions_of
from arcjax.entrypoints.openai.http_server import (EventStream, HTTPError, TraceFanout, build_server,
                                           close_outputs, error_response, parse_json,
                                           too_large, until_disconnect)
from arcjax.errors import (EngineDeadError, InputError, RequestError, StructuredOutputsError,
                           UnknownRequestError)
from arcjax.model.quant import storage_dtypes
from arcjax.sampling_params import RequestOutputKind
from arcjax.entrypoints.openai.structured_fields import rename_field
from arcjax.entrypoints.openai.tool_parsers import PARSERS, guess_parser
from arcjax.entrypoints.openai.tool_calls import ToolCallStream

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "arcjax-default"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How the HTTP server behaves (engine options go to `AsyncLLM`).

    Attributes:
      host, port: where to listen.
      api_key: if set, /v1/* requests need `Authorization: Bearer <api_key>`.
      served_model_name: the model id clients send and /v1/models lists; None = the model
        directory as given, or "arcjax-default" for the packaged model.
      max_queued_requests: refuse (429) a request that would make more than this many
        requests wait in the engine; None = no limit. Exact under concurrency: the check
        and the queueing happen in one step.
      max_request_bytes: a larger body is refused with 413 before it is parsed.
      max_stop_strings: a request asking for more stop strings is refused (400, "stop").
      shutdown_timeout: seconds requests in flight may take to finish after SIGTERM/SIGINT.
      log_level: uvicorn's log level.
      tool_call_parser: how `tool_choice: "auto"` reads the model's tool calls ("hermes",
        "llama3_json"); None = the format the chat template shows, if it shows one.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 8 << 20
    max_stop_strings: int = proto.DEFAULT_MAX_STOP_STRINGS
    shutdown_timeout: float = 30.0
    log_level: str = "warning"
    tool_call_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")


PREPARE_WORKERS = 4  # threads that parse, render and tokenize requests
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"  # the unknown request fields that were ignored


class OpenAIServer:
    """The app and its state for one `AsyncLLM` (see the module docstring)."""

    def __init__(self, llm: AsyncLLM, config: ServeConfig | None = None):
        self.llm = llm
        self.config = config or ServeConfig()
        engine = llm.engine
        model = llm.engine_config.model
        self.model_name = self.config.served_model_name or model or DEFAULT_MODEL_NAME
        self.metrics = ServerMetrics(engine, self.model_name)
        self._fanout = TraceFanout.install(engine)
        self._fanout.add(self.metrics.on_step)
        self.chat_template = (ChatTemplate.from_dir(engine.model_dir)
                              if engine.model_dir is not None else ChatTemplate(None))
        self.tool_parser = (self.config.tool_call_parser
                            or guess_parser(self.chat_template.source))
        self.created = int(time.time())
        self.draining = False
        self.active: set[str] = set()  # engine request ids this server is waiting on
        self.in_flight = 0  # generation requests (HTTP) not finished yet
        self.ignored_logged: set[str] = set()  # unknown request fields logged so far
        # parsing, chat rendering and tokenization run here, never on the event loop
        self._pool = ThreadPoolExecutor(max_workers=PREPARE_WORKERS,
                                        thread_name_prefix="arcjax-prepare")
        self.app = self._build_app()

    def close(self) -> None:
        """Stops counting engine steps (the engine may outlive this server)."""
        self._fanout.remove(self.metrics.on_step)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the app ----------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="arcjax", docs_url=None, redoc_url=None, openapi_url=None)
        app.state.server = self

        @app.exception_handler(InputError)
        async def _bad_input(request, e: InputError):
            return error_response(400, str(e), "invalid_request_error", e.field)

        @app.exception_handler(EngineDeadError)
        async def _dead(request, e: EngineDeadError):
            return error_response(503, str(e), "service_unavailable", code="engine_dead")

        @app.exception_handler(HTTPError)
        async def _http_error(request, e: HTTPError):
            return error_response(e.status, e.message, e.type, e.param, e.code)

        @app.exception_handler(StarletteHTTPException)
        async def _starlette_error(request, e: StarletteHTTPException):
            kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
                e.status_code, "invalid_request_error")
            return error_response(e.status_code, f"{e.detail}: {request.method} {request.url.path}",
                          kind, None, "not_found" if e.status_code == 404 else None)

        @app.exception_handler(Exception)
        async def _internal(request, e: Exception):
            log.exception("internal error")
            return error_response(500, f"internal error: {e!r}", "internal_error")

        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model:path}")(self.model)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        return app

    # --- plain endpoints ----------------------------------------------------------------
    async def health(self) -> Response:
        dead = self.llm.engine.dead
        if dead is not None:
            return error_response(503, str(dead), "service_unavailable", code="engine_dead")
        if self.draining or not self.llm.is_running():
            return error_response(503, "shutting down", "service_unavailable", code="shutting_down")
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict:
        runner = self.llm.engine.runner
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "arcjax", "max_model_len": self.llm.engine.max_model_len,
                **storage_dtypes(runner.params, runner.cache),
                # the buckets compiled so far (every bucket after a warm-up)
                "attention": attention_report(runner.attn_impl, dict(runner.attention_impls),
                                              verified=dict(runner.attention_verified))}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model: str, request: Request) -> Response:
        self._authorize(request)
        self._check_model(model)
        return JSONResponse(self._model_card())

    # --- checks -------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise HTTPError(401, "invalid or missing API key (Authorization: Bearer ...)",
                            "authentication_error", code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", "not_found_error", "model",
                            "model_not_found")

    async def _admit(self, request: Request) -> bytes:
        """Auth, draining, and the raw body (413 beyond `max_request_bytes`, before any of
        it is parsed; a body without a length is counted as it arrives)."""
        self._authorize(request)
        if self.draining:
            raise HTTPError(503, "the server is shutting down", "service_unavailable",
                            code="shutting_down")
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _prepare(self, fn, raw: bytes):
        """`fn(raw)` in the worker pool: the event loop serves everyone meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, raw)

    def _submit(self, rid: str, prompts, params) -> list[RequestStream]:
        """Checks the queue limit and queues every prompt in one step (no other request
        is admitted in between: exact under concurrency); all or nothing."""
        with self.llm.admission_lock:
            limit = self.config.max_queued_requests
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

    def _engine_check(self, prompt, params, parsed: proto.ParsedRequest, prompt_field: str):
        """`Engine.check` with the request's own field names. Returns the prompt's ids."""
        try:
            return self.llm.engine.check(prompt, params)[1]
        except StructuredOutputsError as e:  # a constraint that does not compile
            raise rename_field(e, parsed.constraint) from None
        except RequestError as e:
            max_field = parsed.max_tokens_field if parsed.max_tokens_given else prompt_field
            field = {"prompt": prompt_field, "max_tokens": max_field}.get(e.field, e.field)
            raise RequestError(field, e.message, limit=e.limit) from None

    # --- generation endpoints -----------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        parsed, ids = await self._prepare(self._prepare_completion, await self._admit(request))
        return await self._generate(request, parsed, ids, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        parsed, ids = await self._prepare(self._prepare_chat, await self._admit(request))
        return await self._generate(request, parsed, ids, chat=True)

    def _prepare_completion(self, raw: bytes):
        """(worker pool) The parsed request and every prompt's token ids."""
        parsed = proto.parse_completion(parse_json(raw), self.config.max_stop_strings)
        self._check_model(parsed.model)
        return parsed, [self._engine_check(p, parsed.params, parsed, "prompt")
                        for p in parsed.prompts]

    def _prepare_chat(self, raw: bytes):
        """(worker pool) The parsed request, its params, and the rendered prompt's ids."""
        parsed = proto.parse_chat(parse_json(raw), self.config.max_stop_strings, self.tool_parser)
        self._check_model(parsed.model)
        text = self.chat_template.render(parsed.messages,
                                         add_generation_prompt=parsed.add_generation_prompt,
                                         tools=list(parsed.tools.tools or ()) or None)
        try:  # the template printed the special tokens
            prompt = self.llm.engine.inputs.encode(text, add_special_tokens=False)
        except RequestError as e:
            raise RequestError("messages", e.message, limit=e.limit) from None
        params = parsed.params
        if not parsed.max_tokens_given:  # OpenAI's default: up to the context length
            room = self.llm.engine.max_model_len - len(prompt)
            params = dataclasses.replace(params, max_tokens=max(room, 1))
        ids = [self._engine_check(prompt, params, parsed, "messages")]
        return dataclasses.replace(parsed, params=params), ids

    def _ignored_header(self, parsed: proto.ParsedRequest) -> dict:
        """Logs each unknown field name once; the response header listing this request's."""
        for name in parsed.ignored:
            if name not in self.ignored_logged:
                self.ignored_logged.add(name)
                log.warning("ignoring the unknown request field %r (logged once)", name)
        return {IGNORED_FIELDS_HEADER: ", ".join(parsed.ignored)} if parsed.ignored else {}

    async def _generate(self, request: Request, parsed: proto.ParsedRequest,
                        prompts: Sequence[tuple[int, ...]], *, chat: bool) -> Response:
        n = parsed.params.n
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        headers = self._ignored_header(parsed)
        # streams carry what is new in each step; a whole response needs the final only
        kind = RequestOutputKind.DELTA if parsed.stream else RequestOutputKind.FINAL_ONLY
        streams = self._submit(rid, prompts, dataclasses.replace(parsed.params,
                                                                 output_kind=kind))
        stream = self._outputs(streams)
        self.in_flight += 1
        handed_over = False
        try:
            if not parsed.stream:
                ok, finals = await until_disconnect(request, self._collect(stream, len(prompts)))
                if not ok:
                    return Response(status_code=499)  # nobody is listening
                failed = next((o for o in finals if o.finish_reason == "error"), None)
                if failed is not None:
                    raise HTTPError(500, f"generation failed: {failed.error}", "internal_error")
                if chat:
                    return JSONResponse(proto.chat_response(
                        rid, created, self.model_name, finals, n, parsed.params.logprobs,
                        parsed.tools), headers=headers)
                return JSONResponse(proto.completion_response(
                    rid, created, self.model_name, finals, n, parsed.params.logprobs),
                    headers=headers)
            ok, first = await until_disconnect(request, stream.__anext__())
            if not ok:
                return Response(status_code=499)
            body = self._events(first, stream, len(prompts), rid, created, chat,
                                parsed.include_usage, n, parsed.params.logprobs,
                                parsed.tools)

            async def on_close():
                await close_outputs(stream, streams)
                self.in_flight -= 1

            handed_over = True
            return EventStream(body, on_close, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", **headers})
        finally:
            if not handed_over:
                await close_outputs(stream, streams)
                self.in_flight -= 1

    async def _outputs(self, gens: list[RequestStream]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) of every prompt, as they come. Leaving early aborts the
        requests still running (their streams are closed)."""
        rids = [g.request_id for g in gens]
        self.active.update(rids)
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
            self.active.difference_update(rids)

    @staticmethod
    async def _collect(stream, n: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * n
        async for i, out in stream:
            if out.finished:
                finals[i] = out
        return finals

    async def _events(self, first, stream, num_prompts: int, rid: str, created: int,
                      chat: bool, include_usage: bool, n: int = 1,
                      logprobs: int | None = None, tools=None) -> AsyncIterator[str]:
        """The SSE body: OpenAI chunks (one per choice with something new: choice index
        prompt_index * n + sample index), an optional usage chunk, then [DONE]. With
        tools, a choice's text goes through its `ToolCallStream`: content and
        `delta.tool_calls` items. (The response closes `stream` when it ends, however it
        ends.)"""
        model = self.model_name
        finals: list[RequestOutput | None] = [None] * num_prompts
        choices = ChoiceStream(logprobs, chat)
        parsing = chat and tools is not None and tools.mode != "none"
        calls: dict[int, tuple[ToolCallStream, list[str]]] = {}  # index -> (stream, text)
        try:
            if chat:
                for j in range(n):
                    yield proto.sse(proto.chat_chunk(rid, created, model, j,
                                                     {"role": "assistant", "content": ""}, None))
            item = first
            while item is not None:
                i, out = item
                for c in completions_of(out):
                    index = i * n + c.index
                    new = choices.delta(index, c)
                    if new is None:
                        continue
                    text, lps, reason = new
                    if parsing:
                        parser, seen = calls.setdefault(index, (ToolCallStream(tools.parser),
                                                                []))
                        seen.append(text)
                        text, items, found = parser.update("".join(seen), reason is not None)
                        delta = {"content": text} if text else {}
                        if items:
                            delta["tool_calls"] = items
                        reason = tools.finish_reason(reason, found)
                        if delta or reason is not None or lps is not None:
                            yield proto.sse(proto.chat_chunk(rid, created, model, index,
                                                             delta, reason, lps))
                    elif chat:
                        delta = {"content": text} if text else {}
                        yield proto.sse(proto.chat_chunk(rid, created, model, index, delta,
                                                         reason, lps))
                    else:
                        yield proto.sse(proto.completion_chunk(rid, created, model, index,
                                                               text, reason, lps))
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "error":
                        yield proto.sse(proto.error_body(f"generation failed: {out.error}",
                                                         "internal_error"))
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    item = None
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield proto.sse(proto.usage_chunk(rid, created, model, obj, finals,
                                                  sum(choices.tokens.values())))
            yield "data: [DONE]\n\n"
        except InputError as e:  # a prompt refused when queued, after the first output
            yield proto.sse(proto.error_body(str(e), "invalid_request_error", e.field))
        except EngineDeadError as e:  # the stream ends with the reason
            yield proto.sse(proto.error_body(str(e), "service_unavailable", code="engine_dead"))

    # --- shutdown -----------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stops admitting (503), waits up to `timeout` s for requests in flight, aborts the
        rest and waits (a few seconds at most) for their responses to end."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self.active):
            try:
                await self.llm.abort(rid)
            except (UnknownRequestError, EngineDeadError):  # finished, or all gone
                pass
        deadline = loop.time() + 5.0
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)


def serve(model: str | None = None, config: ServeConfig | None = None, *, warmup: bool = False,
          **engine_options) -> None:
    """Runs the server until SIGTERM/SIGINT; returns after a graceful shutdown.

    Args:
      model: a Hugging Face-format directory; None = the packaged default model.
      config: the HTTP server's settings.
      warmup: compile every bucket before listening.
      **engine_options: as for `arcjax.AsyncLLM`.
    """
    config = config or ServeConfig()
    llm = AsyncLLM(model, **engine_options)
    try:
        if warmup:
            seconds = llm.engine.runner.warmup()
            log.warning("warm-up compiled every bucket in %.1f s", seconds)
        api = OpenAIServer(llm, config)
        uv = build_server(api)
        print(f"arcjax serve: {api.model_name!r} on http://{config.host}:{config.port}",
              flush=True)
        uv.run()
        api.close()
    finally:
        llm.shutdown()
