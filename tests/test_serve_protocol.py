"""The pure core of the server: OpenAI request bodies -> prompts and SamplingParams (no I/O)."""

import json

import pytest

from arcjax import InputError, SamplingParams
from arcjax.outputs import RequestMetrics, RequestOutput
from arcjax.entrypoints.openai import request_params, responses
from arcjax.entrypoints.openai.chat_output import read_output
from arcjax.entrypoints.openai.response_logprobs import (ChoiceDelta, choice_logprobs,
                                                         completions_of)
from arcjax.entrypoints.openai.tool_calls import tool_calls_json


class proto:  # the request parsers over JSON bodies, as the server calls them
    @staticmethod
    def parse_completion(body, **kw):
        return request_params.parse_completion(json.dumps(body).encode(), **kw)

    @staticmethod
    def parse_chat(body, **kw):
        return request_params.parse_chat(json.dumps(body).encode(), **kw)


def completion_response(rid, created, model, outs, n=1, logprobs=None):
    """The completions body of these final outputs (as serving_completion builds it)."""
    choices = [responses.completion_choice(i * n + c.index, c.text,
                                           choice_logprobs(c, logprobs, chat=False),
                                           c.finish_reason)
               for i, o in enumerate(outs) for c in completions_of(o)]
    tokens = sum(len(c.token_ids) for o in outs for c in completions_of(o))
    return responses.completion_body(rid, created, model, choices, responses.usage(outs, tokens))


def chat_response(rid, created, model, outs, n=1, logprobs=None):
    """The chat body of one prompt's final output (as serving_chat builds it)."""
    plan = proto.parse_chat({"messages": [{"role": "user", "content": "x"}]}).tools
    choices = [responses.chat_choice(
        c.index, responses.chat_message(read_output(c, plan), tool_calls_json(
            read_output(c, plan).calls, plan.parser), True),
        choice_logprobs(c, logprobs, chat=True), c.finish_reason)
        for c in completions_of(outs[0])]
    tokens = sum(len(c.token_ids) for c in completions_of(outs[0]))
    return responses.chat_body(rid, created, model, choices, responses.usage(outs, tokens))


def test_completion_defaults_and_prompt_forms():
    p = proto.parse_completion({"model": "m", "prompt": "hi"})
    assert p.prompts == ("hi",) and p.params == SamplingParams(max_tokens=16)
    assert not p.stream and not p.include_usage and p.request.model == "m"
    assert proto.parse_completion({"prompt": [1, 2, 3]}).prompts == ((1, 2, 3),)
    assert proto.parse_completion({"prompt": ["a", "b"]}).prompts == ("a", "b")
    assert proto.parse_completion({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    assert proto.parse_completion({"prompt": ["a", [5]]}).prompts == ("a", (5,))


def test_sampling_fields_map_to_sampling_params():
    p = proto.parse_completion({"prompt": "x", "max_tokens": 5, "temperature": 0,
                                "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7,
                                "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True},
                                "user": "someone", "n": 1, "logprobs": None,
                                "presence_penalty": 0, "echo": False})
    assert p.params == SamplingParams(max_tokens=5, temperature=0, top_p=0.5, top_k=3,
                                      min_p=0.1, seed=7, stop=("\n",), stop_token_ids=(2,),
                                      ignore_eos=True)
    assert p.stream and p.include_usage


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": "2"}, "logprobs"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "n": 1025}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 3}, "stop_token_ids"),
    ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ("prompt", "body"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": [""]}, "bad_words"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncation_side": "right"}, "truncation_side"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "stream_interval": 4}, "stream_interval"),
    ({"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "cache_salt": "s3cret"}, "cache_salt"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
])
def test_completion_refusals_name_the_field(body, field):
    with pytest.raises(InputError) as e:
        proto.parse_completion(body)
    assert e.value.field == field


