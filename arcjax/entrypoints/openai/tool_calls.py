"""OpenAI tool calling: the request's `tools` and `tool_choice` -> what to generate, and the
generated text -> `tool_calls` (whole, or as streamed deltas).

`plan_tools(tools, tool_choice, parallel_tool_calls, parser)` validates the tool
definitions and returns a `ToolPlan`:
  "none"      the output is content; the tools are still shown to the chat template
              (vLLM's default).
  "auto"      unconstrained; the model's own format is parsed (`tool_parsers/`).
  "required"  constrained to a JSON array of one or more {"name", "parameters"} calls of
              the offered functions (at most one with `parallel_tool_calls: false`).
  named       (`{"type": "function", "function": {"name": N}}`) constrained to N's
              parameters; the whole output is N's arguments.
`plan.parser` reads the completion in every mode (one interface, `ToolParser`),
and `ToolCallStream` turns a growing completion into OpenAI `delta.tool_calls` chunks.
`template_messages` prepares a conversation with `tool_calls` and `role: "tool"` messages
for a chat template (arguments as objects, as Hugging Face templates expect them).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from arcjax.entrypoints.openai.protocol import ToolParam
from arcjax.entrypoints.openai.tool_parsers import get_parser
from arcjax.errors import RequestError
from arcjax.sampling_params import StructuredOutputsParams
from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolCall,
                                                                         ToolParser)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolsError(RequestError):
    """A `tools` / `tool_choice` / tool-message value the server refuses (names the field)."""


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict
    definition: dict  # the request's tool object, as given (for the chat template)


class RequiredCallsParser(ToolParser):
    """Reads the output of `tool_choice: "required"`: a JSON array of {"name",
    "parameters"}; each element is a call once it is complete."""

    _DECODER = json.JSONDecoder()

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.strip()
        calls, pos = [], 1
        if not body.startswith("["):
            return Parsed(text if final else None)
        while True:
            while pos < len(body) and body[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(body) or body[pos] == "]":
                break
            try:
                obj, pos = self._DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return Parsed(text if final else None, tuple(calls))
            calls.append(ToolCall(obj["name"], json.dumps(obj.get("parameters", {}),
                                                          ensure_ascii=False)))
        if final and not calls:
            return Parsed(text)
        return Parsed(None, tuple(calls))


class NamedCallParser(ToolParser):
    """Reads the output of a named `tool_choice`: the whole text is the function's
    arguments (streamed as they grow)."""

    streams_arguments = True

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def parse(self, text: str, final: bool = True) -> Parsed:
        return Parsed(None, (ToolCall(self.function, text),))


class ContentParser(ToolParser):
    """`tool_choice: "none"` (or no tools): everything is content."""

    def parse(self, text: str, final: bool = True) -> Parsed:
        return Parsed(text)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape generation and the response.

    Attributes:
      mode: "none" | "auto" | "required" | "named".
      tools: the request's tool objects as dicts (passed to the chat template), or None.
      constraint: what the output must match ("required", named), else None.
      parser: reads the completion: `.parse(text, final) -> Parsed`.
    """

    mode: str
    tools: tuple[dict, ...] | None
    constraint: StructuredOutputsParams | None
    parser: ToolParser
    single: bool = False  # parallel_tool_calls false with "auto": the first call only

    def calls_of(self, calls: Sequence[ToolCall]) -> tuple[ToolCall, ...]:
        """The calls the response carries (the first only, with `single`)."""
        return tuple(calls[:1]) if self.single else tuple(calls)

    def finish_reason(self, reason: str | None, calls: Sequence[ToolCall]) -> str | None:
        """OpenAI's finish reason: "tool_calls" when the model chose to call ("auto" with
        calls, "required" completed), the engine's otherwise (a named call ends "stop")."""
        if reason == "stop" and calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def _check_tools(tools: Sequence[ToolParam]) -> list[Tool]:
    """The offered functions (their shapes are the request model's checks)."""
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.function
        if fn.name in seen:
            raise ToolsError(f"tools[{i}].function.name", f"{fn.name!r} is offered twice")
        seen.add(fn.name)
        definition = {"type": "function", **t.model_dump(exclude_unset=True)}
        out.append(Tool(fn.name, fn.parameters if fn.parameters is not None
                        else _EMPTY_PARAMETERS, definition))
    return out


def _required_schema(tools: list[Tool], parallel: bool) -> dict:
    """A JSON array of one or more calls of the offered functions; `$defs` of the
    functions' schemas move to the root, where their `$ref`s point."""
    defs, items = {}, []
    for t in tools:
        params = dict(t.parameters)
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(f"{key}/{name}", sub) != sub:
                    raise ToolsError("tools", f"two functions define {key} {name!r} "
                                              f"differently")
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.name]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    for path, sub in defs.items():
        key, name = path.split("/", 1)
        schema.setdefault(key, {})[name] = sub
    return schema


