"""The `deepseek_v3` tool-call format (DeepSeek-V3 / R1-0528, vLLM's DeepSeekV3ToolParser):
content, then calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each

  <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
  ```json
  {"city": "Paris"}
  ```<｜tool▁call▁end｜>

(DeepSeek-V3.1 writes `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>`: read too). A call is complete at its `<｜tool▁call▁end｜>`."""

from __future__ import annotations

import json
import re

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolCall,
                                                                         ToolParser,
                                                                         held_prefix,
                                                                         json_arguments)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)"
                   + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"^\s*([^\n]*?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.DOTALL)


def _call(head: str, body: str) -> ToolCall | None:
    fenced = _FENCED.match(body)
    if fenced:  # V3: the type before the separator, the name and a ```json block after it
        name, args = fenced.group(1), fenced.group(2)
    else:  # V3.1: the name before the separator, the JSON after it
        name, args = head, body
    try:
        arguments = json_arguments(json.loads(args))
    except json.JSONDecodeError:
        return None
    name = name.strip()
    return ToolCall(name, arguments) if name and arguments is not None else None


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek's `<｜tool▁call▁begin｜>` calls (see the module docstring)."""

    name = "deepseek_v3"
    template_markers = (CALLS_BEGIN,)
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(CALLS_BEGIN)
        if first < 0:
            keep = len(text) if final else len(text) - held_prefix(text, CALLS_BEGIN)
            return Parsed(text[:keep])
        calls = [_call(m.group(1), m.group(2)) for m in _CALL.finditer(text, first)]
        if None in calls or (final and not calls):  # not calls after all: content
            return Parsed(text) if final else Parsed(text[:first] or None)
        content = text[:first]
        return Parsed(content if content.strip() or not calls else None, tuple(calls))
