"""gpt-oss's harmony channels through the server with the `openai` client: a tiny random
gpt-oss (`GptOssForCausalLM`) whose tokenizer has harmony's special tokens and whose chat
template renders the harmony format, served with `reasoning_parser="openai_gptoss"`
(`--reasoning-parser openai_gptoss`) and `--tool-call-parser openai`. A random model's text
is noise, so each output is forced by a grammar over harmony's special tokens, which
constrains the whole output, the analysis channel included
(`structured_outputs_in_reasoning`); the split into `reasoning_content`, `tool_calls` and
the final channel's content is then the server's and the parsers' own."""

from __future__ import annotations

import json

import openai
import pytest

from arcjax import AsyncLLM
from arcjax.entrypoints.openai.api_server import OpenAIServer, ServeConfig
from support.hf_models import GPT_OSS, HARMONY_TOKENS, tiny_reasoning_model
from support.running_server import GEOMETRY, RunningServer

MODEL = "tiny-gpt-oss"
# harmony, as gpt-oss's template renders it (tersely: no model identity or dates, tools'
# parameters not spelled out; the tiny model's context is short)
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: medium\n\n# Valid channels: analysis, commentary, "
    "final. Channel must be included for every message.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
    "namespace functions {\n{% for t in tools %}\ntype {{ t.function.name }} = (_: any) => any;"
    "\n{% endfor %}\n} // namespace functions<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- for tc in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions."
    "{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments }}<|call|>"
    "{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>"
    "commentary<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
THOUGHT, ANSWER, ARGUMENTS = "Need the weather.", "It is sunny.", '{"city": "Paris"}'
# the outputs, as llguidance grammars: <|...|> is the special token, a quoted string text
ANALYSIS = f'<|channel|> "analysis" <|message|> "{THOUGHT}" <|end|> <|start|> "assistant" '
FINAL = f'start: {ANALYSIS}<|channel|> "final" <|message|> "{ANSWER}" <|return|>'
CALL = (f"start: {ANALYSIS}<|channel|> \"commentary to=functions.get_weather \" <|constrain|> "
        f"\"json\" <|message|> {json.dumps(ARGUMENTS)} <|call|>")


@pytest.fixture(scope="module")
def llm():
    path = tiny_reasoning_model(HARMONY_TEMPLATE, GPT_OSS, HARMONY_TOKENS, special=True)
    llm = AsyncLLM(path, reasoning_parser="openai_gptoss",
                   structured_outputs_in_reasoning=True, **{**GEOMETRY, "max_model_len": 448})
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(llm):
    running = RunningServer(OpenAIServer(llm, ServeConfig(
        served_model_name=MODEL, tool_call_parser="openai", enable_auto_tool_choice=True)))
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120)
    running.stop()


def _streamed(client, **kw):
    reasoning, content, calls, finish = [], [], [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            delta = ch.delta.model_dump()
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            calls.extend(ch.delta.tool_calls or ())
            finish = ch.finish_reason or finish
    return "".join(reasoning), "".join(content), calls, finish


def test_the_prompt_is_harmony_with_its_special_tokens(llm):
    tok = llm.engine.tokenizer
    for t in HARMONY_TOKENS:
        assert t in tok.special_texts and len(tok.encode(t, add_special_tokens=False)) == 1


def test_analysis_is_reasoning_and_the_final_channel_is_the_content(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=64, temperature=0,
              extra_body={"structured_outputs": {"grammar": FINAL}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message.model_dump()
    assert msg.get("reasoning_content") == THOUGHT and msg["content"] == ANSWER, msg
    assert not msg.get("tool_calls") and r.choices[0].finish_reason == "stop"
    assert _streamed(client, **kw) == (THOUGHT, ANSWER, [], "stop")


def test_a_commentary_call_is_a_tool_call_apart_from_the_reasoning(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=160,
              temperature=0, extra_body={"structured_outputs": {"grammar": CALL}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.tool_calls, msg
    (call,) = msg.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert msg.model_dump()["reasoning_content"] == THOUGHT and not msg.content
    assert r.choices[0].finish_reason == "tool_calls"
    reasoning, content, calls, finish = _streamed(client, **kw)
    assert (reasoning, content, finish) == (THOUGHT, "", "tool_calls")
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
