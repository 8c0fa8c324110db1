"""`POST /v1/chat/completions` (vLLM's `OpenAIServingChat`): the messages rendered by the
chat template (the request's own `chat_template` if it gives one, with its tools and
template kwargs: `chat_template_kwargs`, `documents`, `reasoning_effort`), `n` samples;
the whole response, or its stream of `chat.completion.chunk`s.

Each choice is read by `chat_output`: the engine's reasoning split (`message.reasoning` and
`reasoning_content`; streamed as `delta.reasoning` / `delta.reasoning_content`; left out
with `include_reasoning: false`) and, with tools (`tool_calls.ToolPlan`, any
`tool_choice` but "none"), the plan's parser over the content: `message.tool_calls` /
`delta.tool_calls` items; finish_reason "tool_calls" when the model called ("auto" with
calls, "required"). A parser whose markers are special tokens of the vocabulary (harmony,
Mistral's `[TOOL_CALLS]`) gets them: the request's text keeps special tokens (vLLM's
`adjust_request`). vLLM's extensions: `continue_final_message`, `echo` (the final message's
content before a continuation of it), `add_special_tokens` (default false: the template
prints them), `prompt_logprobs`, `return_token_ids`, `return_prompt_text`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from arcjax.entrypoints.chat_template import ChatTemplate
from arcjax.entrypoints.openai import responses
from arcjax.entrypoints.openai.chat_output import ChatOutputStream, read_output
from arcjax.entrypoints.openai.request_params import ParsedRequest, parse_chat
from arcjax.entrypoints.openai.response_logprobs import (choice_logprobs, completions_of,
                                                         prompt_logprobs_json)
from arcjax.entrypoints.openai.serving_engine import OpenAIServing, ServingContext
from arcjax.entrypoints.openai.streamed_choices import ServedRequest, StreamedChoices
from arcjax.entrypoints.openai.tool_calls import tool_calls_json
from arcjax.errors import RequestError
from arcjax.lora.lora_request import LoRARequest
from arcjax.outputs import RequestOutput

OBJECT = "chat.completion.chunk"


@dataclasses.dataclass(frozen=True)
class ChatPrepared:
    """A chat request ready to queue: parsed, its prompt text and token ids, the LoRA
    adapter its `model` names (None: the base model)."""

    parsed: ParsedRequest
    prompt_text: str
    prompt: tuple[int, ...]
    lora: LoRARequest | None = None


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
        prep = await self._in_pool(self._prepare, raw)
        return await self._serve(request, prep.parsed, [prep.prompt], [prep.parsed.params],
                                 prep.prompt_text, prep.lora)

    def render(self, parsed: ParsedRequest) -> str:
        """The prompt text of a parsed chat request (any thread)."""
        req = parsed.request
        template = (self.chat_template if req.chat_template is None else
                    ChatTemplate(req.chat_template, self.chat_template.special_tokens))
        return template.render(parsed.messages, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               tools=list(parsed.tools.tools or ()) or None,
                               **parsed.template_kwargs)

    def _needs_special_tokens(self, parsed: ParsedRequest) -> bool:
        """Whether the request's parsers read special tokens (which the text then keeps, with
        no spaces added around them)."""
        engine = self.llm.engine
        reasoning = engine.inputs.reasoning
        if reasoning is not None and reasoning.parser.needs_special_tokens:
            return True
        tools = parsed.tools
        specials = engine.tokenizer.special_texts if engine.tokenizer is not None else ()
        return (tools is not None and tools.mode == "auto"
                and any(m in specials for m in tools.parser.markers))

    def check_size(self, raw: bytes) -> None:
        """Refuses, before the body is validated, a conversation with more messages than
        max_model_len (each message takes a token at least: its role's marker). Counted on
        the raw JSON (a `"role"` key outside a message could only overcount), so a body of
        a million messages never makes a million objects: validating those would hold the
        GIL, and stall the event loop, for seconds."""
        limit = self.llm.engine.max_model_len
        count = raw.count(b'"role"')
        if count > limit:
            raise RequestError("messages", f"{count} messages: more than max_model_len "
                                           f"{limit} tokens can hold", limit=limit)

    def _prepare(self, raw: bytes) -> ChatPrepared:
        """(worker pool) The parsed request, its params, and the rendered prompt's ids."""
        self.check_size(raw)
        self.check_body_values(raw)
        return self.prepare(self.parse(raw))

    def parse(self, raw: bytes) -> ParsedRequest:
        """(any thread) A chat body parsed with this server's defaults and tool parser."""
        return parse_chat(raw, self.defaults, self.max_stop_strings, self.tool_parser,
                          self.llm.engine.inputs.check_text_length)

    def prepare(self, parsed: ParsedRequest) -> ChatPrepared:
        """(worker pool) A parsed chat request rendered, tokenized and checked by the engine
        (the Responses endpoint's requests come here too: one copy of the chat path)."""
        engine = self.llm.engine
        lora = self.models.check_model(parsed.request.model)
        text = self.render(parsed)
        params = parsed.params
        try:  # the template printed the special tokens
            prompt = engine.inputs.encode(text, add_special_tokens=parsed.request.
                                          add_special_tokens, check_length=params.
                                          truncate_prompt_tokens is None)
        except RequestError as e:
            raise RequestError("messages", e.message, limit=e.limit) from None
        if self._needs_special_tokens(parsed):  # the markers as the model wrote them
            params = dataclasses.replace(params, skip_special_tokens=False,
                                         spaces_between_special_tokens=False)
        params = self.fill_max_tokens(parsed, params, prompt)
        ids = self._engine_check(prompt, params, parsed, "messages", lora)
        return ChatPrepared(dataclasses.replace(parsed, params=params), text, ids, lora)

    # --- responses ------------------------------------------------------------------------
    def _echo(self, parsed: ParsedRequest) -> str:
        """vLLM's chat echo: the final message's content when the reply continues it."""
        last = parsed.messages[-1] if parsed.messages else {}
        if parsed.request.echo and last.get("role") == "assistant":
            return last.get("content") or ""
        return ""

    @staticmethod
    def _extra(served: ServedRequest, out: RequestOutput | None, first_chunk: bool) -> dict:
        req, extra = served.parsed.request, {}
        if req.return_token_ids and first_chunk:
            extra["prompt_token_ids"] = list(served.prompts[0])
        if req.return_prompt_text and first_chunk:
            extra["prompt_text"] = served.prompt_text
        if out is not None and req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, served.names)
        return extra

    def _response(self, served: ServedRequest, finals: Sequence[RequestOutput]) -> dict:
        parsed = served.parsed
        tools, req, k = parsed.tools, parsed.request, parsed.params.logprobs
        choices, tokens = [], 0
        for c in completions_of(finals[0]):
            out = read_output(c, tools)
            echo = self._echo(parsed)
            if echo:
                out = dataclasses.replace(out, content=echo + (out.content or ""))
            calls = tool_calls_json(out.calls, tools.parser)
            message = responses.chat_message(out, calls, req.include_reasoning)
            reason = tools.finish_reason(c.finish_reason, out.calls)
            choices.append(responses.chat_choice(
                c.index, message, choice_logprobs(c, k, chat=True, names=served.names),
                reason, c.token_ids if req.return_token_ids else None))
            tokens += len(c.token_ids)
        return responses.chat_body(served.request_id, served.created, served.model, choices,
                                   responses.usage(finals, tokens),
                                   self._extra(served, finals[0], True))

    async def _chunks(self, served: ServedRequest,
                      choices: StreamedChoices) -> AsyncIterator[dict]:
        """Each choice's assistant role first, a chunk per choice with something new (with
        tools: only when the parser has decided something), then the usage chunk if asked."""
        parsed = served.parsed
        req, n = parsed.request, parsed.params.n
        continuous, streams = parsed.continuous_usage, {}
        echo = self._echo(parsed)
        for j in range(n):
            yield self._chunk(served, choices, {"index": j, "logprobs": None,
                                                "finish_reason": None,
                                                "delta": {"role": "assistant",
                                                          "content": echo}},
                              continuous, self._extra(served, None, j == 0))
        async for step in choices:
            for d in step.choices:
                stream = streams.setdefault(d.index, ChatOutputStream(parsed.tools))
                new = stream.update(d)
                delta = responses.chat_delta(new.reasoning, new.content, new.tool_items,
                                             req.include_reasoning)
                reason = parsed.tools.finish_reason(d.finish_reason, new.calls)
                if delta or reason is not None or d.logprobs is not None:
                    choice = {"index": d.index, "delta": delta, "logprobs": d.logprobs,
                              "finish_reason": reason}
                    if req.return_token_ids:
                        choice["token_ids"] = list(d.token_ids)
                    yield self._chunk(served, choices, choice, continuous)
            if step.failure is not None:
                yield step.failure
        if parsed.include_usage:
            yield choices.usage_chunk(OBJECT)

    @staticmethod
    def _chunk(served: ServedRequest, choices: StreamedChoices, choice: dict,
               continuous: bool, extra: dict | None = None) -> dict:
        return responses.chunk(served.request_id, served.created, served.model, OBJECT,
                               choice, choices.usage_so_far() if continuous else None, extra)
