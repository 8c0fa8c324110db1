"""The OpenAI-compatible server (arcjax serve), end to end over HTTP on 127.0.0.1.

The official `openai` client (sync and async), raw httpx for error statuses and
disconnects, prometheus_client's parser for /metrics. One engine (tiny Llama, byte-level
BPE, a chat template added) serves every in-process server here; a subprocess checks SIGTERM.
Every load is bounded in count and time.
"""


from __future__ import annotations

import json
import os
import socket
import threading
import time

from support.running_server import GEOMETRY, RunningServer, chat_model_dir


# --- fixtures -------------------------------------------------------------------------------
import asyncio  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from arcjax import LLM, AsyncLLM, SamplingParams  # noqa: E402
from arcjax.entrypoints.openai.api_server import OpenAIServer, ServeConfig  # noqa: E402
from pallas_kernels import cpu_build  # noqa: E402

MODEL = "tiny"
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Naïve café, 東京"]


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(chat_model_dir(), **GEOMETRY)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference():
    """LLM.generate on the same model and geometry (greedy, EOS honoured)."""
    return LLM(chat_model_dir(), **GEOMETRY)


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"),
                         max_retries=0, timeout=60, **kw)


def _aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=60)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items())
                                   if k != "model_name")
            out[key] = s.value
    return out


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _greedy(n=8):
    return SamplingParams(max_tokens=n, temperature=0)


# --- plain endpoints ------------------------------------------------------------------------
def test_models_and_health(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert _client(server).models.retrieve(MODEL).id == MODEL


def test_model_card_names_the_attention_its_buckets_run(server):
    _client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    attention = card["attention"]  # the buckets compiled so far, "auto" resolved
    ran = "cpu" if cpu_build.kernels_unavailable() is None else "xla"
    assert attention["configured"] == "auto"
    assert attention["decode"] == [ran] and attention["prefill"] == [ran]
    assert all(b["impl"] == ran for b in attention["buckets"])
    assert attention["verified"] is True  # no GPU kernel runs without a recorded pass


# --- completions ----------------------------------------------------------------------------
def test_completions_equal_llm_generate(server, reference):
    outs = reference.generate(PROMPTS, _greedy(), use_tqdm=False)
    expected = [o.text for o in outs]
    client = _client(server)
    for prompt, out in zip(PROMPTS, outs):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == out.text
        assert r.usage.completion_tokens == len(out.token_ids)
        assert r.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    long_prompt = " ".join(PROMPTS) * 2  # several full KV blocks
    ids = reference.tokenizer.encode(long_prompt)
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert first.choices[0].text == reference.generate([ids], _greedy(), use_tqdm=False)[0].text
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    # the second sees the first's full blocks in the prefix cache (at most len - 1 tokens)
    block = GEOMETRY["block_size"]
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // block * block > 0
    assert again.choices[0].text == first.choices[0].text


def test_completions_streaming_sync_and_async(server, reference):
    outs = reference.generate(PROMPTS, _greedy(), use_tqdm=False)
    expected = [o.text for o in outs]
    client = _client(server)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.completion_tokens == len(outs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")

    async def run():
        aclient = _aclient(server)

        async def one(prompt):
            text = ""
            async for c in await aclient.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True):
                text += c.choices[0].text
            return text

        r = await aclient.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                             temperature=0)
        return r.choices[0].text, await asyncio.gather(*map(one, PROMPTS))

    single, streamed = asyncio.run(run())
    assert single == expected[1]
    assert streamed == expected


# --- chat -----------------------------------------------------------------------------------
def test_chat_equal_llm_generate(server, reference, llm):
    from arcjax.entrypoints.chat_template import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def fibonacci(n):"}]
    text = ChatTemplate.from_dir(chat_model_dir()).render(messages)
    ids = reference.tokenizer.encode(text, add_special_tokens=False)
    expected = reference.generate([ids], _greedy(), use_tqdm=False)[0].text
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.object == "chat.completion.chunk" for c in chunks)

    async def run():
        r = await _aclient(server).chat.completions.create(model=MODEL, messages=messages,
                                                           max_completion_tokens=8,
                                                           temperature=0)
        return r.choices[0].message.content

    assert asyncio.run(run()) == expected


