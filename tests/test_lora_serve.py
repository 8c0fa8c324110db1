"""LoRA adapters through the OpenAI-compatible server, over HTTP on 127.0.0.1 with the
`openai` client: adapters from `--lora-modules` listed in /v1/models (with `parent` and
`root`), `model=<adapter>` on completions and chat giving transformers + PEFT's greedy
tokens (requests for several adapters and the base model in flight together, more
adapters than device slots) and on responses (chat's text), runtime load / unload
(vLLM's endpoints and bodies, refused unless allowed), typed 400 / 404 errors,
per-adapter metrics, and `arcjax serve`'s flags. One engine serves every server here;
the chat model is the tiny Llama (the same weights) with a tokenizer and a chat
template, so adapters and references are tests/test_lora_engine.py's kind."""

from __future__ import annotations

import asyncio
import functools

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arcjax import AsyncLLM
from arcjax.entrypoints.cli import parse_serve
from arcjax.entrypoints.openai.api_server import OpenAIServer, ServeConfig
from arcjax.entrypoints.openai.lora_modules import (LoRAModulePath, parse_lora_module,
                                                    runtime_updating_allowed)
from arcjax.errors import ConfigError, LoRAAdapterError
from support.engines import GEOMETRY
from support.hf_models import tiny_model_dir
from support.lora_adapters import (ATTENTION_TARGETS, LORA_OPTIONS, peft_adapter_dir,
                                   peft_greedy)
from support.running_server import RunningServer, chat_model_dir

MODEL = "tiny"
MAX_TOKENS = 6
# rank 4 and 16 on all seven projections, rank 8 on attention only; two device slots
ADAPTERS = {"r4": dict(rank=4, seed=40), "r16": dict(rank=16, seed=41),
            "attn8": dict(rank=8, seed=42, targets=ATTENTION_TARGETS)}
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})


@functools.lru_cache(maxsize=None)
def _adapter(name: str) -> str:
    spec = dict(ADAPTERS.get(name) or {"rank": 4, "seed": 43})
    if name == "wide":
        spec = {"rank": 32, "seed": 44}
    return peft_adapter_dir("LlamaForCausalLM", **spec)


def _prompts() -> list[list[int]]:
    rs = np.random.RandomState(7)
    return [rs.randint(3, 384, n).tolist() for n in (3, 5, 4, 6)]


def _expected(name: str | None, ids) -> list[int]:
    return peft_greedy(tiny_model_dir(), _adapter(name) if name else None, ids, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(chat_model_dir(), **{**GEOMETRY, **LORA_OPTIONS, "max_cpu_loras": 4})
    yield llm
    llm.shutdown()


def _modules() -> tuple[LoRAModulePath, ...]:
    """vLLM's two spellings: name=path and the JSON form with base_model_name."""
    return (parse_lora_module(f"r4={_adapter('r4')}"),
            parse_lora_module(f'{{"name": "r16", "path": "{_adapter("r16")}", '
                              f'"base_model_name": "{MODEL}"}}'),
            LoRAModulePath("attn8", _adapter("attn8")))


@pytest.fixture(scope="module")
def server(llm):
    running = RunningServer(OpenAIServer(llm, ServeConfig(
        served_model_name=MODEL, lora_modules=_modules(), allow_runtime_lora_updating=True)))
    yield running
    running.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items())
                             if k != "model_name"): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_models_list_the_base_and_every_adapter(server):
    client = _client(server)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:4] == [MODEL, "r4", "r16", "attn8"]
    assert cards[MODEL].parent is None
    for name in ADAPTERS:
        assert (cards[name].parent, cards[name].root) == (MODEL, _adapter(name))
    assert client.models.retrieve("attn8").root == _adapter("attn8")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_model_field_selects_the_adapter_and_equals_peft(server):
    """Every prompt for the base model and each adapter, all in flight at once (three
    adapters in two slots: they swap), completions and chat."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                max_retries=0, timeout=300)
    names = [MODEL, *ADAPTERS]
    cases = list(zip(names, _prompts()))

    async def run():
        return await asyncio.gather(*(client.completions.create(model=name, prompt=ids,
                                                                **GREEDY)
                                      for name, ids in cases))

    swaps = _metrics(server)["arcjax_lora_slot_swaps_total"]
    outs = asyncio.run(run())
    want = [_expected(None if name == MODEL else name, ids) for name, ids in cases]
    assert len({tuple(w) for w in want}) == len(want), "the adapters change nothing"
    assert [o.choices[0].token_ids for o in outs] == want
    assert [o.model for o in outs] == [name for name, _ in cases]
    assert _metrics(server)["arcjax_lora_slot_swaps_total"] - swaps >= 1

    chat = _client(server).chat.completions.create(
        model="r16", messages=[{"role": "user", "content": "fox"}], **GREEDY)
    assert chat.model == "r16"
    prompt = chat.model_extra["prompt_token_ids"]
    assert chat.choices[0].token_ids == _expected("r16", prompt)


def test_responses_run_the_adapter_their_model_names(server):
    """/v1/responses goes through the chat path: its text is chat's for the same adapter."""
    client = _client(server)
    chat = client.chat.completions.create(model="attn8", messages=[
        {"role": "user", "content": "fox"}], max_tokens=MAX_TOKENS, temperature=0)
    resp = client.responses.create(model="attn8", input="fox", max_output_tokens=MAX_TOKENS,
                                   temperature=0)
    assert resp.model == "attn8"
    assert resp.output_text == chat.choices[0].message.content


