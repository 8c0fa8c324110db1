"""`arcjax serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) around `AsyncLLM`.

1. `OpenAIServer(llm, ServeConfig)` builds the FastAPI app and one serving object per
   endpoint: `serving_completion.OpenAIServingCompletion` (/v1/completions),
   `serving_chat.OpenAIServingChat` (/v1/chat/completions, messages rendered by
   `chat_template.ChatTemplate`), `serving_tokenization.OpenAIServingTokenization`
   (/tokenize, /detokenize), `serving_responses.OpenAIServingResponses` (/v1/responses:
   create, retrieve, delete, cancel, input items; kept in a `responses_store.ResponseStore`;
   prepared by the chat endpoint), `serving_embedding.OpenAIServingEmbedding`
   (/v1/embeddings: an engine built with runner="pooling" embeds beside generating),
   `serving_models.OpenAIServingModels` (/v1/models, the `model` checks and LoRA
   adapters: `--lora-modules`, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
   generation_config.json's defaults); they share a `serving_engine.ServingContext`. The
   request models (`protocol.py`) and `openai`'s
   response types give the OpenAPI schema (/openapi.json, /docs).
2. A generation request is admitted here (`_admit`: the API key, draining, and the body
   read under a size cap: 413 before parsing), then handed to its endpoint, which prepares
   it in a worker pool (never on the event loop), queues it and answers, whole or streamed
   (`serving_engine`). Errors are typed: an `InputError` is a 400 naming its field
   (`param`), an `HTTPError` carries its status, a dead engine is a 503.
3. Metrics (`server_metrics.ServerMetrics`, and vLLM's names in `vllm_metrics.py`): the
   engine's `trace_sink` counts every step's knob engagement and preemptions; finished
   requests feed latency histograms and token counters; gauges are read from
   `Engine.stats()` at scrape time (`/metrics`).
4. Shutdown (SIGTERM/SIGINT, or `request_shutdown()`): the server keeps listening but answers
   503 (`/health` too), waits up to `shutdown_timeout` for requests in flight, aborts the
   rest (their responses end with finish_reason "abort"), then uvicorn exits and the engine
   thread stops; the process exits 0. A second signal exits at once.

NOTE: a dead engine (`EngineDeadError`) ends every stream with an error event, answers 503
to new requests, and /health answers 503. The requests being served
(`serving_engine.RequestTracker`) and `draining` are touched only from the event loop,
except `draining`, also set by the signal handler. The HTTP plumbing (errors, SSE,
disconnects, uvicorn) is in http_server.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from arcjax.entrypoints.async_llm import AsyncLLM
from arcjax.entrypoints.chat_template import ChatTemplate
from arcjax.entrypoints.openai.http_server import (HTTPError, TraceFanout, build_server,
                                                   error_response, too_large)
from arcjax.entrypoints.openai.lora_modules import RUNTIME_UPDATING_ENV, LoRAModulePath
from arcjax.entrypoints.openai.openapi import document, install_schema
from arcjax.entrypoints.openai.request_params import DEFAULT_MAX_STOP_STRINGS
from arcjax.entrypoints.openai.responses_store import (DEFAULT_MAX_BYTES, DEFAULT_TTL,
                                                       ResponseStore)
from arcjax.entrypoints.openai.server_metrics import ServerMetrics
from arcjax.entrypoints.openai.serving_chat import OpenAIServingChat
from arcjax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from arcjax.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from arcjax.entrypoints.openai.serving_engine import RequestTracker, ServingContext
from arcjax.entrypoints.openai.serving_models import (GENERATION_CONFIGS, OpenAIServingModels,
                                                      generation_defaults)
from arcjax.entrypoints.openai.serving_responses import OpenAIServingResponses
from arcjax.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from arcjax.entrypoints.openai.tool_parsers import PARSERS, guess_parser
from arcjax.errors import EngineDeadError, InputError, UnknownRequestError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How the HTTP server behaves (engine options go to `AsyncLLM`).

    Attributes:
      host, port: where to listen.
      api_key: if set, /v1/* (and /tokenize, /detokenize) requests need
        `Authorization: Bearer <api_key>`.
      served_model_name: the model id clients send and /v1/models lists, or several (the
        first is the one responses carry); None = the model directory as given, or
        "arcjax-default" for the packaged model.
      max_queued_requests: refuse (429) a request that would make more than this many
        requests wait in the engine; None = no limit. Exact under concurrency: the check
        and the queueing happen in one step.
      max_request_bytes: a larger body is refused with 413 before it is parsed.
      max_stop_strings: a request asking for more stop strings is refused (400, "stop").
      shutdown_timeout: seconds requests in flight may take to finish after SIGTERM/SIGINT.
      log_level: uvicorn's log level.
      tool_call_parser: how `tool_choice: "auto"` reads the model's tool calls (a
        `tool_parsers.PARSERS` name); None = the format the chat template shows, if it
        shows one (arcjax's fallback: vLLM refuses "auto" without the flag).
      enable_auto_tool_choice: vLLM's flag; here it asks that a parser be known at start
        (given, or shown by the chat template): "auto" works whenever one is.
      chat_template: a template (its text, or a file) instead of the model's.
      generation_config: "auto" (the model's generation_config.json gives the sampling
        defaults), "vllm" (OpenAI's defaults) or a folder holding a generation_config.json.
      return_tokens_as_token_ids: logprob tokens as "token_id:<id>" unless a request says.
      responses_store_bytes, responses_store_ttl: the bounds of the responses
        `/v1/responses` keeps (`store: true`): bytes in all (least recently used go
        first), seconds after the last write.
      lora_modules: LoRA adapters served from start (`--lora-modules`; the engine needs
        enable_lora); a request's `model` selects one by name.
      allow_runtime_lora_updating: whether `POST /v1/load_lora_adapter` and
        `/v1/unload_lora_adapter` answer (else 404, as vLLM without
        VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | tuple[str, ...] | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 8 << 20
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    shutdown_timeout: float = 30.0
    log_level: str = "warning"
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    chat_template: str | None = None
    generation_config: str = "auto"
    return_tokens_as_token_ids: bool = False
    responses_store_bytes: int = DEFAULT_MAX_BYTES
    responses_store_ttl: float = DEFAULT_TTL
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self):
        modules = tuple(self.lora_modules)
        if not all(isinstance(m, LoRAModulePath) for m in modules):
            raise ValueError(f"lora_modules must be LoRAModulePath items, got {modules!r}")
        object.__setattr__(self, "lora_modules", modules)
        names = self.served_model_name
        if isinstance(names, (list, tuple)):
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name must be non-empty names, got {names!r}")
            object.__setattr__(self, "served_model_name", tuple(names))
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.responses_store_bytes < 1:
            raise ValueError(f"responses_store_bytes must be >= 1, got "
                             f"{self.responses_store_bytes}")
        if not self.responses_store_ttl > 0:
            raise ValueError(f"responses_store_ttl must be > 0, got {self.responses_store_ttl}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.generation_config not in GENERATION_CONFIGS and not os.path.isdir(
                self.generation_config):
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS} or a "
                             f"folder, got {self.generation_config!r}")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        names = self.served_model_name
        return () if names is None else (names,) if isinstance(names, str) else names


PREPARE_WORKERS = 4  # threads that parse, render and tokenize requests


class OpenAIServer:
    """The app and its state for one `AsyncLLM` (see the module docstring)."""

    def __init__(self, llm: AsyncLLM, config: ServeConfig | None = None):
        self.llm = llm
        self.config = config or ServeConfig()
        engine = llm.engine
        self.models = OpenAIServingModels(llm, self.config.served_model_names,
                                          self.config.lora_modules)
        self.model_name = self.models.model_name
        self.metrics = ServerMetrics(engine, self.model_name)
        self._fanout = TraceFanout.install(engine)
        self._fanout.add(self.metrics.on_step)
        self.draining = False
        self.tracker = RequestTracker()
        # parsing, chat rendering and tokenization run here, never on the event loop
        self._pool = ThreadPoolExecutor(max_workers=PREPARE_WORKERS,
                                        thread_name_prefix="arcjax-prepare")
        cfg = self.config
        context = ServingContext(llm=llm, models=self.models, metrics=self.metrics,
                                 tracker=self.tracker, pool=self._pool,
                                 max_queued_requests=cfg.max_queued_requests,
                                 max_stop_strings=cfg.max_stop_strings,
                                 defaults=generation_defaults(cfg.generation_config,
                                                              engine.model_dir),
                                 tokens_as_ids=cfg.return_tokens_as_token_ids)
        chat_template = self._chat_template(llm.engine_config.tokenizer or engine.model_dir)
        tool_parser = cfg.tool_call_parser or guess_parser(chat_template.source)
        if cfg.enable_auto_tool_choice and tool_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the chat "
                             "template shows no format arcjax knows)")
        self.completion = OpenAIServingCompletion(context)
        self.chat = OpenAIServingChat(context, chat_template, tool_parser)
        self.tokenization = OpenAIServingTokenization(context, self.chat)
        self.responses = OpenAIServingResponses(
            context, self.chat, ResponseStore(cfg.responses_store_bytes, cfg.responses_store_ttl))
        self.embedding = OpenAIServingEmbedding(context)
        self.app = self._build_app()

    def _chat_template(self, model_dir) -> ChatTemplate:
        """The chat template of the model (or of its `tokenizer` directory), or
        `--chat-template`'s (with the model's special tokens)."""
        own = ChatTemplate.from_dir(model_dir) if model_dir is not None else ChatTemplate(None)
        if self.config.chat_template is None:
            return own
        return ChatTemplate.from_source(self.config.chat_template, own.special_tokens)

    def close(self) -> None:
        """Stops counting engine steps (the engine may outlive this server)."""
        self._fanout.remove(self.metrics.on_step)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the app ----------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="arcjax", docs_url="/docs", redoc_url=None,
                      openapi_url="/openapi.json")
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
        app.get("/version")(self.version)
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models")(self.show_available_models)
        app.get("/v1/models/{model:path}")(self.show_model)
        app.post("/v1/load_lora_adapter")(self.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)
        document(app, "/v1/completions", self.create_completion)
        document(app, "/v1/chat/completions", self.create_chat_completion)
        document(app, "/v1/responses", self.create_response)
        app.get("/v1/responses/{response_id}")(self.retrieve_response)
        app.delete("/v1/responses/{response_id}")(self.delete_response)
        app.post("/v1/responses/{response_id}/cancel")(self.cancel_response)
        app.get("/v1/responses/{response_id}/input_items")(self.response_input_items)
        document(app, "/v1/embeddings", self.create_embedding)
        document(app, "/tokenize", self.tokenize)
        document(app, "/detokenize", self.detokenize)
        install_schema(app)
        return app

    # --- routes -------------------------------------------------------------------------
    async def health(self) -> Response:
        dead = self.llm.engine.dead
        if dead is not None:
            return error_response(503, str(dead), "service_unavailable", code="engine_dead")
        if self.draining or not self.llm.is_running():
            return error_response(503, "shutting down", "service_unavailable", code="shutting_down")
        return Response(status_code=200)  # an empty body, as vLLM's

    async def version(self) -> Response:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return JSONResponse({"version": version("arcjax")})
        except PackageNotFoundError:  # run from a checkout that is not installed
            return JSONResponse({"version": "unknown"})

    async def metrics_endpoint(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def show_available_models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.models.show_available_models())

    async def show_model(self, model: str, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.models.show_model(model))

    async def load_lora_adapter(self, request: Request) -> Response:
        raw = await self._admit(request)
        self._runtime_lora_updating()
        return PlainTextResponse(await self.models.load_lora_adapter(raw, self._pool))

    async def unload_lora_adapter(self, request: Request) -> Response:
        raw = await self._admit(request)
        self._runtime_lora_updating()
        return PlainTextResponse(await self.models.unload_lora_adapter(raw))

    def _runtime_lora_updating(self) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise HTTPError(404, "runtime LoRA updating is off: start the server with "
                                 "--allow-runtime-lora-updating (or "
                                 f"{RUNTIME_UPDATING_ENV}=True)", "not_found_error",
                            code="runtime_lora_updating_disabled")

    async def create_completion(self, request: Request) -> Response:
        return await self.completion.create_completion(request, await self._admit(request))

    async def create_chat_completion(self, request: Request) -> Response:
        return await self.chat.create_chat_completion(request, await self._admit(request))

    async def create_response(self, request: Request) -> Response:
        return await self.responses.create_response(request, await self._admit(request))

    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.responses.retrieve(response_id))

    async def delete_response(self, response_id: str, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(self.responses.delete(response_id))

    async def cancel_response(self, response_id: str, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(await self.responses.cancel(response_id))

    async def response_input_items(self, response_id: str, request: Request,
                                   order: str = "desc", limit: int = 20) -> Response:
        self._authorize(request)
        return JSONResponse(self.responses.input_items(response_id, order, limit))

    async def create_embedding(self, request: Request) -> Response:
        return await self.embedding.create_embedding(request, await self._admit(request))

    async def tokenize(self, request: Request) -> Response:
        return await self.tokenization.tokenize(await self._admit(request))

    async def detokenize(self, request: Request) -> Response:
        return await self.tokenization.detokenize(await self._admit(request))

    # --- admission ----------------------------------------------------------------------
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

    # --- shutdown -----------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stops admitting (503), waits up to `timeout` s for requests in flight, aborts the
        rest and waits (a few seconds at most) for their responses to end."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.tracker.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self.tracker.active):
            try:
                await self.llm.abort(rid)
            except (UnknownRequestError, EngineDeadError):  # finished, or all gone
                pass
        deadline = loop.time() + 5.0
        while self.tracker.in_flight and loop.time() < deadline:
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