def test_chat_parsing():
    p = proto.parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}], "max_completion_tokens": 4})
    assert p.messages == ({"role": "user", "content": "a\nb"},  # parts joined as vLLM
                          {"role": "assistant", "content": ""})
    assert p.params.max_tokens == 4 and p.max_tokens_given
    assert p.max_tokens_field == "max_completion_tokens"
    p = proto.parse_chat({"messages": [{"role": "developer", "content": "x"}],
                          "prompt": "x", "zeta": 1})
    assert not p.max_tokens_given and p.request.add_generation_prompt
    assert p.messages == ({"role": "system", "content": "x"},)  # developer renders as system
    assert p.ignored == ("prompt", "zeta")  # not chat fields: accepted and ignored
    for body, field in [({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                        ({"messages": [{"role": "assistant", "content": "x",
                                        "tool_calls": [{}]}]}, "messages[0].tool_calls[0]"),
                        ({"messages": [{"role": "user", "content": "x"}],
                          "tool_choice": "auto"}, "tool_choice"),
                        ({"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": -1}, "max_completion_tokens")]:
        with pytest.raises(InputError) as e:
            proto.parse_chat(body)
        assert e.value.field == field


def _out(text, ids, prompt_ids, reason, cached=0):
    m = RequestMetrics(0.0, 0.0, 0.1, (0.1,), 0.2)
    return RequestOutput("r", None, tuple(prompt_ids), text, tuple(ids), True, reason, m,
                         num_cached_tokens=cached)


def test_response_shapes():
    outs = [_out("ab", [1, 2], [5, 6, 7], "length", cached=2), _out("c", [3], [8], "stop")]
    r = completion_response("cmpl-1", 7, "m", outs)
    assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 2}}
    assert [c["text"] for c in r["choices"]] == ["ab", "c"]
    assert r["choices"][1]["finish_reason"] == "stop" and r["object"] == "text_completion"
    c = chat_response("chatcmpl-1", 7, "m", outs[:1])
    assert c["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert responses.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert responses.error_body("bad", "invalid_request_error", "n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}


def test_cli_flags_mirror_engine_options(monkeypatch):
    from arcjax.engine.engine_config import EngineConfig
    from arcjax.entrypoints.cli import parse_serve

    monkeypatch.setenv("ARCJAX_API_KEY", "from-env")
    monkeypatch.setenv("ARC_PREFILL_MAX_SEQS", "4")
    monkeypatch.setenv("ARC_PREFILL_FLOOR_STEPS", "2")
    cmd = parse_serve(["serve", "/some/model", "--port", "9000", "--policy", "prefill_first",
                       "--max-num-batched-tokens", "512", "--prefill-floor-steps", "0",
                       "--dtype", "float32", "--max-queued-requests", "5"])
    assert cmd.model_dir == "/some/model" and cmd.config.port == 9000
    assert cmd.config.host == "127.0.0.1" and cmd.config.api_key == "from-env"
    assert cmd.config.max_queued_requests == 5
    assert cmd.engine_options == {"policy": "prefill_first", "max_num_batched_tokens": 512,
                                  "prefill_floor_steps": 0, "dtype": "float32"}
    cfg = EngineConfig.from_options(None, **cmd.engine_options)
    assert cfg.prefill_max_seqs == 4  # from the environment
    assert cfg.prefill_floor_steps == 0  # the flag wins over ARC_PREFILL_FLOOR_STEPS
    assert parse_serve(["serve", "--api-key", "k"]).config.api_key == "k"
    assert parse_serve(["serve"]).model_dir is None


