"""The `hermes` tool-call format (Hermes 2 Pro, Qwen 2.5 / Qwen 3 chat templates):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number, after
optional content. A block that is not a call as JSON makes the whole completion content,
as written."""

from __future__ import annotations

import json
import re

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolParser,
                                                                         call_from_json,
                                                                         held_prefix)


class HermesToolParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    template_markers = (START,)
    markers = (START, END)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.START)
        if first < 0:  # no call (yet): hold back what may be the start of a tag
            keep = len(text) if final else len(text) - held_prefix(text, self.START)
            return Parsed(text[:keep])
        calls = []
        blocks = [m.group(1) for m in self._BLOCK.finditer(text, first)]
        tail = text.rfind(self.START)
        if final and text.find(self.END, tail) < 0:  # an unclosed last block (cut short)
            blocks.append(text[tail + len(self.START):])
        for body in blocks:
            try:
                call = call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: the whole text is content
                return Parsed(text if final else text[:first])
            calls.append(call)
        content = text[:first]
        return Parsed(content if content.strip() or not calls else None, tuple(calls))
