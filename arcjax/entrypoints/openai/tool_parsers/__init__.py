"""The tool-call formats models write (`tool_choice: "auto"`): a registry, one module each.

`PARSERS` maps the server's `--tool-call-parser` values (vLLM's names) to the classes;
`get_parser(name)` builds one; `guess_parser(chat_template)` names the format a chat
template shows (the first in `PARSERS` whose `template_markers` it contains). Every format
implements `abstract_tool_parser.ToolParser`: `parse(text, final) -> Parsed(content,
calls)`, monotone in the text (see that module).

Formats:
  hermes       (`hermes.py`) `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
               blocks after optional content (Hermes 2 Pro, Qwen 2.5 / Qwen 3).
  llama3_json  (`llama3_json.py`) `{"name": ..., "parameters": {...}}` objects joined by
               `;`, optionally after `<|python_tag|>` (Llama 3.1+).

A new format is a module here with a `ToolParser` subclass, and one entry in `PARSERS`
(its place there is its priority for `guess_parser`).
"""

from __future__ import annotations

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from arcjax.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from arcjax.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from arcjax.errors import RequestError

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def guess_parser(template: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, or None if it shows none."""
    if not template:
        return None
    return next((name for name, cls in PARSERS.items()
                 if any(marker in template for marker in cls.template_markers)), None)


def get_parser(name: str) -> ToolParser:
    """The parser registered as `name`.

    Raises:
      RequestError (field "tool_call_parser"): no such parser.
    """
    cls = PARSERS.get(name)
    if cls is None:
        raise RequestError("tool_call_parser", f"unknown tool-call parser {name!r}; known: "
                                               f"{sorted(PARSERS)}")
    return cls()
