"""Structured outputs and tool calling over HTTP, with the official `openai` client.

One in-process server over a tiny random-weight Llama whose chat template speaks the
Hermes/Qwen tool format, tersely (the byte-level test tokenizer makes every character a
token): tools listed first, `<tool_call>` blocks, tool results as `<tool_response>`. The mask alone makes the outputs valid: a Pydantic model parsed
by `client.chat.completions.parse`, a tool-call round trip (`tools` -> `tool_calls` -> a
`tool` message -> a final answer) streaming and not, with tool_choice "required", a
named function and "auto" (the Hermes parser reading a completion the test constrains
to the format), and vLLM's guided_* fields.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from arcjax import AsyncLLM
from arcjax.entrypoints.chat_template import ChatTemplate
from arcjax.entrypoints.openai.api_server import OpenAIServer, ServeConfig
from arcjax.entrypoints.openai.tool_calls import template_messages
from support.hf_models import tiny_model_with_chat_template
from support.running_server import GEOMETRY, TOOLS_TEMPLATE, WEATHER, RunningServer

MODEL = "tiny-tools"
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: int = pydantic.Field(ge=-40, le=45)
    sunny: bool


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_with_chat_template(TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    llm = AsyncLLM(model_dir, **GEOMETRY)
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                          tool_call_parser="hermes")))
    yield running
    running.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_pydantic_response_format_parses(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Weather, max_tokens=64,
        temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)


def test_guided_fields_streaming_and_not(client):
    for extra, check in [({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
                         ({"guided_regex": r"[0-9]{2}°[CF]"}, lambda t: len(t) == 4),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "w", "schema": WEATHER["function"]["parameters"]}},
                           "structured_outputs": {"disable_any_whitespace": True}},
                          lambda t: jsonschema.validate(json.loads(t), WEATHER["function"][
                              "parameters"]) is None)]:
        body = {k: v for k, v in extra.items() if k != "response_format"}
        fmt = extra.get("response_format", openai.omit)
        whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                               temperature=0, response_format=fmt,
                                               extra_body=body)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(
                               model=MODEL, messages=QUESTION, max_tokens=32, temperature=0,
                               response_format=fmt, extra_body=body, stream=True) if c.choices)
        assert whole.choices[0].message.content == streamed
        assert check(streamed), (extra, streamed)
    text = client.completions.create(model=MODEL, prompt="Weather:", max_tokens=8,
                                     temperature=0, extra_body={"guided_choice": ["hot", "cold"]})
    assert text.choices[0].text in ("hot", "cold")


def _round_trip(client, tool_choice, stream: bool):
    """tools -> tool_calls -> a tool message -> a final answer. Returns the calls."""
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], temperature=0,
                  max_tokens=96, tool_choice=tool_choice, parallel_tool_calls=False)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        parts, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta if chunk.choices else None
            for tc in (delta.tool_calls or []) if delta else []:
                call = parts.setdefault(tc.index, ["", "", ""])
                call[0] = tc.id or call[0]
                call[1] = (tc.function.name or call[1]) if tc.function else call[1]
                call[2] += (tc.function.arguments or "") if tc.function else ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        calls = [tuple(parts[i]) for i in sorted(parts)]
    assert len(calls) == 1 and calls[0][0].startswith("call_")
    call_id, name, arguments = calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name,
                                                             "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=6, temperature=0)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content is not None
    return history, final


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_required(client, model_dir, stream):
    history, final = _round_trip(client, "required", stream)
    # the tool message went through the chat template: the prompt holds its rendering
    template = ChatTemplate.from_dir(model_dir)
    text = template.render(template_messages(history), tools=[WEATHER, TIME])
    assert "tool: <tool_response>Sunny, 21 C</tool_response>" in text
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(model_dir + "/tokenizer.json")
    assert final.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_named(client, stream):
    _round_trip(client, {"type": "function", "function": {"name": "get_time"}}, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_hermes_calls(client, stream):
    """tool_choice "auto": the completion (constrained here to the Hermes format, as a
    model trained on it would write) is split into content and tool_calls."""
    literal = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
               '"unit": "C"}}</tool_call>')
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="auto",
                  max_tokens=96, temperature=0,
                  extra_body={"structured_outputs": {"choice": [literal]}})
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content, calls = message.content, [(c.function.name, c.function.arguments)
                                           for c in message.tool_calls]
    else:
        content, calls = "", {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is None:
                continue
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (tc.function.name or name, args + (tc.function.arguments or ""))
        calls = [calls[i] for i in sorted(calls)]
    assert content == "Checking."
    assert calls == [("get_weather", '{"city": "Oslo", "unit": "C"}')]


def test_bad_constraints_are_400s_naming_the_field(server):
    for body, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "minimum": 9, "maximum": 1}}}},
         "response_format"),
        ({"guided_regex": "(open"}, "guided_regex"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ]:
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