def test_n_and_logprobs_parsing():
    p = proto.parse_completion({"prompt": "x", "n": 3, "logprobs": 2})
    assert p.params.n == 3 and p.params.logprobs == 2
    assert proto.parse_completion({"prompt": "x", "logprobs": False}).params.logprobs is None
    chat = {"messages": [{"role": "user", "content": "x"}]}
    p = proto.parse_chat({**chat, "n": 2, "logprobs": True, "top_logprobs": 3})
    assert p.params.n == 2 and p.params.logprobs == 3
    assert proto.parse_chat({**chat, "logprobs": True}).params.logprobs == 0
    assert proto.parse_chat({**chat, "logprobs": False}).params.logprobs is None
    for body, field in [({**chat, "top_logprobs": 2}, "top_logprobs"),
                        ({**chat, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({**chat, "logprobs": 1}, "logprobs"),
                        ({**chat, "n": 0}, "n")]:
        with pytest.raises(InputError) as e:
            proto.parse_chat(body)
        assert e.value.field == field


def test_choices_and_logprob_shapes():
    from arcjax.outputs import CompletionOutput, Logprob

    # position 0: sampled 7 (rank 1) among top 2; position 1: sampled 9 outside the top 2
    e0 = {7: Logprob(-0.1, 1, "a"), 8: Logprob(-2.0, 2, "b")}
    e1 = {9: Logprob(-3.0, 5, "é"), 4: Logprob(-0.5, 1, "c"), 5: Logprob(-1.0, 2, "d")}
    m = RequestMetrics(0.0, 0.0, 0.1, (0.1,), 0.2)
    outs = (CompletionOutput(0, "aé", (7, 9), -3.1, [e0, e1], "length"),
            CompletionOutput(1, "b", (8,), -2.0, [{8: Logprob(-2.0, 2, "b"),
                                                    7: Logprob(-0.1, 1, "a")}], "stop"))
    o = RequestOutput("r", None, (1, 2), "aé", (7, 9), True, "length", m, outputs=outs)
    r = completion_response("c", 1, "m", [o, o], n=2, logprobs=2)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == ["aé", "b", "aé", "b"]
    assert r["usage"]["completion_tokens"] == 6 and r["usage"]["prompt_tokens"] == 4
    lp0 = r["choices"][0]["logprobs"]
    assert lp0["tokens"] == ["a", "é"] and lp0["token_logprobs"] == [-0.1, -3.0]
    assert lp0["text_offset"] == [0, 1]
    assert [list(t.items()) for t in lp0["top_logprobs"]] == [
        [("a", -0.1), ("b", -2.0)], [("c", -0.5), ("d", -1.0), ("é", -3.0)]]
    c = chat_response("c", 1, "m", [o], n=2, logprobs=1)
    content = c["choices"][0]["logprobs"]["content"]
    assert content[1] == {"token": "é", "logprob": -3.0, "bytes": [0xC3, 0xA9],
                          "top_logprobs": [{"token": "c", "logprob": -0.5, "bytes": [99]}]}
    assert c["choices"][1]["message"]["content"] == "b"
    assert completion_response("c", 1, "m", [o])["choices"][0]["logprobs"] is None


def test_choice_stream_deltas():
    from arcjax.outputs import CompletionOutput, Logprob
    from arcjax.entrypoints.openai.response_logprobs import ChoiceStream

    e = {t: {t: Logprob(-float(t), 1, s)} for t, s in [(1, "ab"), (2, "\ufffd"), (3, "é")]}
    s = ChoiceStream(0, chat=False)  # it reads DELTA outputs: what is new in each
    assert s.delta(0, CompletionOutput(0, "ab", (1,), -1.0, [e[1]], None)) == ChoiceDelta(
        0, "ab", None, None, (1,),
        {"tokens": ["ab"], "token_logprobs": [-1.0], "top_logprobs": [{"ab": -1.0}],
         "text_offset": [0]}, None)
    # a token whose text is held back sends nothing; it rides with the next chunk
    assert s.delta(0, CompletionOutput(0, "", (2,), -3.0, [e[2]], None)) is None
    assert s.delta(1, CompletionOutput(1, "", (), 0.0, [], None)) is None  # another choice
    d = s.delta(0, CompletionOutput(0, "é", (3,), -6.0, [e[3]], "length"))
    text, lps, reason = d.text, d.logprobs, d.finish_reason
    assert (text, reason) == ("é", "length") and d.token_ids == (2, 3)
    assert lps["tokens"] == ["\ufffd", "é"] and lps["text_offset"] == [2, 3]
    assert s.delta(0, CompletionOutput(0, "", (), -6.0, None, "length")) is None  # done
    assert s.tokens == {0: 3, 1: 0}
    plain = ChoiceStream(None, chat=True)  # logprobs off: text deltas only
    d = plain.delta(0, CompletionOutput(0, "x", (1,), None, None, "stop"))
    assert (d.text, d.logprobs, d.finish_reason) == ("x", None, "stop")


def test_unknown_fields_are_listed_and_stop_strings_are_capped():
    p = proto.parse_completion({"prompt": "x", "b_field": 1, "a_field": {"x": [1]},
                                "user": "u"})
    assert p.ignored == ("a_field", "b_field")  # `user` is known (and ignored silently)
    assert proto.parse_completion({"prompt": "x"}).ignored == ()
    assert len(proto.parse_completion({"prompt": "x", "stop": ["s"] * 16}).params.stop) == 16
    with pytest.raises(InputError) as e:
        proto.parse_completion({"prompt": "x", "stop": ["s"] * 17})
    assert e.value.field == "stop" and e.value.limit == 16
    with pytest.raises(InputError) as e:
        proto.parse_chat({"messages": [{"role": "user", "content": "x"}],
                          "stop": ["s", "t", "u"]}, max_stop_strings=2)
    assert e.value.field == "stop" and e.value.limit == 2
    with pytest.raises(InputError) as e:  # known but not supported: still refused by name
        proto.parse_completion({"prompt": "x", "use_beam_search": True, "unknown": 1})
    assert e.value.field == "use_beam_search"


def test_generation_config_defaults(tmp_path):
    from arcjax.entrypoints.openai.serving_models import generation_defaults
    from arcjax.errors import EngineConfigError

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 7,
         "do_sample": True, "eos_token_id": 2}))
    d = generation_defaults("auto", tmp_path)
    assert dict(d.values) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    assert d.max_tokens == 7 and generation_defaults("vllm", tmp_path).values == {}
    p = proto.parse_completion({"prompt": "x", "top_p": 0.5}, defaults=d)
    assert (p.params.temperature, p.params.top_p, p.params.repetition_penalty) == (0.6, 0.5, 1.1)
    assert generation_defaults("auto", tmp_path / "none").values == {}  # no file: OpenAI's
    with pytest.raises(EngineConfigError) as e:
        generation_defaults(str(tmp_path / "none"), None)
    assert e.value.field == "generation_config"


