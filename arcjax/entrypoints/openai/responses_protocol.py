"""The Responses API's request body (`ResponsesRequest`) -> the chat path's request (one copy
of the chat logic).

`parse_responses(raw)` validates what `POST /v1/responses` adds to chat; `chat_body(req,
previous)` turns it into a chat-completions body, which `request_params.parse_chat` then
validates as for `/v1/chat/completions` (sampling fields, tools, structured outputs,
messages): the same template rendering, tool parsing and output processing serve both.

  input                  a string (one user message) or a list of items: messages
                         ({"role", "content"}: a string or input_text / output_text
                         parts), `function_call` items (an assistant's call: call_id,
                         name, arguments), `function_call_output` items (the tool's
                         answer: call_id, output); `reasoning` items are accepted and left
                         out of the prompt (as chat templates drop past reasoning)
  instructions           a system message before the input (not carried over by
                         previous_response_id, as OpenAI)
  previous_response_id   the stored conversation it continues (its input and output)
  max_output_tokens      max_completion_tokens
  tools                  function tools {"type": "function", "name", "description",
                         "parameters", "strict"}
  tool_choice            "none" | "auto" | "required" | {"type": "function", "name"}
  text.format            {"type": "text" | "json_object"} or {"type": "json_schema", "name",
                         "schema", "strict"}: response_format
  reasoning.effort       reasoning_effort (the template's `reasoning_effort`, and
                         `enable_thinking` unless "none")
  store, background, metadata, stream, temperature, top_p, parallel_tool_calls, user,
  truncation ("disabled"), include: as OpenAI's; vLLM's sampling extras (top_k, min_p,
  seed, stop, ignore_eos, the penalties, min_tokens, logit_bias, priority) go to the chat request as
  they are; unknown fields are ignored and listed.

Errors name the Responses field: a chat field in an error (`messages[3].content`,
`max_completion_tokens`, `response_format.json_schema.schema`, `tools[0].function.name`,
`reasoning_effort`) is renamed (`input`, `max_output_tokens`, `text.format.schema`,
`tools[0].name`, `reasoning.effort`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from arcjax.entrypoints.openai.protocol import (ClosedModel, OpenAIBaseModel, ProtocolError,
                                                parse_body)
from arcjax.errors import InputError

# vLLM's sampling extras a Responses request may carry: passed to the chat request as given
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                   "logit_bias", "priority")
_RENAMES = ((re.compile(r"^messages(\[\d+\])?"), "input"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^max_tokens"), "max_output_tokens"),
            (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
            (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1"),
            (re.compile(r"^reasoning_effort"), "reasoning.effort"))
_TEXT_PARTS = ("input_text", "output_text", "text")


class TextParam(ClosedModel):
    """`text`: the output's format (`verbosity` is accepted and has no effect)."""

    format: dict | None = None
    verbosity: str | None = None


class ReasoningParam(ClosedModel):
    """`reasoning`: the effort (`summary` is accepted: reasoning is returned whole)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(OpenAIBaseModel):
    """`POST /v1/responses` (OpenAI's fields, vLLM's sampling extras)."""

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    store: bool | None = True
    background: bool | None = False
    stream: bool | None = False
    stream_options: dict | None = None  # include_obfuscation: nothing to obfuscate here
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Any = None  # checked by the chat request
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None


def parse_responses(raw: bytes) -> ResponsesRequest:
    """A /v1/responses body. Raises InputError naming the field."""
    req = parse_body(ResponsesRequest, raw)
    if isinstance(req.input, list) and not req.input:
        raise ProtocolError("input", "must be a string or a non-empty list of items")
    if req.background and req.store is False:
        raise ProtocolError("background", "a background response must be stored (store: true)")
    if req.background and req.stream:
        raise ProtocolError("background", "streaming a background response is not supported")
    return req


def renamed(error: InputError) -> InputError:
    """`error` with its chat field named as the Responses request names it."""
    field = error.field or ""
    for pattern, name in _RENAMES:
        new = pattern.sub(name, field, count=1)
        if new != field:
            return type(error)(new, error.message, limit=error.limit)
    return error


def _text(content, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(where, "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(
                part.get("text"), str):
            raise ProtocolError(f"{where}[{j}]", "only input_text and output_text parts are "
                                                 "supported")
        parts.append(part["text"])
    return "\n".join(parts)


def input_messages(raw: str | list[dict]) -> list[dict]:
    """The request's `input` as chat messages (see the module docstring). Consecutive
    function calls join one assistant message (after its text, if any)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ProtocolError(f"{where}.role", f"must be user, assistant, system or "
                                                     f"developer, got {role!r}")
            out.append({"role": role, "content": _text(item.get("content"),
                                                       f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ProtocolError(f"{where}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ProtocolError(f"{where}.call_id", "must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise ProtocolError(f"{where}.type", f"{kind!r} items are not supported (message, "
                                                 f"function_call, function_call_output, "
                                                 f"reasoning)")
    return out


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ProtocolError(f"tools[{i}].type", f"only function tools are supported, got "
                                                    f"{t.get('type')!r}")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ProtocolError("tool_choice", "must be none, auto, required or "
                                               "{\"type\": \"function\", \"name\": ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: TextParam | None) -> dict | None:
    fmt = None if text is None else text.format
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_body(req: ResponsesRequest, messages: list[dict],
              previous: tuple[dict, ...] = ()) -> dict:
    """The chat-completions body of `req` (`messages`: its input as chat messages,
    `input_messages`; `previous`: the stored conversation it continues)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {"model": req.model, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream,
            "messages": system + list(previous) + messages,
            "max_completion_tokens": req.max_output_tokens,
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
            "response_format": _response_format(req.text),
            "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
            **{k: getattr(req, k) for k in SAMPLING_EXTRAS}}
    return {k: v for k, v in body.items() if v is not None}


def echo(req: ResponsesRequest) -> dict:
    """The request's fields that the response object repeats."""
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": (req.reasoning.model_dump() if req.reasoning is not None
                          else {"effort": None, "summary": None}),
            "temperature": req.temperature, "top_p": req.top_p,
            "text": ({"format": req.text.format or {"type": "text"}} if req.text is not None
                     else {"format": {"type": "text"}}),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user,
            "store": req.store is not False, "background": bool(req.background)}


def input_items(req: ResponsesRequest, new_id) -> tuple[dict, ...]:
    """The request's input as `input_items` lists it: items with ids (`new_id(prefix)`), a
    message's string content as one text part."""
    raw = req.input if isinstance(req.input, list) else [
        {"type": "message", "role": "user", "content": req.input}]
    out = []
    for item in raw:
        item = {"id": item.get("id") or new_id("msg"), **item}
        if item.get("type", "message") == "message":
            content = item.get("content")
            if isinstance(content, str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                content = [{"type": kind, "text": content}]
            item = {**item, "type": "message", "status": "completed", "content": content}
        out.append(item)
    return tuple(out)

