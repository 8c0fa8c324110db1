"""`/v1/responses` (vLLM's `OpenAIServingResponses`): create (whole, streamed, or in the
background), retrieve, delete, cancel, and the input items of a stored response.

1. `create_response`: the body is decoded in the worker pool; `previous_response_id` is
   looked up in the `ResponseStore` (on the event loop, its only user); the request
   becomes a chat request (`responses_protocol.parse_responses`) that the chat endpoint
   prepares as its own (`OpenAIServingChat.prepare_body`: template, tools, structured
   outputs, tokenization), so both endpoints share one copy of that logic.
2. It is queued like any generation request (`OpenAIServingBase._submit`) and read by a
   `ResponseBuilder` (responses_events.py): the whole response (FINAL_ONLY), the typed
   event stream (DELTA outputs; the first awaited under the disconnect watch, so a bad
   request still gets its 400), or, with `background: true`, a task that runs it while
   the client gets the "queued" response at once.
3. With `store: true` (the default) the finished response and its conversation are kept
   in the store (bounded by TTL and bytes); a background response is kept from the start
   and rewritten when it ends. `POST /v1/responses/{id}/cancel` cancels a background
   response's task (its engine request is aborted; status "cancelled").

NOTE: a streamed response's disconnect aborts its request; a background one's does not
(it runs until done, cancelled, deleted or the server drains). The store is touched only
from the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arcjax.entrypoints.async_llm import RequestStream
from arcjax.entrypoints.openai.http_server import (EventStream, HTTPError, close_outputs,
                                                   parse_json, until_disconnect)
from arcjax.entrypoints.openai.protocol import ParsedRequest
from arcjax.entrypoints.openai.responses_events import (ResponseBuilder, new_id,
                                                        responses_usage, sse_event)
from arcjax.entrypoints.openai.responses_protocol import (ParsedResponses, parse_responses,
                                                          renamed)
from arcjax.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from arcjax.entrypoints.openai.serving_chat import OpenAIServingChat
from arcjax.entrypoints.openai.serving_engine import OpenAIServingBase, ServingContext
from arcjax.errors import EngineDeadError, InputError
from arcjax.outputs import RequestOutput
from arcjax.sampling_params import RequestOutputKind


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A create request, prepared: the Responses fields, the chat request it became, the
    conversation it continues, its prompt."""

    parsed: ParsedResponses
    chat: ParsedRequest
    previous: tuple[dict, ...]
    prompt: tuple[int, ...]


def _usage(out: RequestOutput, output_tokens: int) -> dict:
    return responses_usage(len(out.prompt_token_ids), output_tokens, out.num_cached_tokens)


