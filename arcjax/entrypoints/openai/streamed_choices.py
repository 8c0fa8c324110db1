"""What a streamed (or whole) generation response is built from: the request as its
response sees it (`ServedRequest`), its engine outputs read per choice (`StreamedChoices`:
one `OutputDeltas` per engine output, the usage so far), and the SSE body of a stream
(`event_stream`: each chunk an event, a failure an error event, then `[DONE]`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from arcjax.entrypoints.openai import responses
from arcjax.entrypoints.openai.request_params import ParsedRequest
from arcjax.entrypoints.openai.response_logprobs import (ChoiceDelta, ChoiceStream, TokenNames,
                                                         completions_of)
from arcjax.errors import EngineDeadError, InputError
from arcjax.outputs import RequestOutput


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedRequest:
    """One generation request as its response sees it.

    Attributes:
      parsed: what the request asked for.
      request_id: the response's id; the engine's request ids add "-<prompt index>".
      created: the response's creation time (Unix seconds).
      model: the served model's name.
      prompts: every prompt's token ids (choices: len(prompts) * n).
      names: how tokens are named in log-probabilities.
      prompt_text: chat: the rendered prompt (`return_prompt_text`).
    """

    parsed: ParsedRequest
    request_id: str
    created: int
    model: str
    prompts: tuple[tuple[int, ...], ...]
    names: TokenNames = TokenNames()
    prompt_text: str | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)


@dataclasses.dataclass(frozen=True)
class OutputDeltas:
    """One engine output of a streamed request: its choices' deltas, the error event to
    send when the output ends its prompt's generation in failure (else None), and the
    prompt's log-probabilities when this output carries them (its prompt's first)."""

    choices: tuple[ChoiceDelta, ...]
    failure: dict | None
    prompt_index: int = 0
    prompt_logprobs: list | None = None


class StreamedChoices:
    """The outputs of a streamed request read per choice: `async for step in choices`
    gives one `OutputDeltas` per engine output (a choice appears when it has something to
    send: text held back by the detokenizer rides, with its logprobs, in the next one).
    Remembers each prompt's final output and counts the choices' tokens for
    `usage_chunk`."""

    def __init__(self, served: ServedRequest, first: tuple[int, RequestOutput],
                 rest: AsyncIterator[tuple[int, RequestOutput]], *, chat: bool):
        self._served, self._first, self._rest = served, first, rest
        self._choices = ChoiceStream(served.parsed.params.logprobs, chat, served.names)
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
            new = self._choices.delta(i * n + c.index, c)
            if new is not None:
                deltas.append(new)
        failure = None
        if out.finished:
            self._finals[i] = out
            if out.finish_reason == "error":
                failure = responses.error_body(f"generation failed: {out.error}",
                                               "internal_error")
        return OutputDeltas(tuple(deltas), failure, i, out.prompt_logprobs)

    @property
    def finals(self) -> tuple[RequestOutput | None, ...]:
        """Each prompt's final output (None until it came)."""
        return tuple(self._finals)

    def usage_so_far(self) -> dict:
        """`usage` now (`stream_options.continuous_usage_stats`: on every chunk)."""
        prompt = sum(len(p) for p in self._served.prompts)
        completion = sum(self._choices.tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def usage_chunk(self, obj: str) -> dict:
        """The chunk `stream_options.include_usage` asks for, after every choice's last
        (`obj`: the endpoint's chunk object name)."""
        s = self._served
        return responses.usage_chunk(s.request_id, s.created, s.model, obj, self._finals,
                                     sum(self._choices.tokens.values()))


async def event_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The SSE body of a streamed response: each chunk as one event, then `[DONE]`. An
    error that ends the stream early (a prompt refused when queued, after the first output;
    a dead engine) is an error event before the `[DONE]` (as vLLM's). Closing the body
    closes `chunks`."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield responses.sse(chunk)
        except InputError as e:
            yield responses.sse(responses.error_body(str(e), "invalid_request_error",
                                                     e.field))
        except EngineDeadError as e:
            yield responses.sse(responses.error_body(str(e), "service_unavailable",
                                                     code="engine_dead"))
        yield responses.sse("[DONE]")
