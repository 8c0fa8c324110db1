"""A chat choice's output read as reasoning, content and tool calls, whole or streamed.

The engine splits each completion into `reasoning` and `content` (`arcjax.reasoning`, the
engine's reasoning parser); the request's tool plan (`tool_calls.ToolPlan`) reads tool
calls out of the content (or, for a format that keeps its own channels, such as harmony,
out of the whole text). One function per use, so any endpoint (chat completions, a
Responses API) gets the same reading:

  `read_output(completion, tools)` -> `ChatOutput(reasoning, content, calls)` for a whole
      completion (FINAL_ONLY outputs);
  `ChatOutputStream(tools).update(delta)` -> `ChatDelta` for each streamed delta (DELTA
      outputs): the reasoning and content new since the last one and the tool-call
      items OpenAI streams (`tool_calls.ToolCallStream`).
Both read the same text the same way (the parsers are monotone), so a stream adds up to
the whole response at every split point.
"""

from __future__ import annotations

import dataclasses

from arcjax.entrypoints.openai.response_logprobs import ChoiceDelta
from arcjax.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan
from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolCall
from arcjax.outputs import CompletionOutput


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """A whole choice: its reasoning (None: none), content (None: none) and tool calls."""

    reasoning: str | None
    content: str | None
    calls: tuple[ToolCall, ...] = ()


def _uses_tools(tools: ToolPlan | None) -> bool:
    return tools is not None and tools.mode != "none"


def read_output(c: CompletionOutput, tools: ToolPlan | None) -> ChatOutput:
    """A whole completion as reasoning, content and the calls the plan reads."""
    split = c.reasoning is not None or c.content is not None
    answer = c.content if split else c.text
    if not _uses_tools(tools):
        return ChatOutput(c.reasoning, answer)
    parser = tools.parser
    parsed = parser.parse(c.text if parser.reads_whole_output else answer or "", final=True)
    return ChatOutput(c.reasoning, parsed.content, tools.calls_of(parsed.calls))


@dataclasses.dataclass(frozen=True)
class ChatDelta:
    """What a streamed choice has new: reasoning and content text ("" when none),
    `tool_calls` items, and every call read so far (for the finish reason)."""

    reasoning: str
    content: str
    tool_items: tuple[dict, ...]
    calls: tuple[ToolCall, ...]


class ChatOutputStream:
    """One streamed choice read as `read_output` reads a whole one (see the module
    docstring)."""

    def __init__(self, tools: ToolPlan | None):
        self.tools = tools if _uses_tools(tools) else None
        self._calls = ToolCallStream(tools.parser) if self.tools is not None else None
        self._text: list[str] = []  # the tool parser's input so far

    def update(self, d: ChoiceDelta) -> ChatDelta:
        split = d.reasoning is not None or d.content is not None
        answer = d.content if split else d.text
        if self._calls is None:
            return ChatDelta(d.reasoning or "", answer or "", (), ())
        whole = self.tools.parser.reads_whole_output
        self._text.append(d.text if whole else answer or "")
        content, items, calls = self._calls.update("".join(self._text),
                                                   d.finish_reason is not None)
        calls = self.tools.calls_of(calls)
        items = [item for item in items if item["index"] < len(calls)]
        return ChatDelta(d.reasoning or "", content, tuple(items), tuple(calls))