# --- n and logprobs -------------------------------------------------------------------------
def _sampled(n=2, **kw):
    return SamplingParams(max_tokens=6, temperature=1.0, seed=1234, n=n, **kw)


def test_completions_n_and_logprobs_equal_llm_generate(server, reference):
    ref = reference.generate(PROMPTS[:2], _sampled(logprobs=3), use_tqdm=False)
    client = _client(server)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=1,
                                  seed=1234, n=2, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    expected = [c for o in ref for c in o.outputs]
    assert [c.text for c in r.choices] == [c.text for c in expected]
    assert r.choices[0].text != r.choices[1].text or r.choices[2].text != r.choices[3].text
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    for choice, c in zip(r.choices, expected):
        lp = choice.logprobs
        assert len(lp.tokens) == len(c.token_ids) == len(lp.top_logprobs)
        for i, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert lp.tokens[i] == entry[tid].decoded_token
            assert lp.token_logprobs[i] == pytest.approx(entry[tid].logprob, abs=1e-6)
            top = lp.top_logprobs[i]
            # the top 3, and the sampled token if not among them (texts are keys: a text
            # shared by two tokens, e.g. partial UTF-8 "\ufffd", keeps the better one)
            assert 1 <= len(top) <= 4
            ranked = sorted(entry.values(), key=lambda x: x.rank)
            assert list(top) == list(dict.fromkeys(x.decoded_token for x in ranked))
            assert list(top.values()) == sorted(top.values(), reverse=True)
        assert lp.text_offset[0] == 0
    # streaming: both indices, texts and logprob tokens equal the non-streaming response
    texts, tokens = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                           temperature=1, seed=1234, n=2, logprobs=3,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:  # the last chunk: every choice's tokens
            assert chunk.usage.completion_tokens == sum(len(c.token_ids) for c in expected[:2])
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens if c.logprobs else [])
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}
    assert tokens == {0: r.choices[0].logprobs.tokens, 1: r.choices[1].logprobs.tokens}


def test_chat_n_and_logprobs(server, reference):
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=1, seed=1234, n=2, logprobs=True,
                                       top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    from arcjax.entrypoints.chat_template import ChatTemplate

    ids = reference.tokenizer.encode(ChatTemplate.from_dir(chat_model_dir()).render(messages),
                                     add_special_tokens=False)
    ref = reference.generate([ids], _sampled(logprobs=2), use_tqdm=False)[0].outputs
    assert [c.message.content for c in r.choices] == [c.text for c in ref]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in ref)
    for choice, c in zip(r.choices, ref):
        content = choice.logprobs.content
        assert len(content) == len(c.token_ids)
        for item, tid, entry in zip(content, c.token_ids, c.logprobs):
            assert item.token == entry[tid].decoded_token
            assert item.logprob == pytest.approx(entry[tid].logprob, abs=1e-6)
            assert item.bytes == list(item.token.encode())
            assert len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 temperature=1, seed=1234, n=2, logprobs=True,
                                                 stream=True))
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            assert c.logprobs is None or all(t.top_logprobs == [] for t in c.logprobs.content)
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}


# --- load, disconnects, slow readers --------------------------------------------------------
def test_64_concurrent_streams(server, llm):
    """64 streaming clients at once (max_num_seqs 8, budget 128): all finish, every block is
    freed, and /metrics counts the steps in which max_num_seqs held admissions back."""
    before = _metrics(server)

    async def run():
        client = _aclient(server)

        async def one(i):
            text, reasons = "", []
            async for c in await client.completions.create(
                    model=MODEL, prompt=PROMPTS[i % 3] + " " * (i % 5), max_tokens=6,
                    temperature=0.8, seed=i, stream=True):
                text += c.choices[0].text
                reasons.append(c.choices[0].finish_reason)
            return reasons[-1]

        return await asyncio.wait_for(asyncio.gather(*map(one, range(64))), 90)

    reasons = asyncio.run(run())
    assert len(reasons) == 64 and set(reasons) <= {"length", "stop"}
    assert _wait_for(lambda: llm.engine.blocks_in_use() == 0 and llm.num_unfinished == 0)
    after = _metrics(server)
    for knob in ("seqs_full",):
        key = f"arcjax_scheduler_knob_engaged_steps_total[knob={knob}]"
        assert after[key] > before[key], knob
    done = [f"arcjax_requests_total[finish_reason={r}]" for r in ("length", "stop")]
    assert sum(after[k] - before[k] for k in done) == 64


