"""The `llama3_json` tool-call format (Llama 3.1+ JSON tool calling): a completion that
starts with `{` (or `<|python_tag|>`) is one or more `{"name": ..., "parameters": {...}}`
objects separated by `;`; anything else is content. Calls that do not parse as JSON make
the completion content, as written."""

from __future__ import annotations

import json

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolParser,
                                                                         call_from_json)


class Llama3JsonToolParser(ToolParser):
    """Llama 3 JSON tool calls: `{"name": ..., "parameters": {...}}` objects joined by `;`."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    template_markers = (PYTHON_TAG, "<|eom_id|>")
    markers = (PYTHON_TAG,)
    _DECODER = json.JSONDecoder()

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
            if not body and not final:
                return Parsed(None)  # the tag: a call comes next
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
            call = call_from_json(obj, ("parameters", "arguments"))
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
