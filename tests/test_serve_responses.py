"""`/v1/responses` and `/v1/embeddings` over HTTP with the official `openai` client.

One in-process server (runner="pooling": embeddings and generation in one engine) over the
tiny random-weight Llama of tests/test_structured_serve.py (its chat template,
`TOOLS_TEMPLATE`, speaks the Hermes tool format). Greedy outputs make every response checkable against the chat
endpoint: a Responses request is rendered, generated and parsed by the chat path, so its
text equals the chat completion of the same conversation. The response store's bounds
are checked on the store itself (a fake clock), and over HTTP (delete, unknown ids).
"""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from openai.types.responses import Response as ResponseObject

from arcjax import AsyncLLM
from arcjax.entrypoints.openai.api_server import OpenAIServer, ServeConfig
from arcjax.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from support.hf_models import hf_pooled, tiny_model_with_chat_template
from support.running_server import GEOMETRY, TOOLS_TEMPLATE, WEATHER, RunningServer

MODEL = "tiny-responses"
QUESTION = "What is the weather in Oslo?"
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                           "celsius": {"type": "integer", "minimum": -9,
                                                       "maximum": 40}},
          "required": ["city", "celsius"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_with_chat_template(TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    llm = AsyncLLM(model_dir, runner="pooling", **GEOMETRY)
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                          tool_call_parser="hermes")))
    yield running
    running.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _wait_free(server, timeout=60.0) -> int:
    """KV blocks in use once the engine applied the aborts queued (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while server.api.llm.engine.blocks_in_use() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.api.llm.engine.blocks_in_use()


def _chat_text(client, messages, **kw) -> tuple[str, int]:
    """The chat endpoint's greedy answer to `messages` and its prompt tokens."""
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content, out.usage.prompt_tokens


def _final_event(resp) -> str:
    return "response.completed" if resp.status == "completed" else "response.incomplete"


# --- create: whole, streamed, previous_response_id ------------------------------------------
def test_plain_response_equals_the_chat_completion(client, server):
    resp = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                   max_output_tokens=12, temperature=0)
    text, prompt_tokens = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": QUESTION}],
                                     max_tokens=12)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == text and resp.output[0].type == "message"
    assert resp.status in ("completed", "incomplete")
    assert resp.usage.input_tokens == prompt_tokens
    assert 1 <= resp.usage.output_tokens <= 12
    assert resp.instructions == "Be brief." and resp.model == MODEL
    raw = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": QUESTION, "max_output_tokens": 2, "not_a_field": 1})
    ResponseObject.model_validate(raw.json())  # the body is the SDK's type, strictly
    assert raw.headers["X-Ignored-Fields"] == "not_a_field"


def test_streamed_events_arrive_in_order_and_join_to_the_text(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16,
                                    temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", _final_event(whole)]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    stored = client.responses.retrieve(final.id)  # a streamed response is stored too
    assert stored.output_text == deltas and stored.status == final.status


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And in Paris?", max_output_tokens=8,
                                     temperature=0, previous_response_id=first.id)
    text, prompt_tokens = _chat_text(client, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And in Paris?"}], max_tokens=8)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["And in Paris?"]


# --- tools and structured outputs ------------------------------------------------------------
def test_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=96, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    streamed = list(client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL],
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_output_tokens=96, temperature=0, stream=True))
    kinds = [e.type for e in streamed]
    assert kinds[2] == "response.output_item.added" and streamed[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments
    # the tool's answer goes back as function_call_output; the model answers in text
    answer = client.responses.create(
        model=MODEL, tools=[TOOL], tool_choice="none", max_output_tokens=10, temperature=0,
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "-3 C, snow"}])
    text, prompt_tokens = _chat_text(client, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": calls[0].call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "-3 C, snow"}],
        tools=[WEATHER], tool_choice="none", max_tokens=10)
    assert answer.output_text == text and answer.usage.input_tokens == prompt_tokens
    assert [o.type for o in answer.output] == ["message"]


def test_text_format_json_schema_is_valid(client):
    resp = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA,
                         "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)


