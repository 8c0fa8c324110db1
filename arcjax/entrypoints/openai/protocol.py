"""The OpenAI wire format: request bodies -> (prompts, SamplingParams), outputs -> JSON.

Pure functions, no I/O: the endpoints (`serving_completion.py`, `serving_chat.py`) call
`parse_completion` / `parse_chat` on the decoded JSON body and turn `RequestOutput`s into
responses and stream chunks with the builders below.

NOTE: validation lives here and in `SamplingParams` (types and ranges) and `Engine.check`
(lengths, vocabulary, grammars); every refusal is an `InputError` whose `.field` is the
request's own field name, so the server answers 400 with `param` naming it. Known fields the
engine does not support (best_of, echo, logit_bias, functions, ...) are refused by name unless
they carry their neutral value. Fields that are not part of the API are accepted and ignored,
as vLLM does (clients and SDKs add their own): the parsed request lists them in `ignored` (the
server logs each name once and returns them in a response header). `user` (an end-user id
OpenAI keeps for abuse monitoring) is known and ignored silently. A request may ask for at
most `max_stop_strings` stop strings: each is searched for after every token.

Chat messages: `content` is a string or a list of `{"type": "text", "text": ...}` parts
(joined with newlines, as vLLM does); the `developer` role (OpenAI's successor of `system`
for instructions) is rendered as `system`, which every chat template knows.

Structured outputs and tools (`arcjax.structured`): `response_format`, vLLM's
`structured_outputs` and `guided_*` fields become one `StructuredOutputsParams`
(`structured_fields`); chat's `tools` / `tool_choice` / `parallel_tool_calls` become a
`ToolPlan` (`tool_calls`), whose parser turns each completion into content and `tool_calls`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from arcjax.outputs import RequestOutput
from arcjax.entrypoints.openai import response_logprobs as lp
from arcjax.errors import RequestError, SamplingParamsError
from arcjax.sampling_params import SamplingParams
from arcjax.entrypoints.openai import structured_fields
from arcjax.entrypoints.openai.tool_calls import (ToolPlan, plan_tools, template_messages,
                                                  tool_calls_json)


class ProtocolError(RequestError):
    """A request body the API refuses (field: the offending request field, or "body")."""


DEFAULT_MAX_STOP_STRINGS = 16


# Sampling fields shared by both endpoints -> SamplingParams field.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "min_p": "min_p", "seed": "seed", "stop": "stop",
             "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
             "n": "n"}
# Known fields the engine does not support, with the values that mean "not used".
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
                "logit_bias": (None, {}), "functions": (None, []),
                "function_call": (None, "none"), "prompt_logprobs": (None,)}
_IGNORED = {"user"}  # see the module NOTE
_COMMON = {"model", "max_tokens", "stream", "stream_options", "logprobs", *_SAMPLING,
           *_UNSUPPORTED, *_IGNORED, *structured_fields.FIELDS}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "add_generation_prompt",
                          "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
# chat fields, refused in completions unless neutral
_COMPLETION_NEUTRAL = {"top_logprobs": (None, 0), "tools": (None, []),
                       "tool_choice": (None, "none"), "parallel_tool_calls": (None,)}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """What a request asks the engine for. `prompts` are text or token ids (completions);
    for chat, `messages` is set and the server renders the prompt."""

    model: str | None
    prompts: tuple  # str | tuple[int, ...] per choice (completions); () for chat
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_field: str  # how the client spelled max_tokens (for error messages)
    max_tokens_given: bool
    messages: tuple = ()
    add_generation_prompt: bool = True
    ignored: tuple[str, ...] = ()  # unknown fields, accepted and ignored (sorted)
    tools: ToolPlan | None = None  # chat: how tools shape the output and the response
    constraint: structured_fields.Constraint = structured_fields.Constraint(None, None)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_fields(body, allowed: set[str], unsupported: dict = _UNSUPPORTED) -> tuple[str, ...]:
    """Refuses known fields the server cannot honour; returns the unknown ones."""
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    for name, neutral in unsupported.items():
        if name in body and not any(type(body[name]) is type(v) and body[name] == v
                                    for v in neutral):
            raise ProtocolError(name, f"not supported by this server (got {body[name]!r})")
    return tuple(sorted(n for n in body if n not in allowed and n not in unsupported))


def _completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: None/false = off, an int = the top-k count."""
    k = body.get("logprobs")
    if k is None or k is False:
        return None
    if not _is_int(k):
        raise ProtocolError("logprobs", f"must be an int in [0, 20], got {k!r}")
    return k


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs: bool` and `top_logprobs: int` -> the top-k count, or None."""
    on, k = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise ProtocolError("logprobs", f"must be a boolean, got {on!r}")
    if k is not None:
        if not _is_int(k) or not 0 <= k <= 20:
            raise ProtocolError("top_logprobs", f"must be an int in [0, 20], got {k!r}")
        if not on:
            raise ProtocolError("top_logprobs", "requires logprobs: true")
    return (k or 0) if on else None


def _common(body: dict, max_field: str, default_max: int | None, logprobs: int | None,
            max_stop_strings: int,
            constraint: structured_fields.Constraint = structured_fields.Constraint(None, None)):
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("model", f"must be a string, got {model!r}")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError("stream", f"must be a boolean, got {stream!r}")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ProtocolError("stream_options", "only allowed when stream is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise ProtocolError("stream_options", f"only include_usage is supported, got {opts!r}")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise ProtocolError("stream_options.include_usage", "must be a boolean")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ProtocolError("stop", f"must be a string or a list of strings, got {stop!r}")
    if isinstance(stop, list) and len(stop) > max_stop_strings:
        raise ProtocolError("stop", f"at most {max_stop_strings} stop strings, got {len(stop)}",
                            limit=max_stop_strings)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise ProtocolError("stop_token_ids", f"must be a list of token ids, got {stop_ids!r}")
    kwargs = {dst: body[src] for src, dst in _SAMPLING.items() if body.get(src) is not None}
    max_tokens = body.get(max_field)
    given = max_tokens is not None
    kwargs["max_tokens"] = max_tokens if given else (default_max or 1)
    kwargs["logprobs"] = logprobs
    kwargs["structured_outputs"] = constraint.params
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as e:
        field = max_field if e.field == "max_tokens" else e.field
        raise SamplingParamsError(field, e.message, limit=e.limit) from None
    return model, params, stream, include_usage, given


def parse_completion(body, max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS) -> ParsedRequest:
    """A /v1/completions body (decoded JSON). Raises InputError naming the field."""
    ignored = _check_fields(body, _COMPLETION_FIELDS, {**_UNSUPPORTED, **_COMPLETION_NEUTRAL})
    if "prompt" not in body:
        raise ProtocolError("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = (tuple(prompt),)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or isinstance(p, list) and p and all(_is_int(t) for t in p)
            for p in prompt):
        prompts = tuple(p if isinstance(p, str) else tuple(p) for p in prompt)
    else:
        raise ProtocolError("prompt", "must be a string, a list of strings, a list of token "
                                      "ids or a list of lists of token ids (non-empty)")
    constraint = structured_fields.constraint_from_body(body)
    model, params, stream, include_usage, given = _common(
        body, "max_tokens", 16, _completion_logprobs(body), max_stop_strings, constraint)
    return ParsedRequest(model, prompts, params, stream, include_usage, "max_tokens", given,
                         ignored=ignored, constraint=constraint)


def parse_chat(body, max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS,
               tool_parser: str | None = None) -> ParsedRequest:
    """A /v1/chat/completions body (decoded JSON). Raises InputError naming the field.
    Message contents that are lists of text parts are joined into one string; the
    `developer` role becomes `system`; an assistant's `tool_calls` get their arguments
    decoded for the chat template. `tool_parser`: the server's parser of the model's tool
    calls (None: "auto" refused)."""
    ignored = _check_fields(body, _CHAT_FIELDS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ProtocolError("max_completion_tokens", "give max_tokens or "
                                                     "max_completion_tokens, not both")
    max_field = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages", "must be a non-empty list of messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProtocolError(f"messages[{i}]", "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                        part.get("text"), str):
                    raise ProtocolError(f"messages[{i}].content",
                                        "only text content parts are supported")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content", "must be a string or text parts")
        if m.get("function_call"):
            raise ProtocolError(f"messages[{i}].function_call", "not supported by this "
                                                                "server (use tool_calls)")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({**m, "role": role, "content": content})
    add_gen = body.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise ProtocolError("add_generation_prompt", "must be a boolean")
    tools = plan_tools(body.get("tools"), body.get("tool_choice"),
                       body.get("parallel_tool_calls"), tool_parser)
    constraint = structured_fields.constraint_from_body(body, tools.constraint)
    model, params, stream, include_usage, given = _common(body, max_field, None,
                                                          _chat_logprobs(body), max_stop_strings,
                                                          constraint)
    return ParsedRequest(model, (), params, stream, include_usage, max_field, given,
                         tuple(template_messages(clean)), add_gen, ignored, tools, constraint)


# --- responses ------------------------------------------------------------------------
def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(outputs: Sequence[RequestOutput], completion_tokens: int | None = None) -> dict:
    """Prompt tokens once per prompt; completion tokens of every choice (counted from the
    outputs, which must then carry everything, or given)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = completion_tokens if completion_tokens is not None else sum(
        len(c.token_ids) for o in outputs for c in lp.completions_of(o))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens
                                                           for o in outputs)}}


def _choices(outputs: Sequence[RequestOutput], n: int):
    """(choice index, completion) of every sample: prompt_index * n + sample index."""
    for i, o in enumerate(outputs):
        for c in lp.completions_of(o):
            yield i * n + c.index, c


def completion_response(rid: str, created: int, model: str, outputs: Sequence[RequestOutput],
                        n: int = 1, logprobs: int | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": c.text,
                         "logprobs": lp.choice_logprobs(c, logprobs, chat=False),
                         "finish_reason": c.finish_reason} for i, c in _choices(outputs, n)],
            "usage": usage(outputs)}


def chat_message(text: str, finish_reason: str | None, tools: ToolPlan | None
                 ) -> tuple[dict, str | None]:
    """A completion's `message` (content and, when the tools' parser finds calls,
    `tool_calls`) and its finish reason as OpenAI reports it."""
    if tools is None or tools.mode == "none":
        return {"role": "assistant", "content": text}, finish_reason
    parsed = tools.parser.parse(text, final=True)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = tool_calls_json(parsed.calls)
    return message, tools.finish_reason(finish_reason, parsed.calls)


def chat_response(rid: str, created: int, model: str, outputs: Sequence[RequestOutput],
                  n: int = 1, logprobs: int | None = None, tools: ToolPlan | None = None
                  ) -> dict:
    choices = []
    for i, c in _choices(outputs, n):
        message, reason = chat_message(c.text, c.finish_reason, tools)
        choices.append({"index": i, "message": message,
                        "logprobs": lp.choice_logprobs(c, logprobs, chat=True),
                        "finish_reason": reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outputs)}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n"


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str,
                outputs: Sequence[RequestOutput], completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(outputs, completion_tokens)}