def plan_tools(tools: Sequence[ToolParam] | None, tool_choice, parallel_tool_calls=None,
               parser: str | None = None) -> ToolPlan:
    """Validates a chat request's tool fields. Returns its `ToolPlan`.

    Args:
      tools: the request's `tools` (`protocol.ToolParam`s; None: none offered).
      tool_choice: None (= "auto" with tools, "none" without), "none", "auto", "required",
        or {"type": "function", "function": {"name": N}}.
      parallel_tool_calls: None or bool; False allows at most one call ("required").
      parser: the server's tool-call parser name (`tool_parsers.PARSERS`), needed for
        "auto"; None = the server parses no calls ("auto" is refused).

    Raises:
      ToolsError (a RequestError naming the field).
    """
    offered = _check_tools(tools) if tools is not None else []
    defs = tuple(t.definition for t in offered) or None
    if tool_choice is None:
        tool_choice = "auto" if offered else "none"
    if tool_choice == "none":
        return ToolPlan("none", defs, None, ContentParser())
    if not offered:
        raise ToolsError("tool_choice", f"{tool_choice!r} needs a non-empty tools list")
    if tool_choice == "auto":
        if parser is None:
            raise ToolsError("tool_choice", "\"auto\" needs a tool-call parser: start the "
                                            "server with --tool-call-parser")
        return ToolPlan("auto", defs, None, get_parser(parser, defs),
                        single=parallel_tool_calls is False)
    if tool_choice == "required":
        schema = _required_schema(offered, parallel_tool_calls is not False)
        return ToolPlan("required", defs, StructuredOutputsParams(json=schema),
                        RequiredCallsParser())
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        tool = next((t for t in offered if t.name == name), None)
        if tool is None:
            raise ToolsError("tool_choice", f"names {name!r}, which is not in tools "
                                            f"({[t.name for t in offered]})")
        return ToolPlan("named", defs, StructuredOutputsParams(json=tool.parameters),
                        NamedCallParser(tool.name))
    raise ToolsError("tool_choice", f"must be \"none\", \"auto\", \"required\" or "
                                    f"{{\"type\": \"function\", \"function\": {{\"name\": "
                                    f"...}}}}, got {tool_choice!r}")


def tool_calls_json(calls: Sequence[ToolCall], parser: ToolParser) -> list[dict]:
    """`message.tool_calls` in OpenAI's shape (fresh ids in the parser's format)."""
    return [{"id": parser.new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class ToolCallStream:
    """One streamed choice: `update(text, final)` -> (content new since the last update,
    `delta.tool_calls` items new since then, in OpenAI's shape: a call's first item has
    its id, type and name; a parser that streams arguments sends later fragments as
    {"index", "function": {"arguments"}})."""

    def __init__(self, parser):
        self.parser = parser
        self.content_len = 0
        self.sent: list[tuple[str, int]] = []  # per call: (id, arguments chars sent)

    def update(self, text: str, final: bool) -> tuple[str, list[dict], list[ToolCall]]:
        """Returns (content delta, tool-call delta items, every call so far)."""
        parsed = self.parser.parse(text, final)
        content = parsed.content or ""
        new_text = content[self.content_len:]
        self.content_len = max(self.content_len, len(content))
        items = []
        for i, call in enumerate(parsed.calls):
            if i >= len(self.sent):
                call_id = self.parser.new_call_id()
                self.sent.append((call_id, len(call.arguments)))
                items.append({"index": i, "id": call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent[i][1]:
                call_id, sent = self.sent[i]
                self.sent[i] = (call_id, len(call.arguments))
                items.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
        return new_text, items, list(parsed.calls)


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Chat messages for a template: an assistant's `tool_calls` checked and their
    arguments decoded to objects (Hugging Face templates print them with `tojson`);
    `role: "tool"` messages pass as they are (content already a string).

    Raises:
      ToolsError naming the message field.
    """
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            out.append(m)
            continue
        where = f"messages[{i}].tool_calls"
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise ToolsError(where, "only an assistant message has tool_calls (a list)")
        fixed = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolsError(f"{where}[{j}]", "must be {\"type\": \"function\", "
                                                  "\"function\": {\"name\", \"arguments\"}}")
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as e:
                    raise ToolsError(f"{where}[{j}].function.arguments",
                                     f"is not valid JSON ({e})") from None
            fixed.append({**c, "function": {**fn, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out