def _sse_stream(server, body, **kw):
    return httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30, **kw)


def test_disconnect_mid_stream_frees_blocks(server, llm):
    before = _metrics(server)
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0,
                ignore_eos=True, stream=True)
    with _sse_stream(server, body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks (and blank separators)
        assert any(g.startswith("data: ") for g in got)
        assert llm.engine.blocks_in_use() > 0
    # closed mid-stream: the request is aborted and its blocks freed
    assert _wait_for(lambda: llm.num_unfinished == 0 and llm.engine.blocks_in_use() == 0, 5)
    after = _metrics(server)
    assert after["arcjax_kv_blocks_in_use"] == 0
    key = "arcjax_requests_total[finish_reason=abort]"
    assert after[key] == before.get(key, 0) + 1
    assert after["arcjax_generation_tokens_total"] < before["arcjax_generation_tokens_total"] + 200


def test_disconnect_while_not_streaming(server, llm):
    key = "arcjax_requests_total[finish_reason=abort]"
    before = _metrics(server)[key]
    body = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=240, temperature=0,
                ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body,
                   timeout=httpx.Timeout(30, read=0.05))
    assert _wait_for(lambda: llm.num_unfinished == 0 and llm.engine.blocks_in_use() == 0, 5)
    assert _metrics(server)[key] == before + 1


def test_slow_reader_does_not_slow_others(server, llm):
    """One client reads a chunk every 50 ms; 8 others stream at full speed meanwhile. The
    engine finishes the slow reader's request long before it has read it, and the fast clients
    finish while it is still reading."""
    import socket as socket_mod

    payload = json.dumps(dict(model=MODEL, prompt=PROMPTS[2], max_tokens=60, temperature=0,
                              ignore_eos=True, stream=True)).encode()
    sock = socket_mod.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    slow_done = threading.Event()
    slow_data = []
    engine_idle_while_reading = []

    def slow():
        buf = b""
        while b"[DONE]" not in buf:
            chunk = sock.recv(256)
            if not chunk:
                break
            buf += chunk
            engine_idle_while_reading.append(llm.num_unfinished == 0)
            time.sleep(0.05)
        slow_data.append(buf)
        slow_done.set()

    t = threading.Thread(target=slow, daemon=True)
    t.start()

    async def fast():
        client = _aclient(server)

        async def one(i):
            n = 0
            async for c in await client.completions.create(
                    model=MODEL, prompt=PROMPTS[i % 3], max_tokens=20, temperature=0,
                    extra_body={"ignore_eos": True}, stream=True):
                n += bool(c.choices[0].text)
            return n

        return await asyncio.wait_for(asyncio.gather(*map(one, range(8))), 60)

    counts = asyncio.run(fast())
    assert all(n > 0 for n in counts)
    assert not slow_done.is_set(), "fast clients should finish while the slow one reads"
    t.join(60)
    sock.close()
    assert b"[DONE]" in slow_data[0] and b'"finish_reason":"length"' in slow_data[0]
    assert any(engine_idle_while_reading), "the engine waited for the slow reader"


# --- errors ---------------------------------------------------------------------------------
BAD_REQUESTS = [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 5.0}, "presence_penalty"),  # outside [-2, 2]
    ({"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),  # outside [-100, 100]
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "seed": -3}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),  # more than --max-stop-strings
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 100_000]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x " * 300}, "prompt"),
    ({}, "prompt"),
    ([1, 2], "body"),
]


