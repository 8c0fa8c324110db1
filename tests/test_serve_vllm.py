"""A client written for vLLM against `arcjax serve`: reasoning (`reasoning` and
`reasoning_content`, streamed and not, a JSON schema after the reasoning, `enable_thinking`),
vLLM's request fields changing the output as vLLM documents (or refused by name), the tool
formats round-tripped through the server, /tokenize and /detokenize, the model card, the
OpenAPI schema, `vllm:` metrics, and a launch line copied from vLLM's docs.

One engine (a tiny random Llama whose tokenizer has `<think>` and `</think>` tokens and whose
chat template opens a think block, or closes it with `enable_thinking: false`) serves every
server here; its reasoning parser is the one the prompt implies (deepseek_r1-style).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arcjax import AsyncLLM, SamplingParams
from arcjax.entrypoints.openai.api_server import OpenAIServer, ServeConfig
from arcjax.entrypoints.openai.request_params import REFUSED
from support.hf_models import tiny_reasoning_model, with_context
from support.running_server import GEOMETRY, RunningServer

MODEL = "tiny-reasoner"
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% if enable_thinking is defined and "
    "not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}"
    "{% endif %}{% endif %}")
USER = [{"role": "user", "content": "def fibonacci(n):"}]
# sampled (seeded) with </think> made likely, so the block closes within a few tokens
THINK = {"temperature": 1.0, "seed": 3, "max_tokens": 24}


def model_dir() -> str:
    return tiny_reasoning_model(THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(model_dir(), **GEOMETRY)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def end_id(llm):
    return llm.engine.tokenizer.token_to_id("</think>")


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


# --- reasoning ------------------------------------------------------------------------------
def test_reasoning_and_content_streamed_and_not(client, llm, end_id):
    extra = {"logit_bias": {str(end_id): 5}}
    whole = client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra,
                                           **THINK)
    msg = whole.choices[0].message
    data = msg.model_dump()
    assert data["reasoning"] == data["reasoning_content"] and data["reasoning"]
    assert msg.content is not None, "the think block closed and the answer followed"
    reasoning, content = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                extra_body=extra, **THINK):
        for choice in chunk.choices:  # a chunk per token: every token boundary is a split
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning.append(delta.get("reasoning") or "")
            content.append(delta.get("content") or "")
    assert "".join(reasoning) == data["reasoning"] and "".join(content) == msg.content
    # the engine's own output (RequestOutput carries the split): the reasoning, the
    # marker, the answer; nothing lost, nothing added
    ids = llm.engine.tokenizer.encode(f"user: {USER[0]['content']}\nassistant: <think>\n",
                                      add_special_tokens=False)
    c = _engine_output(llm, ids, SamplingParams(**THINK, logit_bias={end_id: 5}))
    assert (c.reasoning, c.content) == (data["reasoning"], msg.content)
    assert c.text == data["reasoning"] + "</think>" + msg.content


def test_responses_carry_a_reasoning_item_before_the_message(client, end_id):
    """/v1/responses reads the same split: a reasoning item (its reasoning_text the chat
    message's `reasoning`), then the message (the chat message's content); streamed, the
    reasoning_text deltas and the output_text deltas join to them; effort "none" closes the
    block (no reasoning item)."""
    extra = {"logit_bias": {str(end_id): 5}}
    chat = client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra,
                                          **THINK).choices[0].message.model_dump()
    kw = dict(model=MODEL, input=USER[0]["content"], temperature=THINK["temperature"],
              max_output_tokens=THINK["max_tokens"], extra_body={**extra, "seed": THINK["seed"]})
    resp = client.responses.create(**kw)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == chat["reasoning"]
    assert resp.output_text == chat["content"]
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        chat["reasoning"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        chat["content"]
    off = client.responses.create(**{**kw, "max_output_tokens": 4}, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"]


def _engine_output(llm, ids, params):
    import asyncio

    async def run():
        async for out in llm.generate(ids, params):
            if out.finished:
                return out.outputs[0]

    return asyncio.run(run())


def test_json_schema_answers_after_the_reasoning(client, end_id):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=USER, **{**THINK, "max_tokens": 48},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"logit_bias": {str(end_id): 5}})
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning"], "unconstrained thinking first"
    assert isinstance(json.loads(msg["content"])["ok"], bool)
    assert r.choices[0].finish_reason == "stop"


def test_enable_thinking_false_and_reasoning_effort_none_remove_the_block(client):
    on = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                        temperature=0)
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}},
                  {"reasoning_effort": "none"}):
        off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                             temperature=0, extra_body=extra)
        msg = off.choices[0].message.model_dump()
        assert msg.get("reasoning") is None and msg["content"] is not None
        assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the closed block's tokens
    assert on.choices[0].message.model_dump().get("reasoning") is not None


# --- vLLM's fields change the output as vLLM documents ------------------------------------
def _complete(server, **body):
    r = _post(server, "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 4,
                                          "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _single_token(server, words):
    for w in words:
        ids = _post(server, "/tokenize", {"prompt": w, "add_special_tokens": False}).json()
        if ids["count"] == 1:
            return w, ids["tokens"][0]
    raise AssertionError("no one-token word")


def test_logit_bias_allowed_token_ids_and_bad_words(server):
    base = _complete(server, return_token_ids=True)["choices"][0]["token_ids"]
    banned = _complete(server, return_token_ids=True,
                       logit_bias={str(base[0]): -100})["choices"][0]["token_ids"]
    assert banned[0] != base[0] and base[0] not in banned
    forced = _complete(server, return_token_ids=True, logit_bias={"7": 100})
    assert forced["choices"][0]["token_ids"] == [7, 7, 7, 7]
    allowed = _complete(server, return_token_ids=True, allowed_token_ids=[10, 11, 12])
    assert set(allowed["choices"][0]["token_ids"]) <= {10, 11, 12}
    word, token = _single_token(server, ["def", "fox", "the", "return", "n"])
    pair = [token, 11]
    free = _complete(server, return_token_ids=True, allowed_token_ids=pair,
                     logit_bias={str(token): 5})
    assert token in free["choices"][0]["token_ids"]
    bad = _complete(server, return_token_ids=True, allowed_token_ids=pair,
                    logit_bias={str(token): 5}, bad_words=[word])
    assert bad["choices"][0]["token_ids"] == [11, 11, 11, 11]
    two = _complete(server, return_token_ids=True, bad_words=["fibonacci(n):"])  # multi-token
    assert two["choices"][0]["finish_reason"] == "length"


def test_stop_strings_echo_and_logprob_fields(server):
    text = _complete(server)["choices"][0]["text"]
    stop = text[1:3]
    cut = _complete(server, stop=[stop])["choices"][0]
    kept = _complete(server, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    assert kept["text"] == text[:text.index(stop)] + stop
    echo = _complete(server, echo=True, logprobs=1)["choices"][0]
    assert echo["text"] == "def fibonacci(n):" + text
    prompt_len = _post(server, "/tokenize", {"prompt": "def fibonacci(n):"}).json()["count"]
    lp = echo["logprobs"]
    assert len(lp["tokens"]) == prompt_len + 4 and lp["token_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    only = _complete(server, echo=True, max_tokens=0)
    assert only["choices"][0]["text"] == "def fibonacci(n):"
    assert only["usage"]["completion_tokens"] == 0
    plp = _complete(server, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    assert len(plp) == prompt_len and plp[0] is None and all(plp[1:])
    ids = _complete(server, logprobs=1, return_tokens_as_token_ids=True)
    assert all(t.startswith("token_id:") for t in ids["choices"][0]["logprobs"]["tokens"])


def test_prompt_fields_and_usage_on_every_chunk(server, client):
    with_bos = _complete(server)["usage"]["prompt_tokens"]
    without = _complete(server, add_special_tokens=False)["usage"]["prompt_tokens"]
    assert with_bos == without + 1  # this tokenizer adds BOS to text prompts
    assert _complete(server, truncate_prompt_tokens=2)["usage"]["prompt_tokens"] == 2
    assert _complete(server, priority=-5)["choices"][0]["finish_reason"] == "length"
    partial = [*USER, {"role": "assistant", "content": "The answer is"}]
    r = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=3,
                                       temperature=0, extra_body={
                                           "add_generation_prompt": False, "echo": True,
                                           "continue_final_message": True})
    assert r.choices[0].message.content.startswith("The answer is")
    tok = _post(server, "/tokenize", {"messages": partial, "add_generation_prompt": False,
                                      "continue_final_message": True}).json()
    assert tok["count"] == r.usage.prompt_tokens
    text = _post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("assistant: The answer is")
    completions = [c.usage.completion_tokens for c in client.completions.create(
        model=MODEL, prompt="x", max_tokens=3, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert completions == sorted(completions) and completions[-1] == 3


def test_special_token_fields(server, llm):
    bos = str(llm.engine.tokenizer.bos_token_id)  # forced: every output token is <s>
    texts = [_complete(server, max_tokens=3, logit_bias={bos: 100}, **kw)["choices"][0]["text"]
             for kw in ({}, {"skip_special_tokens": False},
                        {"skip_special_tokens": False, "spaces_between_special_tokens": False})]
    assert texts[0] == "" and texts[2] == "<s><s><s>"
    assert texts[1].split(" ") == ["<s>"] * 3 or texts[1].split(" ") == ["", *["<s>"] * 3]


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_fields_arcjax_cannot_honour_are_refused_by_name(server, field):
    value = {"media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"x": 1},
             "vllm_xargs": {"x": 1}}.get(field, "on")
    r = _post(server, "/v1/chat/completions", {"messages": USER, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# --- tool formats, round trips through the server -----------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLS = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "pythonic": '[get_weather(city="Paris")]',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                   "</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                   '\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "openai": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              '{"city": "Paris"}<|call|>',
}


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_each_tool_format_round_trips(llm, parser):
    running = RunningServer(OpenAIServer(llm, ServeConfig(
        served_model_name=MODEL, tool_call_parser=parser, enable_auto_tool_choice=True)))
    try:
        c = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0,
                          timeout=120)
        # the output is forced to be the recorded call (a choice constraint, no thinking)
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=200,
                  temperature=0, extra_body={"structured_outputs": {"choice": [CALLS[parser]]},
                                             "chat_template_kwargs": {"enable_thinking": False}})
        r = c.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert r.choices[0].finish_reason == "tool_calls"
        if parser in ("hermes", "openai"):  # streamed too
            items = [tc for chunk in c.chat.completions.create(**kw, stream=True)
                     for ch in chunk.choices for tc in (ch.delta.tool_calls or ())]
            assert items[0].function.name == "get_weather"
            assert json.loads("".join(i.function.arguments for i in items)) == {"city": "Paris"}
    finally:
        running.stop()


# --- tokenizer, models, schema, metrics, a vLLM launch line -------------------------------
def test_tokenize_detokenize_models_and_the_openapi_schema(server):
    tok = _post(server, "/tokenize", {"prompt": "def fib", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == GEOMETRY["max_model_len"]
    assert _post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"].endswith(
        "def fib")
    bad = _post(server, "/detokenize", {"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == MODEL and card["root"] == model_dir() and card["parent"] is None
    assert card["max_model_len"] == GEOMETRY["max_model_len"] and card["permission"]
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(schema["paths"])
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "logit_bias", "chat_template_kwargs", "reasoning_effort"} <= set(props)
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200
    assert httpx.get(server.url + "/health", timeout=30).text == ""


def test_vllm_launch_line_starts_and_metrics_carry_vllm_names():
    from arcjax.entrypoints.cli import parse_serve

    path = with_context(model_dir(), 4096)
    cmd = parse_serve(["serve", path, "--gpu-memory-utilization", "0.9", "--max-model-len",
                       "4096", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--served-model-name", MODEL, "--attention-impl", "xla"])
    llm = AsyncLLM(cmd.model_dir, **cmd.engine_options)
    running = RunningServer(OpenAIServer(llm, cmd.config))
    try:
        assert llm.engine.max_model_len == 4096
        r = _post(running, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        text = httpx.get(running.url + "/metrics", timeout=30).text
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
                     "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                     "vllm:generation_tokens_total", "vllm:request_success_total",
                     "vllm:inter_token_latency_seconds_count", "arcjax_engine_steps_total"):
            assert name in names, name
    finally:
        running.stop()
        llm.shutdown()


def test_generation_config_defaults_apply_when_a_request_leaves_them_unset(llm, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "do_sample": True}))
    running = RunningServer(OpenAIServer(llm, ServeConfig(
        served_model_name=MODEL, generation_config=str(tmp_path))))
    try:
        greedy = _complete(running, max_tokens=3)["choices"][0]["text"]
        unset = _post(running, "/v1/completions", {"prompt": "def fibonacci(n):",
                                                  "max_tokens": 3}).json()
        assert unset["choices"][0]["text"] == greedy  # temperature 0 from the config
        chat = _post(running, "/v1/chat/completions", {
            "messages": USER, "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert chat["usage"]["completion_tokens"] <= 3  # max_new_tokens: the default
    finally:
        running.stop()