def test_unknown_models_are_404_and_metrics_count_requests_per_adapter(server):
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=[5, 6, 7], max_tokens=2)
    assert e.value.body["param"] == "model" and "r4" in e.value.body["message"]
    before = _metrics(server).get("arcjax_lora_requests_total[lora_name=attn8]", 0)
    client.completions.create(model="attn8", prompt=[5, 6, 7], max_tokens=2)
    after = _metrics(server)
    assert after["arcjax_lora_requests_total[lora_name=attn8]"] == before + 1
    assert after["arcjax_lora_slots_total"] == 2
    assert after["arcjax_lora_adapter_loads_total"] >= 3


def test_runtime_load_and_unload(server):
    client = _client(server)
    ids = _prompts()[1]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late",
                                                 "lora_path": _adapter("late")})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert "late" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="late", prompt=ids, **GREEDY)
    assert out.choices[0].token_ids == _expected("late", ids)

    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late",
                                                 "lora_path": _adapter("late")})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "gone",
                                                 "lora_path": _adapter("late") + "-missing"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "lora_path")
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "wide",
                                                 "lora_path": _adapter("wide")})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "lora_path"
    assert "max_lora_rank 16" in err["message"] and "'wide'" in err["message"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path")
    assert {"gone", "wide", "x"}.isdisjoint(m.id for m in client.models.list().data)

    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' removed "
                                            "successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=ids, max_tokens=2)
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "lora_name")


def test_unloading_an_adapter_in_use_finishes_its_requests_first(server):
    """A stream of the adapter is running when it is unloaded: it ends normally with the
    adapter's tokens; a new request for it is refused."""
    ids, n = _prompts()[3], 16
    _post(server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": _adapter("r4")})
    client = _client(server)
    stream = client.completions.create(model="busy", prompt=ids, stream=True, max_tokens=n,
                                       temperature=0, extra_body={"ignore_eos": True,
                                                                  "return_token_ids": True})
    tokens, finish = [], None
    for i, chunk in enumerate(stream):
        if i == 0:
            r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "busy"})
            assert r.status_code == 200
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="busy", prompt=ids, max_tokens=1)
        tokens += chunk.choices[0].token_ids or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    assert tokens == peft_greedy(tiny_model_dir(), _adapter("r4"), ids, n)


def test_runtime_updates_are_refused_unless_allowed(llm):
    running = RunningServer(OpenAIServer(llm, ServeConfig(served_model_name=MODEL)))
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = _post(running, path, {"lora_name": "r", "lora_path": _adapter("r4")})
            err = r.json()["error"]
            assert (r.status_code, err["code"]) == (404, "runtime_lora_updating_disabled")
        assert [m.id for m in _client(running).models.list().data] == [MODEL]
    finally:
        running.stop()
    assert runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})


def test_bad_lora_modules_are_refused_at_start(llm):
    def build(*modules):
        return OpenAIServer(llm, ServeConfig(served_model_name=MODEL, lora_modules=modules))

    with pytest.raises(ConfigError) as e:
        build(LoRAModulePath("a", _adapter("r4"), base_model_name="other"))
    assert e.value.field == "lora_modules.base_model_name"
    with pytest.raises(ConfigError) as e:
        build(LoRAModulePath(MODEL, _adapter("r4")))
    assert e.value.field == "lora_modules.name"
    with pytest.raises(LoRAAdapterError) as e:
        build(LoRAModulePath("wide", _adapter("wide")))
    assert (e.value.adapter, e.value.field) == ("wide", "adapter_config.json:r")
    with pytest.raises(ConfigError) as e:
        parse_lora_module('{"name": "a", "path": "/p", "rank": 4}')
    assert e.value.field == "lora_modules.rank"
    with pytest.raises(ConfigError):
        parse_lora_module("{not json")


def test_lora_modules_need_enable_lora():
    base = AsyncLLM(chat_model_dir(), **GEOMETRY)
    try:
        with pytest.raises(ConfigError) as e:
            OpenAIServer(base, ServeConfig(lora_modules=(LoRAModulePath("a", "/p"),)))
        assert e.value.field == "lora_modules"
    finally:
        base.shutdown()


def test_serve_flags():
    cmd = parse_serve(["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank",
                       "8", "--max-cpu-loras", "5", "--allow-runtime-lora-updating",
                       "--lora-modules", "a=/x",
                       '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert cmd.engine_options == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8,
                                  "max_cpu_loras": 5}
    assert cmd.config.lora_modules == (LoRAModulePath("a", "/x"),
                                       LoRAModulePath("b", "/y", "m"))
    assert cmd.config.allow_runtime_lora_updating
    assert not parse_serve(["serve", "m"]).config.allow_runtime_lora_updating
    with pytest.raises(SystemExit):
        parse_serve(["serve", "m", "--lora-modules", '{"name": "b"}'])
