"""Parsers of the tool calls a model writes in its own format (`tool_choice: "auto"`).

A parser reads a completion's text and splits it into content (text for the user) and
complete tool calls. `parse(text, final)` is monotone in `text` for well-formed output:
as text grows, the content it returns only grows and calls are only appended, so a
stream emits the difference after every output (`tools.ToolCallStream`) and a whole
response parses once.
Text that may still become a call (an unfinished `<tool_call>` tag, a JSON object being
written) is held back until it is decided.

Formats (the server's `--tool-call-parser`, vLLM's names):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
               after optional content (Hermes 2 Pro, Qwen 2.5 / Qwen 3 chat templates).
  llama3_json  a completion that starts with `{` (or `<|python_tag|>`) is one or more
               `{"name": ..., "parameters": {...}}` objects separated by `;` (Llama 3.1+
               JSON tool calling); anything else is content.
A completion whose calls do not parse as JSON is content, as written.
"""

from __future__ import annotations

import dataclasses
import json
import re

from arcjax.errors import RequestError


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a completion's text holds so far: content to show (None: none at all) and
    complete calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def _call(obj, args_keys=("arguments",)) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., "arguments": {...}} object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser:
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.START)
        if first < 0:  # no call (yet): hold back what may be the start of a tag
            keep = len(text) if final else len(text) - _held_prefix(text, self.START)
            return Parsed(text[:keep])
        calls = []
        blocks = [m.group(1) for m in self._BLOCK.finditer(text, first)]
        tail = text.rfind(self.START)
        if final and text.find(self.END, tail) < 0:  # an unclosed last block (cut short)
            blocks.append(text[tail + len(self.START):])
        for body in blocks:
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: the whole text is content
                return Parsed(text if final else text[:first])
            calls.append(call)
        content = text[:first]
        return Parsed(content if content.strip() or not calls else None, tuple(calls))


class Llama3JsonToolParser:
    """Llama 3 JSON tool calls: `{"name": ..., "parameters": {...}}` objects joined by `;`."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    _DECODER = json.JSONDecoder()

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        elif not body or self.PYTHON_TAG.startswith(body):
            return Parsed(text if final else None)  # undecided until more text comes
        if not body.startswith("{"):
            return Parsed(text)
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = self._DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:  # unfinished (or not JSON: decided at the end)
                return Parsed(text, ()) if final else Parsed(None, tuple(calls))
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, ()) if final else Parsed(None, tuple(calls))
            calls.append(call)
            pos = end
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:  # something else after a call: not this format
                return Parsed(text, ()) if final else Parsed(None, tuple(calls))
            pos = len(body) - len(rest)
        return Parsed(None, tuple(calls))


PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def guess_parser(template: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, or None if it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return None


def get_parser(name: str):
    """The parser registered as `name`.

    Raises:
      RequestError (field "tool_call_parser"): no such parser.
    """
    cls = PARSERS.get(name)
    if cls is None:
        raise RequestError("tool_call_parser", f"unknown tool-call parser {name!r}; known: "
                                               f"{sorted(PARSERS)}")
    return cls()
