"""The OpenAI-compatible server (arcjax serve), end to end over HTTP on 127.0.0.1.

The official `openai` client (sync and async), raw httpx for error statuses and
disconnects, prometheus_client's parser for /metrics. One engine (tiny Llama, byte-level
BPE, a chat template added) serves every in-process server here; a subprocess checks SIGTERM.
Every load is bounded in count and time.
"""


from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import tempfile
import threading
import time

from hf_models import tiny_model_with_tokenizer

ARCH = "LlamaForCausalLM"
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="xla", chunk_tile=16, max_num_batched_tokens=128)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + "
                 "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


@functools.lru_cache(maxsize=None)
def chat_model_dir() -> str:
    """The tiny byte-level-BPE Llama with a chat template added."""
    src = tiny_model_with_tokenizer(ARCH)
    path = tempfile.mkdtemp(prefix="arcjax-serve-")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


class RunningServer:
    """`build_server(api)` run in a daemon thread; `.url`, `.stop()`."""

    def __init__(self, api):
        from arcjax.entrypoints.serve import build_server

        self.api = api
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = build_server(api)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 30) -> None:
        self.uv.request_shutdown()
        self.thread.join(timeout)


# --- fixtures -------------------------------------------------------------------------------
import asyncio  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from arcjax import LLM, AsyncLLM, SamplingParams  # noqa: E402
from arcjax.entrypoints.serve import OpenAIServer, ServeConfig  # noqa: E402

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


# --- completions ----------------------------------------------------------------------------
def test_completions_equal_llm_generate(server, reference):
    expected = [o.text for o in reference.generate(PROMPTS, _greedy(), use_tqdm=False)]
    client = _client(server)
    for prompt, text in zip(PROMPTS, expected):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == text
        assert r.usage.completion_tokens == len(reference.tokenizer.encode(prompt + text)) - len(
            reference.tokenizer.encode(prompt)) or r.usage.completion_tokens <= 8
        assert r.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    ids = reference.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == expected[0]
    assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_streaming_sync_and_async(server, reference):
    expected = [o.text for o in reference.generate(PROMPTS, _greedy(), use_tqdm=False)]
    client = _client(server)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.completion_tokens == 8 or chunks[-1].usage.completion_tokens >= 1
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
    from arcjax.entrypoints.chat import ChatTemplate

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