@pytest.mark.parametrize("body,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_completion_requests_are_400_naming_the_field(server, body, field):
    if isinstance(body, dict):
        body = {"model": MODEL, **body}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and err["message"]


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),  # with add_generation_prompt (vLLM refuses both)
    ({"messages": [{"role": "user", "content": "x " * 300}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": "json"},
     "response_format"),
]


@pytest.mark.parametrize("body,field", BAD_CHATS, ids=[f for _, f in BAD_CHATS])
def test_bad_chat_requests_are_400_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_error_statuses(server, llm):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model=MODEL, prompt="x", max_tokens=4, n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/v1/completions", timeout=10).status_code == 405
    # a server with an API key, and one whose queue holds nothing, on the same engine
    keyed = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                        api_key="sesame")))
    full = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                       max_queued_requests=0)))
    assert len(llm.engine.trace_sink._sinks) == 3  # one fan-out, every server counted once
    try:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(keyed.url + "/v1/completions", headers=headers, timeout=10,
                           json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            _client(keyed, api_key="wrong").models.list()
        r = _client(keyed, api_key="sesame").completions.create(model=MODEL, prompt="x",
                                                                 max_tokens=2)
        assert r.choices[0].text is not None
        assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
        with pytest.raises(openai.RateLimitError) as e:
            _client(full).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    finally:
        keyed.stop()
        full.stop()


def test_embeddings_are_refused_by_a_generation_engine(server):
    """A server whose engine was built without runner="pooling" refuses /v1/embeddings
    clearly (400 naming the model, saying how to start one that embeds)."""
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).embeddings.create(model=MODEL, input="def fibonacci(n):")
    assert e.value.body["param"] == "model"
    assert e.value.body["code"] == "embeddings_not_supported"
    assert "--runner pooling" in e.value.body["message"]


# --- metrics --------------------------------------------------------------------------------
def test_metrics_parse_and_count(server):
    _client(server).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8,
                                       temperature=0)
    m = _metrics(server)
    for name in ("arcjax_time_to_first_token_seconds_count",
                 "arcjax_inter_token_latency_seconds_count",
                 "arcjax_e2e_request_latency_seconds_count", "arcjax_prompt_tokens_total",
                 "arcjax_generation_tokens_total", "arcjax_engine_steps_total"):
        assert m[name] > 0, name
    for name in ("arcjax_num_requests_running", "arcjax_num_requests_waiting",
                 "arcjax_kv_blocks_in_use", "arcjax_preemptions_total",
                 "arcjax_prefix_cache_hit_tokens_total",
                 "arcjax_scheduler_knob_engaged_steps_total[knob=cap_deferred]",
                 "arcjax_scheduler_knob_engaged_steps_total[knob=floor_held]",
                 "arcjax_scheduler_knob_engaged_steps_total[knob=budget_full_at]"):
        assert name in m, name
    assert m["arcjax_kv_blocks_total"] == 96
    assert m["arcjax_requests_total[finish_reason=length]"] >= 3


# --- shutdown -------------------------------------------------------------------------------
def _slow_steps(llm, monkeypatch, seconds: float = 0.01) -> None:
    """Each engine step of `llm` takes `seconds` longer, so a 240-token request lasts over
    2 s however warm the shared engine is: on an engine whose steps earlier tests compiled,
    240 steps take about 0.2 s, and a drain test would find its request already finished."""
    step = llm.engine.run_step

    def slow_step():
        time.sleep(seconds)
        step()

    monkeypatch.setattr(llm.engine, "run_step", slow_step)


def test_drain_lets_in_flight_requests_finish(llm, monkeypatch):
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                          shutdown_timeout=30)))
    _slow_steps(llm, monkeypatch)
    # long enough (240 steps) that the drain is still waiting when /health is asked
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=240, temperature=0,
                ignore_eos=True, stream=True)
    with _sse_stream(running, body) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        stopper = threading.Thread(target=running.stop)
        stopper.start()
        assert _wait_for(lambda: running.api.draining, 5)
        assert httpx.get(running.url + "/health", timeout=10).status_code == 503
        r2 = httpx.post(running.url + "/v1/completions", timeout=10,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r2.status_code == 503 and r2.json()["error"]["code"] == "shutting_down"
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in rest)
    stopper.join(30)
    assert not running.thread.is_alive()