class OpenAIServingResponses(OpenAIServingBase):
    """The Responses endpoints (see the module docstring).

    Args:
      context: what the server's endpoints share.
      chat: the chat endpoint, whose preparation every response reuses.
      store: where stored responses live.
    """

    def __init__(self, context: ServingContext, chat: OpenAIServingChat, store: ResponseStore):
        super().__init__(context)
        self.chat, self.store = chat, store

    # --- create -------------------------------------------------------------------------
    async def create_response(self, request: Request, raw: bytes) -> Response:
        """Answers one admitted `POST /v1/responses` whose body is `raw`."""
        body = await self._in_pool(parse_json, raw)
        previous = self._previous(body)
        prepared = await self._in_pool(lambda b: self._prepare(b, previous), body)
        parsed = prepared.parsed
        builder = ResponseBuilder(new_id("resp"), self.models.model_name, parsed.echo,
                                  prepared.chat.tools)
        headers = self.tracker.ignored_header(parsed)
        if parsed.background:
            return JSONResponse(self._start_background(prepared, builder), headers=headers)
        kind = RequestOutputKind.DELTA if parsed.stream else RequestOutputKind.FINAL_ONLY
        streams = self._submit(builder.id, [prepared.prompt],
                               dataclasses.replace(prepared.chat.params, output_kind=kind))
        outputs = self._outputs(streams)
        self.tracker.in_flight += 1
        handed_over = False
        try:
            if not parsed.stream:
                ok, finals = await until_disconnect(request, self._collect(outputs, 1))
                if not ok:
                    return Response(status_code=499)  # nobody is listening
                out = finals[0]
                if out.finish_reason == "error":
                    raise HTTPError(500, f"generation failed: {out.error}", "internal_error")
                builder.update(out.text)
                builder.finish(out.finish_reason, _usage(out, len(out.token_ids)))
                self._keep(prepared, builder)
                return JSONResponse(builder.response(), headers=headers)
            ok, first = await until_disconnect(request, outputs.__anext__())
            if not ok:
                return Response(status_code=499)

            async def on_close():
                await close_outputs(outputs, streams)
                self.tracker.in_flight -= 1

            handed_over = True
            return EventStream(self._events(prepared, builder, first[1], outputs), on_close,
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", **headers})
        finally:
            if not handed_over:
                await close_outputs(outputs, streams)
                self.tracker.in_flight -= 1

    def _previous(self, body) -> tuple[dict, ...]:
        """(event loop) The conversation `previous_response_id` continues (checked)."""
        rid = body.get("previous_response_id") if isinstance(body, dict) else None
        if rid is None:
            return ()
        entry = self.store.get(rid) if isinstance(rid, str) else None
        if entry is None:
            raise HTTPError(400, f"previous response {rid!r} not found (never stored, "
                                 f"expired or deleted)", "invalid_request_error",
                            "previous_response_id", "previous_response_not_found")
        if not entry.final:
            raise HTTPError(400, f"previous response {rid!r} is still {entry.status}",
                            "invalid_request_error", "previous_response_id")
        return entry.messages

    def _prepare(self, body, previous: tuple[dict, ...]) -> _Prepared:
        """(worker pool) The Responses fields, and the chat request prepared by the chat
        endpoint (errors renamed to the Responses fields)."""
        parsed = parse_responses(body, previous)
        try:
            chat, prompts = self.chat.prepare_body(parsed.chat_body)
        except InputError as e:
            raise renamed(e) from None
        return _Prepared(parsed, chat, previous, prompts[0])

    def _keep(self, prepared: _Prepared, builder: ResponseBuilder,
              entry: StoredResponse | None = None) -> None:
        """Stores the response (when asked) with the conversation it ends."""
        if not prepared.parsed.store:
            return
        messages = prepared.previous + prepared.parsed.messages + builder.conversation()
        if entry is None:
            entry = StoredResponse(builder.response(), messages, self._items(prepared))
        else:
            entry.response, entry.messages = builder.response(), messages
        self.store.put(entry)

    @staticmethod
    def _items(prepared: _Prepared) -> tuple[dict, ...]:
        """The request's input items as `input_items` lists them: with ids, a message's
        string content as one text part."""
        out = []
        for item in prepared.parsed.input_items:
            item = {"id": item.get("id") or new_id("msg"), **item}
            if item.get("type", "message") == "message":
                content = item.get("content")
                if isinstance(content, str):
                    kind = "output_text" if item.get("role") == "assistant" else "input_text"
                    content = [{"type": kind, "text": content}]
                item = {**item, "type": "message", "status": "completed", "content": content}
            out.append(item)
        return tuple(out)

    # --- streaming ----------------------------------------------------------------------
    async def _events(self, prepared: _Prepared, builder: ResponseBuilder,
                      out: RequestOutput, outputs: AsyncIterator) -> AsyncIterator[str]:
        """The SSE body: the typed events of `builder` as the outputs arrive (the first
        is `out`); the response is stored at its end."""
        for event in builder.start():
            yield sse_event(event)
        tokens = 0
        try:
            while True:
                tokens += len(out.token_ids)
                if out.finished:
                    events = ([] if out.finish_reason == "error" else builder.update(out.text))
                    events += builder.finish(out.finish_reason, _usage(out, tokens), out.error)
                    for event in events:
                        yield sse_event(event)
                    self._keep(prepared, builder)
                    return
                for event in builder.update(out.text):
                    yield sse_event(event)
                _, out = await outputs.__anext__()
        except InputError as e:  # a prompt refused when queued (after the first output)
            yield sse_event(builder.event("error", code="invalid_request_error",
                                           message=str(e), param=e.field))
        except EngineDeadError as e:
            for event in builder.finish("error", None, str(e)):
                yield sse_event(event)
            yield sse_event(builder.event("error", code="engine_dead", message=str(e),
                                           param=None))

    # --- background ---------------------------------------------------------------------
    def _start_background(self, prepared: _Prepared, builder: ResponseBuilder) -> dict:
        """Queues the request, stores the "queued" response and starts its task."""
        streams = self._submit(builder.id, [prepared.prompt], dataclasses.replace(
            prepared.chat.params, output_kind=RequestOutputKind.FINAL_ONLY))
        builder.status = "queued"
        entry = StoredResponse(builder.response(),
                               prepared.previous + prepared.parsed.messages,
                               self._items(prepared))
        if not self.store.put(entry):
            for s in streams:
                s.cancel()
            raise HTTPError(400, "the request is larger than the response store can keep",
                            "invalid_request_error", "input")
        entry.task = asyncio.ensure_future(self._background(prepared, builder, streams, entry))
        return entry.response

    async def _background(self, prepared: _Prepared, builder: ResponseBuilder,
                          streams: list[RequestStream], entry: StoredResponse) -> None:
        outputs = self._outputs(streams)
        self.tracker.in_flight += 1
        try:
            builder.status = "in_progress"
            entry.response = builder.response()
            out = (await self._collect(outputs, 1))[0]
            builder.update(out.text)
            builder.finish(out.finish_reason, _usage(out, len(out.token_ids)), out.error)
        except asyncio.CancelledError:  # POST .../cancel, or DELETE: the request is aborted
            builder.finish("abort", None)
        except EngineDeadError as e:
            builder.finish("error", None, str(e))
        finally:
            await close_outputs(outputs, streams)
            self.tracker.in_flight -= 1
            entry.task = None
            if self.store.get(builder.id) is entry:  # not deleted meanwhile
                self._keep(prepared, builder, entry)

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