@pytest.mark.parametrize("body, field", [
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": 3}}},
     "text.format.schema"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id")])
def test_bad_requests_name_the_responses_field(server, body, field):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["param"] == field, (body, r.json())


# --- background, retrieve, cancel, delete, the store's bounds ------------------------------
def test_background_response_is_cancelled_and_deleted(client, server):
    long = {"type": "object", "properties": {"text": {"type": "string", "minLength": 600}},
            "required": ["text"]}  # no EOS before 600 characters: it runs long
    resp = client.responses.create(model=MODEL, input=QUESTION, background=True,
                                   max_output_tokens=200, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "long",
                                                    "schema": long}})
    assert resp.status == "queued" and resp.background
    assert client.responses.retrieve(resp.id).status in ("queued", "in_progress")
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(resp.id).status == "cancelled"
    assert _wait_free(server) == 0  # its request was aborted
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)  # only background responses
    client.responses.delete(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(plain.id)
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_is_bounded_by_bytes_and_time():
    now = [0.0]
    store = ResponseStore(max_bytes=2000, ttl=10.0, clock=lambda: now[0])

    def entry(i, size=300):
        return StoredResponse({"id": f"resp_{i}", "status": "completed", "pad": "x" * size},
                              ({"role": "user", "content": "hi"},))

    for i in range(5):
        assert store.put(entry(i))
    assert store.num_bytes <= 2000 and store.get("resp_0") is not None
    assert store.put(entry(5))  # evicts the least recently used: resp_1 (resp_0 was read)
    assert store.get("resp_1") is None and store.get("resp_0") is not None
    assert store.evicted >= 1 and store.num_bytes <= 2000
    assert not store.put(entry(6, size=5000))  # alone larger than the bound: not kept
    assert store.get("resp_6") is None
    now[0] = 9.0
    store.put(entry(0))  # rewritten: lives 10 s from now
    now[0] = 10.5
    assert store.get("resp_2") is None and store.get("resp_0") is not None
    assert len(store) == 1 and store.num_bytes == store.get("resp_0").size
    assert store.delete("resp_0") is not None and store.num_bytes == 0


# --- embeddings in the same engine -----------------------------------------------------------
def test_embeddings_beside_a_streaming_response_equal_transformers(client, server, model_dir):
    """Embedding requests (float, base64, token ids) served while a response streams from the
    same engine: the stream keeps its greedy text, the embeddings equal transformers'."""
    alone = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24,
                                    temperature=0)
    streamed, started = [], threading.Event()

    def stream():
        for e in client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24,
                                         temperature=0, stream=True):
            if e.type == "response.output_text.delta":
                streamed.append(e.delta)
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(120)
    tokenizer = server.api.llm.engine.tokenizer
    texts = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. " * 2]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    encoded = client.embeddings.create(model=MODEL, input=texts)  # the client asks base64
    ids = [tokenizer.encode(t) for t in texts]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    reader.join(120)
    assert "".join(streamed) == alone.output_text
    raw = httpx.post(server.url + "/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert floats.usage.prompt_tokens == sum(map(len, ids))
    for i, t in enumerate(ids):
        ref = hf_pooled(model_dir, t, "LAST", True)  # no modules.json: last token, normalized
        got = np.asarray(floats.data[i].embedding)
        assert got @ ref / np.linalg.norm(got) / np.linalg.norm(ref) > 0.9999
        np.testing.assert_allclose(encoded.data[i].embedding, got, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(by_ids.data[i].embedding, got, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(vector, floats.data[0].embedding, rtol=1e-6, atol=1e-7)
    assert _wait_free(server) == 0  # no KV kept once embedded


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "dimensions": 8}, "dimensions"),  # the model is not Matryoshka
    ({"input": [[]]}, "input"),
    ({}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": ["ok", [10 ** 6]]}, "input[1]"),  # outside the vocabulary
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "other"}, "model")])
def test_bad_embedding_requests_name_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (400, 404), (body, r.text)
    assert r.json()["error"]["param"] == field, (body, r.json())
