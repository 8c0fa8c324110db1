"""`POST /v1/chat/completions` (vLLM's `OpenAIServingChat`): the messages rendered by the
chat template (with the request's `tools`), `n` samples; the whole response, or its stream
of `chat.completion.chunk`s.

With tools (`tool_calls.ToolPlan`, any `tool_choice` but "none"), each completion is read
by the plan's parser: a whole response gets `message.content` and `message.tool_calls`; a
stream sends each choice's text through a `tool_calls.ToolCallStream`, as `delta.content`
and `delta.tool_calls` items. finish_reason "tool_calls" when the model called ("auto"
with calls, "required").
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from arcjax.entrypoints.chat_template import ChatTemplate
from arcjax.entrypoints.openai import protocol as proto
from arcjax.entrypoints.openai.http_server import parse_json
from arcjax.entrypoints.openai.serving_engine import (ChoiceDelta, OpenAIServing, ServedRequest,
                                                      ServingContext, StreamedChoices)
from arcjax.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan
from arcjax.errors import RequestError
from arcjax.outputs import RequestOutput


class _StreamedToolCalls:
    """The streamed choices of a request with tools: each choice's text so far, read by its
    own `ToolCallStream`."""

    def __init__(self, tools: ToolPlan):
        self._tools = tools
        self._choices: dict[int, tuple[ToolCallStream, list[str]]] = {}  # index -> (., text)

    def delta(self, d: ChoiceDelta) -> tuple[dict, str | None]:
        """The chunk's `delta` (new content and `tool_calls` items) and finish reason."""
        stream, seen = self._choices.setdefault(d.index, (ToolCallStream(self._tools.parser),
                                                          []))
        seen.append(d.text)
        text, items, found = stream.update("".join(seen), d.finish_reason is not None)
        delta = {"content": text} if text else {}
        if items:
            delta["tool_calls"] = items
        return delta, self._tools.finish_reason(d.finish_reason, found)


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint (see `serving_engine` for the flow).

    Args:
      context: what the server's endpoints share.
      chat_template: renders the messages (and tools) into the prompt.
      tool_parser: the `tool_parsers.PARSERS` name `tool_choice: "auto"` reads calls with;
        None = "auto" is refused.
    """

    REQUEST_ID_PREFIX = "chatcmpl"
    CHAT = True

    def __init__(self, context: ServingContext, chat_template: ChatTemplate,
                 tool_parser: str | None):
        super().__init__(context)
        self.chat_template = chat_template
        self.tool_parser = tool_parser

    async def create_chat_completion(self, request: Request, raw: bytes) -> Response:
        """Answers one admitted request whose body is `raw`."""
        parsed, prompts = await self._in_pool(self._prepare, raw)
        return await self._serve(request, parsed, prompts)

    def _prepare(self, raw: bytes) -> tuple[proto.ParsedRequest, list[tuple[int, ...]]]:
        """(worker pool) The parsed request, its params, and the rendered prompt's ids."""
        parsed = proto.parse_chat(parse_json(raw), self.max_stop_strings, self.tool_parser)
        self.models.check_model(parsed.model)
        text = self.chat_template.render(parsed.messages,
                                         add_generation_prompt=parsed.add_generation_prompt,
                                         tools=list(parsed.tools.tools or ()) or None)
        engine = self.llm.engine
        try:  # the template printed the special tokens
            prompt = engine.inputs.encode(text, add_special_tokens=False)
        except RequestError as e:
            raise RequestError("messages", e.message, limit=e.limit) from None
        params = parsed.params
        if not parsed.max_tokens_given:  # OpenAI's default: up to the context length
            room = engine.max_model_len - len(prompt)
            params = dataclasses.replace(params, max_tokens=max(room, 1))
        ids = [self._engine_check(prompt, params, parsed, "messages")]
        return dataclasses.replace(parsed, params=params), ids

    def _response(self, served: ServedRequest, finals: Sequence[RequestOutput]) -> dict:
        params = served.parsed.params
        return proto.chat_response(served.request_id, served.created, served.model, finals,
                                   params.n, params.logprobs, served.parsed.tools)

    def _chunk(self, served: ServedRequest, index: int, delta: dict,
               finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return proto.chat_chunk(served.request_id, served.created, served.model, index, delta,
                                finish_reason, logprobs)

    async def _chunks(self, served: ServedRequest,
                      choices: StreamedChoices) -> AsyncIterator[dict]:
        """Each choice's assistant role first, a chunk per choice with something new (with
        tools: only when the parser has decided something), then the usage chunk if asked."""
        tools = served.parsed.tools
        calls = (_StreamedToolCalls(tools) if tools is not None and tools.mode != "none"
                 else None)
        for j in range(served.parsed.params.n):
            yield self._chunk(served, j, {"role": "assistant", "content": ""}, None)
        async for step in choices:
            for d in step.choices:
                if calls is None:
                    yield self._chunk(served, d.index, {"content": d.text} if d.text else {},
                                      d.finish_reason, d.logprobs)
                    continue
                delta, reason = calls.delta(d)
                if delta or reason is not None or d.logprobs is not None:
                    yield self._chunk(served, d.index, delta, reason, d.logprobs)
            if step.failure is not None:
                yield step.failure
        if served.parsed.include_usage:
            yield choices.usage_chunk("chat.completion.chunk")
