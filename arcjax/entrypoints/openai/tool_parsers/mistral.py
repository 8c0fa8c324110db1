"""The `mistral` tool-call format (vLLM's MistralToolParser): content, then the special
token `[TOOL_CALLS]` and the calls, either as one JSON array (tokenizers before v11)

  [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or one `[TOOL_CALLS]` per call, the name before `[ARGS]` (v11+; v13 adds `[CALL_ID]id`):

  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

A call is complete once its JSON is. Call ids are 9 letters and digits (Mistral's chat
templates refuse others when the conversation comes back)."""

from __future__ import annotations

import json
import random
import string

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolCall,
                                                                         ToolParser,
                                                                         call_from_json,
                                                                         held_prefix,
                                                                         json_arguments)

_DECODER = json.JSONDecoder()
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` calls (see the module docstring)."""

    name = "mistral"
    TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    template_markers = (TOOL_CALLS,)
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def new_call_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.TOOL_CALLS)
        if first < 0:
            keep = len(text) if final else len(text) - held_prefix(text, self.TOOL_CALLS)
            return Parsed(text[:keep])
        content = text[:first] if text[:first].strip() else None
        rest = text[first + len(self.TOOL_CALLS):].lstrip()
        if rest[:1] in ("[", "{"):
            calls = self._json_calls(rest, final)
        elif not rest and not final:
            calls = []
        else:
            calls = self._named_calls(text[first:], final)
        if calls is None:  # not calls after all: the whole output is content
            return Parsed(text) if final else Parsed(content)
        if final and not calls:
            return Parsed(text)
        return Parsed(content, tuple(calls))

    def _json_calls(self, rest: str, final: bool) -> list[ToolCall] | None:
        try:
            obj, _ = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return None if final else []
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from_json(item) for item in items]
        return None if None in calls else calls

    def _named_calls(self, text: str, final: bool) -> list[ToolCall] | None:
        calls = []
        segments = text.split(self.TOOL_CALLS)[1:]
        for i, seg in enumerate(segments):
            last = i == len(segments) - 1
            name, sep, args = seg.partition(self.ARGS)
            if not sep:
                if last and not final:  # the name is still being written
                    break
                return None
            name = name.split(self.CALL_ID)[0].strip()
            try:
                obj, end = _DECODER.raw_decode(args.lstrip())
            except json.JSONDecodeError:
                if last and not final:
                    break
                return None
            arguments = json_arguments(obj)
            if not name or arguments is None:
                return None
            calls.append(ToolCall(name, arguments))
        return calls