def test_drain_timeout_aborts_the_rest(llm, monkeypatch):
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                          shutdown_timeout=0.2)))
    _slow_steps(llm, monkeypatch)  # the request cannot finish within the 0.2 s
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=240, temperature=0,
                ignore_eos=True, stream=True)
    with _sse_stream(running, body) as r:
        lines = r.iter_lines()
        next(lines)
        running.stop()
        rest = list(lines)
    assert any('"finish_reason":"abort"' in line for line in rest)
    assert not running.thread.is_alive()
    assert _wait_for(lambda: llm.engine.blocks_in_use() == 0, 5)


def test_sigterm_subprocess_drains_and_exits_0():
    """`python -m arcjax.serve MODEL_DIR ...` in a subprocess: SIGTERM while a stream is in
    flight -> /health 503, the stream completes, exit status 0."""
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "arcjax.serve", chat_model_dir(),
                             f"--port={port}", "--served-model-name=tiny",
                             "--shutdown-timeout=60", *flags], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def health_is(code):
            try:
                return httpx.get(url + "/health", timeout=5).status_code == code
            except httpx.TransportError:
                return False
        assert _wait_for(lambda: health_is(200), 90), (
            proc.stdout.read1().decode() if proc.poll() else "no start")
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=220, temperature=0,
                    ignore_eos=True, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            assert _wait_for(lambda: health_is(503), 10)
            rest = list(lines)
        assert any('"finish_reason":"length"' in line for line in rest)
        assert "data: [DONE]" in rest
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_async_llm_merges_the_outputs_a_slow_reader_missed(llm):
    """A reader that falls behind gets the newest output with every delta it replaces
    (as vLLM's output collector): fewer outputs, the same text, the final one last."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def read(slow: bool):
        outs = []
        async for out in llm.generate(PROMPTS[0], params):
            outs.append(out)
            if slow:
                await asyncio.sleep(0.05)  # the loop is free; the engine thread runs on
        return outs

    fast, slow = asyncio.run(read(False)), asyncio.run(read(True))
    for outs in (fast, slow):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        assert len(outs[-1].token_ids) == 40
    assert slow[-1].token_ids == fast[-1].token_ids
    assert len(slow) < len(fast)


# --- real clients, hostile clients ----------------------------------------------------------
def test_unknown_fields_are_ignored_logged_once_and_listed(server, reference, caplog):
    want = reference.generate([PROMPTS[0]], _greedy(4), use_tqdm=False)[0].text
    names = ("frobnicate", "x_client_tag")
    assert not set(names) & server.api.tracker.ignored_logged
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
            **dict.fromkeys(names, 1)}
    with caplog.at_level("WARNING", logger="arcjax.entrypoints.openai.serving_engine"):
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            assert r.headers["x-ignored-fields"] == "frobnicate, x_client_tag"
        with _sse_stream(server, {**body, "stream": True}) as r:
            assert r.headers["x-ignored-fields"] == "frobnicate, x_client_tag"
            assert "data: [DONE]" in list(r.iter_lines())
    logged = [m for m in caplog.messages if "ignoring the unknown request field" in m]
    assert sorted(logged) == [f"ignoring the unknown request field {n!r} (logged once)"
                              for n in names]  # three requests, each name once
    plain = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1})
    assert "x-ignored-fields" not in plain.headers


def test_text_parts_and_the_developer_role(server, reference):
    from arcjax.entrypoints.chat_template import ChatTemplate

    system = [{"role": "system", "content": "Be\nbrief."},
              {"role": "user", "content": "def fibonacci(n):"}]
    text = ChatTemplate.from_dir(chat_model_dir()).render(system)
    ids = reference.tokenizer.encode(text, add_special_tokens=False)
    want = reference.generate([ids], _greedy(), use_tqdm=False)[0].text
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be"},
                                               {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "def fibonacci(n):"}]}]
    r = _client(server).chat.completions.create(model=MODEL, messages=parts, max_tokens=8,
                                                temperature=0)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)


def test_max_queued_requests_is_exact_under_concurrency(llm):
    """With the engine held between steps (nothing leaves the queue) and a limit of 3, of
    12 requests sent at once exactly 3 are queued (the check and the queueing are one
    step) and 9 get 429; once the engine steps again the 3 complete."""
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                          max_queued_requests=3)))
    results: list = []

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            for done in asyncio.as_completed([client.post(
                    running.url + "/v1/completions", json=dict(
                        model=MODEL, prompt=PROMPTS[1], max_tokens=2, temperature=0))
                    for _ in range(12)]):
                results.append(await done)

    sender = threading.Thread(target=lambda: asyncio.run(burst()))
    llm.engine._step_lock.acquire()  # no step runs: every accepted request stays queued
    try:
        sender.start()
        assert _wait_for(lambda: len(results) == 9, 60)
        assert [r.status_code for r in results] == [429] * 9
        assert all(r.json()["error"]["code"] == "queue_full" for r in results)
        assert llm.engine.stats()["waiting"] == 3
    finally:
        llm.engine._step_lock.release()
    sender.join(120)
    assert sorted(r.status_code for r in results) == [200] * 3 + [429] * 9
    running.stop()
    assert _wait_for(lambda: llm.engine.blocks_in_use() == 0 and llm.num_unfinished == 0)


def test_hostile_bodies_are_refused_cheaply(llm):
    """413 before parsing (declared or counted), a text prompt too long to ever fit is
    refused without tokenizing it, and parsing and tokenizing run off the event loop."""
    import arcjax.entrypoints.openai.serving_completion as proto  # where the endpoint parses

    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL,
                                                          max_request_bytes=4096)))
    try:
        big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}
        r = httpx.post(running.url + "/v1/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no content-length: counted as it arrives
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = httpx.post(running.url + "/v1/completions", content=chunked(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
    finally:
        running.stop()
    server = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL)))
    try:
        threads = []
        real = proto.parse_completion

        def spy(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return real(*args, **kwargs)

        proto.parse_completion = spy
        try:
            huge = {"model": MODEL, "prompt": "lorem ipsum " * 250_000, "max_tokens": 2}
            r = httpx.post(server.url + "/v1/completions", json=huge, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert "characters" in r.json()["error"]["message"]  # refused before tokenizing
        finally:
            proto.parse_completion = real
        assert threads and all(t.startswith("arcjax-prepare") for t in threads)
        ok = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "x", "max_tokens": 2, "stop": ["a"] * 16})
        assert ok.status_code == 200
    finally:
        server.stop()


def test_a_dead_engine_ends_streams_and_health_says_503(monkeypatch):
    """A failure the engine cannot recover from: the stream in flight ends with an
    `engine_dead` error event, /health and new requests answer 503."""
    dead_llm = AsyncLLM(chat_model_dir(), **GEOMETRY)
    running = RunningServer(OpenAIServer(dead_llm, ServeConfig(served_model_name=MODEL)))
    try:
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0,
                    ignore_eos=True, stream=True)
        with _sse_stream(running, body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            runner = dead_llm.engine.runner
            monkeypatch.setattr(runner, "collect", lambda h: (_ for _ in ()).throw(
                RuntimeError("device lost")))
            monkeypatch.setattr(runner, "reset_cache", lambda: (_ for _ in ()).throw(
                RuntimeError("no memory for a new KV cache")))
            rest = [line for line in lines if line.startswith("data: ")]
        # the error event, then [DONE] (as vLLM ends a failed stream)
        assert "engine_dead" in rest[-2] and "no memory" in rest[-2]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(running.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        again = httpx.post(running.url + "/v1/completions", timeout=10,
                           json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
    finally:
        running.stop()
        dead_llm.shutdown()
