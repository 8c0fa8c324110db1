"""A chat template that renders tools, tool calls and tool results (Hermes-style
`<tool_call>` tags), and a function tool with an enum-constrained schema: shared by the
tool-calling serving tests (tests/test_structured_serve.py, tests/test_serve_responses.py)."""

from __future__ import annotations

TEMPLATE = (
    "{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}tool: <tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}assistant:"
    "{%- for tc in m.tool_calls %}<tool_call>"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "</tool_call>{%- endfor %}\n"
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
