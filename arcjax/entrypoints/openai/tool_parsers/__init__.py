"""The tool-call formats models write (`tool_choice: "auto"`): a registry, one module each.

`PARSERS` maps the server's `--tool-call-parser` values (vLLM's names) to the classes;
`get_parser(name, tools)` builds one for a request; `guess_parser(chat_template)` names the
format a chat template shows (the first in `PARSERS` whose `template_markers` it
contains). Every format implements `abstract_tool_parser.ToolParser`: `parse(text, final)
-> Parsed(content, calls)`, monotone in the text (see that module).

Formats:
  qwen3_coder  (`qwen3_coder.py`) `<tool_call><function=NAME><parameter=KEY>value...`
               (Qwen3-Coder; values typed by the function's schema).
  hermes       (`hermes.py`) `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
               blocks after optional content (Hermes 2 Pro, Qwen 2.5 / Qwen 3).
  mistral      (`mistral.py`) `[TOOL_CALLS]` then a JSON array, or `NAME[ARGS]{...}` per
               call (Mistral, by tokenizer version).
  deepseek_v3  (`deepseek_v3.py`) `<｜tool▁calls▁begin｜>` ... (DeepSeek-V3, -V3.1).
  openai       (`openai_tool_parser.py`) harmony commentary to `functions.NAME` (gpt-oss).
  llama3_json  (`llama3_json.py`) `{"name": ..., "parameters": {...}}` objects joined by
               `;`, optionally after `<|python_tag|>` (Llama 3.1+).
  pythonic     (`pythonic.py`) `[name(key=literal, ...), ...]` (Llama 3.2 / 4).

A new format is a module here with a `ToolParser` subclass, and one entry in `PARSERS`
(its place there is its priority for `guess_parser`: Qwen3-Coder's templates show
`<tool_call>` too, so it comes before hermes).
"""

from __future__ import annotations

from collections.abc import Sequence

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from arcjax.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from arcjax.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from arcjax.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from arcjax.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from arcjax.entrypoints.openai.tool_parsers.openai_tool_parser import OpenAIToolParser
from arcjax.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from arcjax.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from arcjax.errors import RequestError

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Qwen3CoderToolParser, HermesToolParser, MistralToolParser,
                        DeepSeekV3ToolParser, OpenAIToolParser, Llama3JsonToolParser,
                        PythonicToolParser)}


def guess_parser(template: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, or None if it shows none."""
    if not template:
        return None
    return next((name for name, cls in PARSERS.items()
                 if any(marker in template for marker in cls.template_markers)), None)


def get_parser(name: str, tools: Sequence[dict] | None = None) -> ToolParser:
    """The parser registered as `name`, for a request offering `tools`.

    Raises:
      RequestError (field "tool_call_parser"): no such parser.
    """
    cls = PARSERS.get(name)
    if cls is None:
        raise RequestError("tool_call_parser", f"unknown tool-call parser {name!r}; known: "
                                               f"{sorted(PARSERS)}")
    return cls(tools)
