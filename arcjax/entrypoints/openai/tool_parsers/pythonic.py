"""The `pythonic` tool-call format (Llama 3.2 / Llama 4, vLLM's PythonicToolParser): the
whole output is a Python list of calls with keyword arguments that are literals,

  [get_weather(city="Paris", unit="celsius"), get_time()]

optionally between `<|python_start|>` and `<|python_end|>` (Llama 4). A call is complete
once the element after it starts (or the list closes); output that is not such a list is
content, as written."""

from __future__ import annotations

import ast
import json

from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (Parsed, ToolCall,
                                                                         ToolParser,
                                                                         held_prefix)

_OPEN, _CLOSE = "([{", ")]}"


def _elements(body: str) -> tuple[list[str], bool, bool]:
    """The complete top-level elements of the list `body` (which starts with "["), whether
    the list is closed, and whether the scan went wrong (unbalanced brackets)."""
    out, depth, quote, start, i = [], 0, None, 1, 1
    while i < len(body):
        ch = body[i]
        if quote:
            if ch == "\\":
                i += 1
            elif body.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif ch in "'\"":
            quote = ch * 3 if body.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            if depth == 0:
                if ch != "]":
                    return out, False, True
                if body[start:i].strip():
                    out.append(body[start:i])
                return out, body[i + 1:].strip() == "", body[i + 1:].strip() != ""
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(body[start:i])
            start = i + 1
        i += 1
    return out, False, False


def _call(source: str) -> ToolCall | None:
    """A ToolCall from one element's source (`name(key=literal, ...)`), else None."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name,
                                                                                 ast.Attribute)):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except ValueError:
        return None
    if None in args:  # a **kwargs splat
        return None
    try:
        return ToolCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False))
    except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
        return None


class PythonicToolParser(ToolParser):
    """A Python list of calls (see the module docstring)."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    template_markers = (START,)
    markers = (START, END)

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START):].strip()
            if not body and not final:
                return Parsed(None)  # the tag: the list comes next
        elif not body or self.START.startswith(body):
            return Parsed(text if final else None)
        if body.endswith(self.END):
            body = body[:-len(self.END)].rstrip()
        elif not final:  # the end tag may be on its way
            body = body[:len(body) - held_prefix(body, self.END)].rstrip()
        if not body.startswith("["):
            return Parsed(text)
        elements, closed, broken = _elements(body)
        if final and not closed and not broken:  # cut short right before the "]"
            elements, closed, broken = _elements(body + "]")
        calls = [_call(e) for e in elements]
        if broken or None in calls or (final and not (closed and calls)):
            return Parsed(text)  # not a list of calls: content, as written
        return Parsed(None, tuple(calls))
