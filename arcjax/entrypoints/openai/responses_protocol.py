"""The Responses API's request body -> the chat path's request (one copy of the chat logic).

`parse_responses(body, previous)` reads what `POST /v1/responses` adds to chat and turns the
rest into a chat-completions body, which `protocol.parse_chat` then validates as for
`/v1/chat/completions` (sampling fields, tools, structured outputs, messages): the same
template rendering, tool parsing and output processing serve both endpoints.

  input                  a string (one user message) or a list of items: messages
                         ({"role", "content"}: a string or input_text / output_text
                         parts), `function_call` items (an assistant's call:
                         call_id, name, arguments) and `function_call_output` items
                         (the tool's answer: call_id, output); `reasoning` items are
                         accepted and left out of the prompt
  instructions           a system message before the input (not carried over by
                         previous_response_id, as OpenAI)
  previous_response_id   the stored conversation it continues (its input and output)
  max_output_tokens      max_completion_tokens
  tools                  function tools {"type": "function", "name", "description",
                         "parameters", "strict"}
  tool_choice            "none" | "auto" | "required" | {"type": "function", "name"}
  text.format            {"type": "text" | "json_object"} or {"type": "json_schema",
                         "name", "schema", "strict"}: response_format
  reasoning              {"effort", "summary"}: accepted (no reasoning items yet)
  store, background, metadata, stream, temperature, top_p, parallel_tool_calls, user,
  truncation ("disabled"), include: as OpenAI's; vLLM's sampling extras (top_k, min_p,
  seed, stop, ignore_eos, the penalties, min_tokens) go to the chat request as they are;
  unknown fields are ignored and listed.

Errors name the Responses field: a chat field in an error (`messages[3].content`,
`max_completion_tokens`, `response_format...`, `tools[0].function.name`) is renamed
(`input`, `max_output_tokens`, `text.format...`, `tools[0].name`).
"""

from __future__ import annotations

import dataclasses
import re

from arcjax.entrypoints.openai.protocol import ProtocolError
from arcjax.errors import InputError

# Responses fields -> what the chat body gets
_PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p",
           "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "min_tokens")
_OWN = {"input", "instructions", "previous_response_id", "max_output_tokens", "tools",
        "tool_choice", "text", "reasoning", "store", "background", "metadata", "user",
        "truncation", "include", "stream_options", *_PASSED}
_EFFORTS = (None, "minimal", "low", "medium", "high")
_RENAMES = ((re.compile(r"^messages(\[\d+\])?"), "input"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^max_tokens"), "max_output_tokens"),
            (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
            (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1"))


@dataclasses.dataclass(frozen=True)
class ParsedResponses:
    """What a Responses request asks for, beside the chat request it becomes.

    Attributes:
      chat_body: the chat-completions body (messages: previous conversation, instructions,
        input), for `protocol.parse_chat`.
      messages: the conversation this request adds to the previous one (its input as
        chat messages, without instructions): stored with the response.
      input_items: the request's input items, as given (with ids added).
      echo: the request's fields the response object repeats (instructions, tools,
        tool_choice, text, ...).
      store, background, stream: as asked.
      previous_response_id: the conversation continued, or None.
      ignored: unknown fields (sorted).
    """

    chat_body: dict
    messages: tuple[dict, ...]
    input_items: tuple[dict, ...]
    echo: dict
    store: bool
    background: bool
    stream: bool
    previous_response_id: str | None
    ignored: tuple[str, ...]


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
        if not isinstance(part, dict) or part.get("type") not in (
                "input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ProtocolError(f"{where}[{j}]", "only input_text and output_text parts are "
                                                 "supported")
        parts.append(part["text"])
    return "\n".join(parts)


def input_messages(raw) -> list[dict]:
    """The request's `input` as chat messages (see the module docstring). Consecutive
    function calls join one assistant message (after its text, if any)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ProtocolError("input", "must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(where, "must be an object")
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
                                                 f"function_call, function_call_output)")
    return out


def _chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("tools", "must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ProtocolError(f"tools[{i}].type", "only function tools are supported")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ProtocolError("tool_choice", "must be none, auto, required or "
                                               "{\"type\": \"function\", \"name\": ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ProtocolError("text", "must be an object with a format")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ProtocolError("text.format", "must be an object with a type")
    if fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(name, f"must be a boolean, got {value!r}")
    return value


def parse_responses(body, previous: tuple[dict, ...] = ()) -> ParsedResponses:
    """A /v1/responses body (decoded JSON); `previous`: the stored conversation of
    `previous_response_id` (chat messages). Raises InputError naming the field."""
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    if "input" not in body:
        raise ProtocolError("input", "is required")
    messages = input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ProtocolError("instructions", "must be a string")
    prev_id = body.get("previous_response_id")
    if prev_id is not None and not isinstance(prev_id, str):
        raise ProtocolError("previous_response_id", "must be a string")
    store, background = _flag(body, "store", True), _flag(body, "background", False)
    stream = _flag(body, "stream", False)
    if background and not store:
        raise ProtocolError("background", "a background response must be stored (store: true)")
    if background and stream:
        raise ProtocolError("background", "streaming a background response is not supported")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict)
                                  or reasoning.get("effort") not in _EFFORTS):
        raise ProtocolError("reasoning.effort", f"must be one of {_EFFORTS[1:]}")
    if body.get("truncation") not in (None, "disabled"):
        raise ProtocolError("truncation", "only \"disabled\" is supported")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ProtocolError("metadata", "must be an object of string values")
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat.update(messages=system + list(previous) + messages,
                max_completion_tokens=body.get("max_output_tokens"),
                tools=_chat_tools(body.get("tools")),
                tool_choice=_chat_tool_choice(body.get("tool_choice")),
                response_format=_response_format(body.get("text")))
    chat = {k: v for k, v in chat.items() if v is not None}
    items = body["input"] if isinstance(body["input"], list) else [
        {"type": "message", "role": "user", "content": body["input"]}]
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {}, "parallel_tool_calls": body.get("parallel_tool_calls",
                                                                         True),
            "previous_response_id": prev_id, "reasoning": reasoning or {"effort": None},
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": "disabled", "user": body.get("user"), "store": store,
            "background": background}
    ignored = tuple(sorted(n for n in body if n not in _OWN))
    return ParsedResponses(chat, tuple(messages), tuple(items), echo, store, background,
                           stream, prev_id, ignored)