def test_vllm_flag_names_are_accepted_or_refused_by_name(capsys):
    from arcjax.entrypoints.cli import parse_serve

    cmd = parse_serve(["serve", "/m", "--gpu-memory-utilization", "0.9", "--max-model-len", "4k",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--enable-prefix-caching", "--trust-remote-code", "-tp", "1",
                       "--dtype", "half", "-pp", "1", "--served-model-name", "a", "b",
                       "--reasoning-parser", "qwen3", "--no-async-scheduling",
                       "--generation-config", "vllm", "--enable-chunked-prefill",
                       "--kv-cache-dtype", "fp8_e4m3", "--uvicorn-log-level", "info"])
    assert cmd.model_dir == "/m" and cmd.engine_options == {
        "max_model_len": 4000, "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1,
        "dtype": "float16", "async_scheduling": False, "reasoning_parser": "qwen3",
        "kv_cache_dtype": "fp8", "enable_prefix_caching": True}
    c = cmd.config
    assert c.served_model_names == ("a", "b") and c.enable_auto_tool_choice
    assert (c.tool_call_parser, c.generation_config, c.log_level) == ("hermes", "vllm", "info")
    assert parse_serve(["serve", "--model", "/x", "--max-model-len", "4K",
                        "--dtype", "auto"]).engine_options == {"max_model_len": 4096}
    for argv, name in ((["--swap-space", "4"], "--swap-space"),
                       (["--pipeline-parallel-size=2"], "--pipeline-parallel-size"),
                       (["--cpu-offload-gb", "4"], "--cpu-offload-gb"),
                       (["--enable-chunked-prefill", "false"], "--enable-chunked-prefill"),
                       (["--no-such-flag"], "--no-such-flag"),
                       (["--enable-prefix"], "--enable-prefix")):  # no abbreviations
        with pytest.raises(SystemExit):
            parse_serve(["serve", *argv])
        assert name in capsys.readouterr().err
