"""Every tool-call format on recorded outputs (pure Python): the whole parse, and a stream of
the same text cut at every character (`ToolCallStream`, as the server streams
`delta.tool_calls`) adding up to the same content and calls."""

import json

import pytest

from arcjax.entrypoints.openai.tool_calls import ToolCallStream
from arcjax.entrypoints.openai.tool_parsers import PARSERS, get_parser, guess_parser

WEATHER = {"city": "Paris", "days": 3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {}}}]
TWO_CALLS = [("get_weather", WEATHER), ("get_time", {})]
# (parser, recorded output, content, calls)
RECORDED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>{"name": "get_time", '
               '"arguments": {}}</tool_call>', "Let me check.\n", TWO_CALLS),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 3}}; {"name": "get_time", "parameters": {}}', None, TWO_CALLS),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time()]', None, TWO_CALLS),
    ("pythonic", "<|python_start|>[get_weather(city='Paris', days=3)]<|python_end|>", None,
     TWO_CALLS[:1]),
    ("pythonic", "The weather is [unknown] today.", "The weather is [unknown] today.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "get_time", "arguments": {}}]', "Sure.", TWO_CALLS),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]'
                'get_time[CALL_ID]a1b2c3d4e[ARGS]{}', None, TWO_CALLS),
    ("qwen3_coder", "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>"
                    "\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "I will look it up.\n", TWO_CALLS),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>'
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, TWO_CALLS),
    ("deepseek_v3", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Checking.", TWO_CALLS[:1]),  # DeepSeek-V3.1's shape
    ("openai", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               '{"city": "Paris", "days": 3}<|call|>', None, TWO_CALLS[:1]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
               "<|message|>It is 4.<|return|>", "It is 4.", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser, text, cuts):
    """(content, calls) a stream sends when it sees text[:k] for each k in cuts."""
    stream = ToolCallStream(parser)
    content, calls = [], {}
    for k in [*cuts, len(text)]:
        new, items, _ = stream.update(text[:k], k == len(text))
        content.append(new)
        for item in items:
            if "id" in item:
                calls[item["index"]] = [item["function"]["name"], item["function"]["arguments"]]
            else:
                calls[item["index"]][1] += item["function"]["arguments"]
    return "".join(content), [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


@pytest.mark.parametrize("name, text, content, calls", RECORDED)
def test_parse_whole_and_at_every_character(name, text, content, calls):
    parser = get_parser(name, TOOLS)
    parsed = parser.parse(text, final=True)
    assert (parsed.content or None, _calls(parsed.calls)) == (content, calls)
    want = (content or "", calls)
    for cut in range(len(text) + 1):
        assert _stream(get_parser(name, TOOLS), text, [cut]) == want, cut
    assert _stream(get_parser(name, TOOLS), text, range(len(text))) == want


def test_qwen3_coder_types_values_by_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\nseven\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=extra>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
    (call,) = get_parser("qwen3_coder", TOOLS).parse(text).calls
    # a string stays a string; a value that is not of its type is kept as written
    assert json.loads(call.arguments) == {"city": "42", "days": "seven", "metric": True,
                                          "extra": [1, 2]}


def test_mistral_call_ids_and_the_template_guess():
    ids = {get_parser("mistral").new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert guess_parser("{{ '<tool_call>' }}{{ '<function=' }}") == "qwen3_coder"
    assert guess_parser("{{ '<tool_call>' }}") == "hermes"
    assert guess_parser("[TOOL_CALLS]") == "mistral"
    assert guess_parser("{{ bos_token }}{{ m.content }}") is None
    assert set(PARSERS) >= {"hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder",
                            "deepseek_v3", "openai"}
