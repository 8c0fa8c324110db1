"""The `openai` tool-call format: gpt-oss's harmony messages (`arcjax.reasoning.harmony`).
A call is a commentary message to `functions.NAME` whose body is the JSON arguments,

  <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
  {"city": "Paris"}<|call|>

complete at its `<|call|>` (or when the output ends). The content is the final channel's
text (and commentary without a recipient); analysis is reasoning, left to the reasoning
parser (`openai_gptoss`). Reads the whole output, with its special tokens."""

from __future__ import annotations

import json

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolCall,
                                                                         ToolParser,
                                                                         json_arguments)
from arcjax.reasoning import harmony

FUNCTIONS = "functions."


class OpenAIToolParser(ToolParser):
    """gpt-oss tool calls (see the module docstring)."""

    name = "openai"
    template_markers = ("<|channel|>",)
    markers = harmony.SPECIALS
    reads_whole_output = True

    def parse(self, text: str, final: bool = True) -> Parsed:
        messages, decided, tail = harmony.parse_messages(text, final)
        content, calls = [], []
        for m in messages:
            body = text[m.body_start:min(m.body_end, decided)]
            if m.is_content:
                content.append(body)
            elif m.recipient and m.recipient.startswith(FUNCTIONS) and m.complete:
                try:
                    arguments = json_arguments(json.loads(body))
                except json.JSONDecodeError:
                    arguments = None
                if arguments is not None:
                    calls.append(ToolCall(m.recipient[len(FUNCTIONS):], arguments))
        if final and tail < len(text):
            content.append(text[tail:])
        joined = "".join(content)
        return Parsed(joined if joined or not calls else None, tuple(calls))
