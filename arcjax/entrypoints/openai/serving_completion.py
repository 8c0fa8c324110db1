"""`POST /v1/completions` (vLLM's `OpenAIServingCompletion`): one or more prompts (text or
token ids), `n` samples each; the whole response, or its stream of `text_completion`
chunks.

vLLM's extensions: `echo` (the prompt before the text; with `logprobs`, the prompt's
positions first, the first one null; `max_tokens: 0` echoes without generating),
`prompt_logprobs` (per choice), `return_token_ids` (`token_ids`, `prompt_token_ids`),
`add_special_tokens` (BOS for text prompts; default true), `max_tokens: null` (up to the
context left), `stream_options.continuous_usage_stats` (`usage` on every chunk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from arcjax.entrypoints.openai import responses
from arcjax.entrypoints.openai.request_params import ParsedRequest, parse_completion
from arcjax.entrypoints.openai.response_logprobs import (choice_logprobs, completion_logprobs,
                                                         completions_of, prompt_logprobs_json)
from arcjax.entrypoints.openai.serving_engine import OpenAIServing
from arcjax.entrypoints.openai.streamed_choices import ServedRequest, StreamedChoices
from arcjax.errors import RequestError
from arcjax.lora.lora_request import LoRARequest
from arcjax.outputs import CompletionOutput, RequestOutput
from arcjax.sampling_params import SamplingParams

OBJECT = "text_completion"


@dataclasses.dataclass(frozen=True)
class CompletionPrepared:
    """A completion request ready to queue: parsed, every prompt's token ids and params,
    the LoRA adapter its `model` names (None: the base model)."""

    parsed: ParsedRequest
    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    lora: LoRARequest | None


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint (see `serving_engine` for the flow)."""

    REQUEST_ID_PREFIX = "cmpl"
    CHAT = False

    async def create_completion(self, request: Request, raw: bytes) -> Response:
        """Answers one admitted request whose body is `raw`."""
        prep = await self._in_pool(self._prepare, raw)
        return await self._serve(request, prep.parsed, prep.prompts, prep.params,
                                 lora=prep.lora)

    def _prepare(self, raw: bytes) -> CompletionPrepared:
        """(worker pool) The parsed request, every prompt's token ids and params, the
        adapter its `model` names."""
        self.check_body_values(raw)
        parsed = parse_completion(raw, self.defaults, self.max_stop_strings)
        lora = self.models.check_model(parsed.request.model)
        add_special, inputs = parsed.request.add_special_tokens, self.llm.engine.inputs
        ids, params = [], []
        for p in parsed.prompts:
            if isinstance(p, str):
                try:
                    p = inputs.encode(p, add_special_tokens=add_special,
                                      check_length=parsed.params.truncate_prompt_tokens is None)
                except RequestError as e:
                    raise RequestError("prompt", e.message, limit=e.limit) from None
            sp = self.fill_max_tokens(parsed, parsed.params, p)
            ids.append(self._engine_check(p, sp, parsed, "prompt", lora))
            params.append(sp)
        return CompletionPrepared(parsed, tuple(ids), tuple(params), lora)

    # --- the prompt's part of a choice (echo) ---------------------------------------------
    def _echo_only(self, parsed: ParsedRequest) -> bool:
        return bool(parsed.request.echo) and parsed.request.max_tokens == 0

    def _prompt_text(self, served: ServedRequest, i: int) -> str:
        """Prompt i as echoed: its text as given, or its token ids decoded (as vLLM)."""
        given = served.parsed.prompts[i]
        if isinstance(given, str):
            return given
        return self.llm.engine.tokenizer.decode(served.prompts[i], skip_special_tokens=False)

    def _echo_logprobs(self, served: ServedRequest, prompt: Sequence[int],
                       entries: Sequence | None) -> dict:
        """The completions logprobs object of the prompt's positions (echo; a position
        without an entry, the first, is null)."""
        tok = self.llm.engine.tokenizer
        return completion_logprobs(list(entries or [None] * len(prompt)), prompt,
                                   names=served.names, texts=[tok.token_text(t) for t in prompt])

    def _choice(self, served: ServedRequest, index: int, out: RequestOutput,
                c: CompletionOutput) -> dict:
        """One whole choice (`index`: prompt index * n + sample index)."""
        parsed, k = served.parsed, served.parsed.params.logprobs
        req = parsed.request
        echo_only = self._echo_only(parsed)
        text = "" if echo_only else c.text
        logprobs = None if echo_only else choice_logprobs(c, k, chat=False,
                                                          names=served.names)
        if req.echo:
            prompt_text = self._prompt_text(served, index // parsed.params.n)
            if k is not None:
                head = self._echo_logprobs(served, out.prompt_token_ids, out.prompt_logprobs)
                tail = logprobs or {key: [] for key in head}
                shift = len(prompt_text)
                logprobs = {key: head[key] + (tail[key] if key != "text_offset" else
                                              [o + shift for o in tail[key]])
                            for key in head}
            text = prompt_text + text
        return responses.completion_choice(
            index, text, logprobs, c.finish_reason,
            token_ids=(() if echo_only else c.token_ids) if req.return_token_ids else None,
            prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None,
            prompt_logprobs=(prompt_logprobs_json(out.prompt_logprobs, served.names)
                             if req.prompt_logprobs is not None else None))

    def _response(self, served: ServedRequest, finals: Sequence[RequestOutput]) -> dict:
        n = served.parsed.params.n
        choices, tokens = [], 0
        for i, out in enumerate(finals):
            for c in completions_of(out):
                choices.append(self._choice(served, i * n + c.index, out, c))
                tokens += len(c.token_ids)
        if self._echo_only(served.parsed):
            tokens = 0
        return responses.completion_body(served.request_id, served.created, served.model,
                                         choices, responses.usage(finals, tokens))

    async def _chunks(self, served: ServedRequest,
                      choices: StreamedChoices) -> AsyncIterator[dict]:
        """With echo, each choice's prompt first; a chunk per choice with something new,
        then the usage chunk if asked."""
        req, n = served.parsed.request, served.parsed.params.n
        continuous = served.parsed.continuous_usage
        echoed: set[int] = set()
        prompt_entries: dict[int, list] = {}  # prompt index -> its prompt logprobs
        echo_only = self._echo_only(served.parsed)
        async for step in choices:
            if step.prompt_logprobs is not None:
                prompt_entries[step.prompt_index] = step.prompt_logprobs
            for d in step.choices:
                if req.echo and d.index not in echoed:
                    echoed.add(d.index)
                    prompt = served.prompts[d.index // n]
                    logprobs = None
                    if served.parsed.params.logprobs is not None:
                        logprobs = self._echo_logprobs(served, prompt,
                                                       prompt_entries.get(d.index // n))
                    yield self._chunk(served, choices, responses.completion_choice(
                        d.index, self._prompt_text(served, d.index // n), logprobs, None),
                                      continuous)
                text, logprobs = ("", None) if echo_only else (d.text, d.logprobs)
                yield self._chunk(served, choices, responses.completion_choice(
                    d.index, text, logprobs, d.finish_reason,
                    token_ids=d.token_ids if req.return_token_ids else None), continuous)
            if step.failure is not None:
                yield step.failure
        if served.parsed.include_usage:
            yield choices.usage_chunk(OBJECT)

    @staticmethod
    def _chunk(served: ServedRequest, choices: StreamedChoices, choice: dict,
               continuous: bool) -> dict:
        return responses.chunk(served.request_id, served.created, served.model, OBJECT, choice,
                               choices.usage_so_far() if continuous else None)

