"""`POST /v1/completions` (vLLM's `OpenAIServingCompletion`): one or more prompts (text or
token ids), `n` samples each; the whole response, or its stream of `text_completion`
chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from arcjax.entrypoints.openai import protocol as proto
from arcjax.entrypoints.openai.http_server import parse_json
from arcjax.entrypoints.openai.serving_engine import OpenAIServing, ServedRequest, StreamedChoices
from arcjax.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint (see `serving_engine` for the flow)."""

    REQUEST_ID_PREFIX = "cmpl"
    CHAT = False

    async def create_completion(self, request: Request, raw: bytes) -> Response:
        """Answers one admitted request whose body is `raw`."""
        parsed, prompts = await self._in_pool(self._prepare, raw)
        return await self._serve(request, parsed, prompts)

    def _prepare(self, raw: bytes) -> tuple[proto.ParsedRequest, list[tuple[int, ...]]]:
        """(worker pool) The parsed request and every prompt's token ids."""
        parsed = proto.parse_completion(parse_json(raw), self.max_stop_strings)
        self.models.check_model(parsed.model)
        return parsed, [self._engine_check(p, parsed.params, parsed, "prompt")
                        for p in parsed.prompts]

    def _response(self, served: ServedRequest, finals: Sequence[RequestOutput]) -> dict:
        params = served.parsed.params
        return proto.completion_response(served.request_id, served.created, served.model,
                                         finals, params.n, params.logprobs)

    async def _chunks(self, served: ServedRequest,
                      choices: StreamedChoices) -> AsyncIterator[dict]:
        """A chunk per choice with something new, then the usage chunk if asked."""
        async for step in choices:
            for d in step.choices:
                yield proto.completion_chunk(served.request_id, served.created, served.model,
                                             d.index, d.text, d.finish_reason, d.logprobs)
            if step.failure is not None:
                yield step.failure
        if served.parsed.include_usage:
            yield choices.usage_chunk("text_completion")
