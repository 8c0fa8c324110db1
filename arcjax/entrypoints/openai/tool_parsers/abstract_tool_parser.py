"""What every tool-call format implements (`ToolParser`) and returns (`Parsed`, `ToolCall`).

A parser reads a completion's text and splits it into content (text for the user) and
complete tool calls. `parse(text, final)` is monotone in `text` for well-formed output:
as text grows, the content it returns only grows and calls are only appended, so a
stream emits the difference after every output (`tool_calls.ToolCallStream`) and a whole
response parses once. Text that may still become a call (an unfinished `<tool_call>` tag,
a JSON object being written) is held back until it is decided (`held_prefix`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import ClassVar


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


class ToolParser(abc.ABC):
    """Reads a completion into content and tool calls (see the module docstring).

    A format in the registry (`tool_parsers.PARSERS`) also names itself and the text its
    chat templates show, so the server can pick it from the template.

    Args:
      tools: the request's tool definitions (dicts, OpenAI's shape), for formats whose
        arguments are typed by the functions' schemas; None: none given.

    Attributes:
      name: the `--tool-call-parser` value (vLLM's name for the format).
      template_markers: text that a chat template using this format contains.
      markers: the format's marker texts (the server keeps special tokens in the output
        when one of them is a special token of the model's vocabulary).
      reads_whole_output: the parser reads the whole output, reasoning included (harmony
        keeps its channels apart itself); otherwise it reads the content after it.
    """

    name: ClassVar[str]
    template_markers: ClassVar[tuple[str, ...]] = ()
    markers: ClassVar[tuple[str, ...]] = ()
    reads_whole_output: ClassVar[bool] = False

    def __init__(self, tools: Sequence[dict] | None = None):
        self.tools = tuple(tools or ())

    def new_call_id(self) -> str:
        """A fresh tool-call id (OpenAI's shape)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def parameter_schema(self, function: str) -> dict:
        """The `properties` of `function`'s parameters schema ({} when unknown)."""
        for t in self.tools:
            fn = t.get("function") or {}
            if fn.get("name") == function:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}

    @abc.abstractmethod
    def parse(self, text: str, final: bool = True) -> Parsed:
        """The content and complete calls of `text`; `final`: the completion has ended
        (nothing is held back any more)."""


def json_arguments(args) -> str | None:
    """Arguments (an object, or its JSON text) as JSON text, or None if not an object."""
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def call_from_json(obj, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., "arguments": {...}} object (the arguments
    under the first of `args_keys` present), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = json_arguments(next((obj[k] for k in args_keys if k in obj), {}))
    return None if args is None else ToolCall(obj["name"], args)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text a
    stream holds back: it may be the start of the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
