"""`/v1/responses` (vLLM's `OpenAIServingResponses`): create (whole, streamed, or in the
background), retrieve, delete, cancel, and the input items of a stored response.

1. `create_response`: the body is validated in the worker pool
   (`responses_protocol.parse_responses`); `previous_response_id` is looked up in the
   `ResponseStore` (on the event loop, its only user); the request becomes a chat body
   (`responses_protocol.chat_body`) that the chat endpoint parses and prepares as its own
   (`OpenAIServingChat.parse` / `.prepare`: template, tools, structured outputs,
   tokenization, the engine's checks), so both endpoints share one copy of that logic.
2. It is queued like any generation request (`OpenAIServingBase._submit`) and read by a
   `ResponseBuilder` (responses_events.py) through the chat path's output reader: the whole
   response (FINAL_ONLY), the typed event stream (DELTA outputs read per choice by
   `StreamedChoices`; the first awaited under the disconnect watch, so a bad request still
   gets its 400), or, with `background: true`, a task that runs it while the client gets
   the "queued" response at once.
3. With `store: true` (the default) the finished response and its conversation are kept in
   the store (bounded by TTL and bytes); a background response is kept from the start and
   rewritten when it ends. `POST /v1/responses/{id}/cancel` cancels a background
   response's task (its engine request is aborted; status "cancelled").

NOTE: a streamed response's disconnect aborts its request; a background one's does not (it
runs until done, cancelled, deleted or the server drains). The store is touched only from
the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arcjax.entrypoints.async_llm import RequestStream
from arcjax.entrypoints.openai import responses_protocol as rp
from arcjax.entrypoints.openai.http_server import (EventStream, HTTPError, close_outputs,
                                                   until_disconnect)
from arcjax.entrypoints.openai.response_logprobs import ChoiceDelta, completions_of
from arcjax.entrypoints.openai.responses_events import (ResponseBuilder, new_id,
                                                        responses_usage, sse_event)
from arcjax.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from arcjax.entrypoints.openai.serving_chat import ChatPrepared, OpenAIServingChat
from arcjax.entrypoints.openai.serving_engine import OpenAIServingBase, ServingContext
from arcjax.entrypoints.openai.streamed_choices import ServedRequest, StreamedChoices
from arcjax.errors import EngineDeadError, InputError
from arcjax.outputs import RequestOutput
from arcjax.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass(frozen=True)
class ResponsesPrepared:
    """A create request, prepared: the Responses request, the chat request it became, its
    input as chat messages and the conversation it continues."""

    request: rp.ResponsesRequest
    chat: ChatPrepared
    messages: tuple[dict, ...]
    previous: tuple[dict, ...]


def _whole(builder: ResponseBuilder, out: RequestOutput) -> None:
    """Feeds a final (FINAL_ONLY) output to `builder` and finishes it."""
    c = completions_of(out)[0]
    builder.update(ChoiceDelta(0, c.text, c.reasoning, c.content, tuple(c.token_ids), None,
                               c.finish_reason))
    builder.finish(c.finish_reason, responses_usage(len(out.prompt_token_ids),
                                                    len(c.token_ids), out.num_cached_tokens),
                   out.error)


class OpenAIServingResponses(OpenAIServingBase):
    """The Responses endpoints (see the module docstring).

    Args:
      context: what the server's endpoints share.
      chat: the chat endpoint, whose parsing and preparation every response reuses.
      store: where stored responses live.
    """

    def __init__(self, context: ServingContext, chat: OpenAIServingChat, store: ResponseStore):
        super().__init__(context)
        self.chat, self.store = chat, store

    # --- create -------------------------------------------------------------------------
    async def create_response(self, request: Request, raw: bytes) -> Response:
        """Answers one admitted `POST /v1/responses` whose body is `raw`."""
        req = await self._in_pool(self._parse, raw)
        previous = self._previous(req.previous_response_id)
        prep = await self._in_pool(lambda _: self._prepare(req, previous), raw)
        builder = ResponseBuilder(new_id("resp"), self.models.model_name_of(prep.chat.lora),
                                  rp.echo(req),
                                  prep.chat.parsed.tools)
        headers = self.tracker.ignored_header(req.extra_fields())
        if req.background:
            return JSONResponse(self._start_background(prep, builder), headers=headers)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(prep.chat.parsed.params, output_kind=kind)
        streams = self._submit(builder.id, [prep.chat.prompt], [params],
                               prep.chat.parsed.request.priority, prep.chat.lora)
        outputs = self._outputs(streams, [params], prep.chat.lora)
        self.tracker.in_flight += 1
        handed_over = False
        try:
            if not req.stream:
                ok, finals = await until_disconnect(request, self._collect(outputs, 1))
                if not ok:
                    return Response(status_code=499)  # nobody is listening
                if finals[0].finish_reason == "error":
                    raise HTTPError(500, f"generation failed: {finals[0].error}",
                                    "internal_error")
                _whole(builder, finals[0])
                self._keep(prep, builder)
                return JSONResponse(builder.response(), headers=headers)
            ok, first = await until_disconnect(request, outputs.__anext__())
            if not ok:
                return Response(status_code=499)
            served = ServedRequest(parsed=prep.chat.parsed, request_id=builder.id,
                                   created=builder.created_at, model=builder.model,
                                   prompts=(prep.chat.prompt,))
            choices = StreamedChoices(served, first, outputs, chat=True)

            async def on_close():
                await close_outputs(outputs, streams)
                self.tracker.in_flight -= 1

            handed_over = True
            return EventStream(self._events(prep, builder, choices), on_close,
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", **headers})
        finally:
            if not handed_over:
                await close_outputs(outputs, streams)
                self.tracker.in_flight -= 1

    def _parse(self, raw: bytes) -> rp.ResponsesRequest:
        """(worker pool) The validated body (cheap size checks first)."""
        self.check_body_values(raw)
        req = rp.parse_responses(raw)
        self.models.check_model(req.model)
        return req

    def _previous(self, rid: str | None) -> tuple[dict, ...]:
        """(event loop) The conversation `previous_response_id` continues (checked)."""
        if rid is None:
            return ()
        entry = self.store.get(rid)
        if entry is None:
            raise HTTPError(400, f"previous response {rid!r} not found (never stored, "
                                 f"expired or deleted)", "invalid_request_error",
                            "previous_response_id", "previous_response_not_found")
        if not entry.final:
            raise HTTPError(400, f"previous response {rid!r} is still {entry.status}",
                            "invalid_request_error", "previous_response_id")
        return entry.messages

    def _prepare(self, req: rp.ResponsesRequest, previous: tuple[dict, ...]
                 ) -> ResponsesPrepared:
        """(worker pool) The chat request `req` becomes, parsed and prepared by the chat
        endpoint (errors renamed to the Responses fields)."""
        messages = rp.input_messages(req.input)
        raw = json.dumps(rp.chat_body(req, messages, previous)).encode()
        try:
            self.chat.check_size(raw)
            chat = self.chat.prepare(self.chat.parse(raw))
        except InputError as e:
            raise rp.renamed(e) from None
        return ResponsesPrepared(req, chat, tuple(messages), previous)

    def _keep(self, prep: ResponsesPrepared, builder: ResponseBuilder,
              entry: StoredResponse | None = None) -> None:
        """Stores the response (when asked) with the conversation it ends."""
        if prep.request.store is False:
            return
        messages = prep.previous + prep.messages + builder.conversation()
        if entry is None:
            entry = StoredResponse(builder.response(), messages,
                                   rp.input_items(prep.request, new_id))
        else:
            entry.response, entry.messages = builder.response(), messages
        self.store.put(entry)

    # --- streaming ----------------------------------------------------------------------
    async def _events(self, prep: ResponsesPrepared, builder: ResponseBuilder,
                      choices: StreamedChoices) -> AsyncIterator[str]:
        """The SSE body: the typed events of `builder` as the outputs arrive; the response
        is stored at its end."""
        for event in builder.start():
            yield sse_event(event)
        try:
            async for step in choices:
                for d in step.choices:
                    for event in builder.update(d):
                        yield sse_event(event)
            out = choices.finals[0]
            used = choices.usage_so_far()
            usage = responses_usage(used["prompt_tokens"], used["completion_tokens"],
                                    out.num_cached_tokens)
            for event in builder.finish(out.finish_reason, usage, out.error):
                yield sse_event(event)
            self._keep(prep, builder)
        except InputError as e:  # a prompt refused when queued (after the first output)
            yield sse_event(builder.event("error", code="invalid_request_error",
                                          message=str(e), param=e.field))
        except EngineDeadError as e:
            for event in builder.finish("error", None, str(e)):
                yield sse_event(event)
            yield sse_event(builder.event("error", code="engine_dead", message=str(e),
                                          param=None))

    # --- background ---------------------------------------------------------------------
    def _start_background(self, prep: ResponsesPrepared, builder: ResponseBuilder) -> dict:
        """Queues the request, stores the "queued" response and starts its task."""
        params = dataclasses.replace(prep.chat.parsed.params,
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        streams = self._submit(builder.id, [prep.chat.prompt], [params],
                               prep.chat.parsed.request.priority, prep.chat.lora)
        builder.status = "queued"
        entry = StoredResponse(builder.response(), prep.previous + prep.messages,
                               rp.input_items(prep.request, new_id))
        if not self.store.put(entry):
            for s in streams:
                s.cancel()
            raise HTTPError(400, "the request is larger than the response store can keep",
                            "invalid_request_error", "input")
        entry.task = asyncio.ensure_future(self._background(prep, builder, streams, params,
                                                            entry))
        return entry.response

    async def _background(self, prep: ResponsesPrepared, builder: ResponseBuilder,
                          streams: list[RequestStream], params: SamplingParams,
                          entry: StoredResponse) -> None:
        outputs = self._outputs(streams, [params], prep.chat.lora)
        self.tracker.in_flight += 1
        try:
            builder.status = "in_progress"
            entry.response = builder.response()
            _whole(builder, (await self._collect(outputs, 1))[0])
        except asyncio.CancelledError:  # POST .../cancel, or DELETE: the request is aborted
            builder.finish("abort", None)
        except EngineDeadError as e:
            builder.finish("error", None, str(e))
        finally:
            await close_outputs(outputs, streams)
            self.tracker.in_flight -= 1
            entry.task = None
            if self.store.get(builder.id) is entry:  # not deleted meanwhile
                self._keep(prep, builder, entry)

    # --- stored responses ---------------------------------------------------------------
    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise HTTPError(404, f"response {response_id!r} not found (never stored, expired "
                                 f"or deleted)", "invalid_request_error", "response_id",
                            "response_not_found")
        return entry

    def retrieve(self, response_id: str) -> dict:
        """The body of `GET /v1/responses/{id}`."""
        return self._stored(response_id).response

    def delete(self, response_id: str) -> dict:
        """The body of `DELETE /v1/responses/{id}` (a running background response is
        cancelled)."""
        entry = self._stored(response_id)
        self.store.delete(response_id)
        if entry.task is not None:
            entry.task.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        """The body of `POST /v1/responses/{id}/cancel`: the background response, cancelled
        (as it was, if it had already ended)."""
        entry = self._stored(response_id)
        if not entry.response.get("background"):
            raise HTTPError(400, "only background responses can be cancelled",
                            "invalid_request_error", "response_id")
        task = entry.task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return entry.response

    def input_items(self, response_id: str, order: str = "desc", limit: int = 20) -> dict:
        """The body of `GET /v1/responses/{id}/input_items` (newest first by default)."""
        if order not in ("asc", "desc"):
            raise HTTPError(400, "order must be asc or desc", "invalid_request_error", "order")
        if not 1 <= limit <= 100:
            raise HTTPError(400, "limit must be in [1, 100]", "invalid_request_error", "limit")
        items = list(self._stored(response_id).input_items)
        if order == "desc":
            items.reverse()
        data = items[:limit]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}
