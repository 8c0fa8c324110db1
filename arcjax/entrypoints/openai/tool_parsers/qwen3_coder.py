"""The `qwen3_coder` tool-call format (Qwen3-Coder, vLLM's Qwen3CoderToolParser): content,
then XML-like calls whose parameter values are raw text,

  <tool_call>
  <function=get_weather>
  <parameter=city>
  Paris
  </parameter>
  <parameter=days>
  3
  </parameter>
  </function>
  </tool_call>

A value loses one leading and one trailing newline and is typed by the function's
parameter schema (integer, number, boolean, object, array, null; strings as written; a
parameter the schema does not know is read as JSON when it is JSON). A call is complete at
its `</function>`."""

from __future__ import annotations

import json
import re

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolCall,
                                                                         ToolParser,
                                                                         held_prefix)

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)


def _typed(raw: str, schema: dict):
    """A parameter's raw text as the value its schema's type says."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    text = raw.strip()
    if "string" in kinds:
        return raw
    if text.lower() == "null" and ("null" in kinds or kind is None):
        return None
    try:
        if "integer" in kinds:
            return int(text)
        if "number" in kinds:
            value = float(text)
            return int(value) if value.is_integer() and "." not in text else value
        if "boolean" in kinds:
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        return json.loads(text)  # object, array, or a parameter the schema does not type
    except (ValueError, json.JSONDecodeError):
        return raw


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=...><parameter=...>` calls (see the module docstring)."""

    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    template_markers = ("<function=",)
    markers = (START, END)

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            keep = len(text) if final else len(text) - held_prefix(text, self.START)
            return Parsed(text[:keep])
        calls = []
        for m in _FUNCTION.finditer(text, first):
            calls.append(self._call(m.group(1).strip(), m.group(2)))
        if final and not calls:  # no complete call: the output is content, as written
            return Parsed(text)
        content = text[:first]
        return Parsed(content if content.strip() or not calls else None, tuple(calls))

    def _call(self, name: str, body: str) -> ToolCall:
        schema = self.parameter_schema(name)
        args = {}
        for p in _PARAMETER.finditer(body):
            raw = p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = p.group(1).strip()
            args[key] = _typed(raw, schema.get(key) or {})
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
