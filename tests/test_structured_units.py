"""Structured outputs, host side and sampling: constraint params, grammar compilation and
its cache, bitmask filling against a per-token check, the device mask against numpy, the
tool-call parsers (whole and streamed in any split), tool_choice translation, and the
OpenAI request fields. No engine: fast."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from arcjax import (InputError, RequestError, SamplingParams, StructuredOutputsError,
                    StructuredOutputsParams)
from arcjax.runtime.penalties import TokenTables
from arcjax.runtime.sampling import SamplingBatch, apply_bitmask, bitmask_words, sample_step
from arcjax.structured import GrammarCompiler, MaskFiller
from arcjax.entrypoints.openai.protocol import ChatCompletionRequest, ToolParam, parse_body
from arcjax.entrypoints.openai.request_params import parse_chat
from arcjax.entrypoints.openai.structured_fields import constraint_from_request
from arcjax.entrypoints.openai.tool_calls import (ToolCallStream, ToolsError, plan_tools,
                                                  template_messages)
from arcjax.entrypoints.openai.tool_parsers import PARSERS, get_parser, guess_parser
from arcjax.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolCall, ToolParser
from arcjax.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from arcjax.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from support.hf_models import tiny_model_with_tokenizer

VOCAB = 384
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return tokenizers.Tokenizer.from_file(tiny_model_with_tokenizer() + "/tokenizer.json")


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.to_str(), VOCAB, [EOS])


# --- params -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"json": {}, "regex": "a"}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"json_object": False}, "structured_outputs.json_object"),
    ({"regex": "a", "disable_any_whitespace": True}, "structured_outputs.regex"),
    ({"json": {}, "disable_any_whitespace": "yes"},
     "structured_outputs.disable_any_whitespace"),
])
def test_params_refuse_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(StructuredOutputsError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == field and isinstance(e.value, ValueError)


def test_params_canonical_key_and_sampling_params_coercion():
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.key() == b.key() != StructuredOutputsParams(json={"type": "object"}).key()
    p = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=("x", "y"))
    with pytest.raises(StructuredOutputsError) as e:
        SamplingParams(structured_outputs={"regexp": "a"})
    assert e.value.field == "structured_outputs.regexp"
    closed = StructuredOutputsParams(json={"type": "object", "properties": {
        "properties": {"type": "object", "properties": {}}}},
        disable_additional_properties=True).schema
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties"}  # a property's name is not a keyword


# --- grammar compilation, cache, masks --------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar"),
    ({"grammar": "root ::= ((("}, "structured_outputs.grammar"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "structured_outputs.json"),
    ({"json": {"$ref": "#/nope"}}, "structured_outputs.json"),
])
def test_a_grammar_that_cannot_compile_is_a_typed_error(compiler, kwargs, field):
    with pytest.raises(StructuredOutputsError) as e:
        compiler.matcher(StructuredOutputsParams(**kwargs))
    assert e.value.field == field


def test_templates_are_cached_by_text_and_copies_are_independent(compiler, tok):
    params = StructuredOutputsParams(choice=["yes", "no"])
    before = compiler.compiles
    a, b = compiler.matcher(params), compiler.matcher(StructuredOutputsParams(choice=("yes", "no")))
    assert compiler.compiles == before + 1
    for t in tok.encode("yes").ids:
        assert a.accept(t)
    assert a.is_stopped and not b.is_stopped and b.num_tokens == 0
    a.rollback(a.num_tokens)
    assert not a.is_stopped


def _allowed(mask_row: np.ndarray) -> np.ndarray:
    return np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


def test_mask_rows_allow_exactly_the_tokens_the_grammar_accepts(compiler):
    """Each filled row, checked token by token (`validate_tokens` on the same state);
    unconstrained rows stay all ones; a stopped grammar allows EOS only."""
    filler = MaskFiller(VOCAB)
    grammars = [compiler.matcher(StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]+")),
                compiler.matcher(StructuredOutputsParams(json={"type": "object", "properties": {
                    "k": {"enum": ["u", "v"]}}, "required": ["k"]}, disable_any_whitespace=True))]
    rng = np.random.default_rng(0)
    for _ in range(6):
        mask = filler.fill([(1, grammars[0]), (3, grammars[1])], size=4)
        assert mask.shape == (4, bitmask_words(VOCAB)) and mask.dtype == np.int32
        assert (mask[[0, 2]] == -1).all()
        for row, g in ((1, grammars[0]), (3, grammars[1])):
            allowed = _allowed(mask[row])
            assert allowed.any()
            for t in np.nonzero(allowed)[0][:40]:
                assert g.matcher.validate_tokens([int(t)]) == 1
            for t in rng.choice(np.nonzero(~allowed)[0], 20):
                assert g.matcher.validate_tokens([int(t)]) == 0
            if not g.is_stopped:
                assert g.accept(int(rng.choice(np.nonzero(allowed)[0])))
    done = compiler.matcher(StructuredOutputsParams(choice=["ab"]))
    for t in (compiler._tokenizer().tokenize_str("ab")):
        assert done.accept(t)
    assert np.nonzero(_allowed(filler.fill([(0, done)], 1)[0]))[0].tolist() == [EOS]


def test_device_mask_matches_numpy_and_masks_before_sampling():
    rng = np.random.default_rng(1)
    rows, vocab = 3, 70  # vocab not a multiple of 32: the last word is partial
    allowed = rng.random((rows, vocab)) < 0.3
    allowed[:, 5] = True
    padded = np.zeros((rows, bitmask_words(vocab) * 32), bool)
    padded[:, :vocab] = allowed
    mask = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    got = np.asarray(jax.jit(apply_bitmask)(logits, mask))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
    # In sample_step: greedy and random rows only ever pick allowed tokens; logprobs are of
    # the masked distribution; an unconstrained row is untouched.
    params = [SamplingParams(temperature=0, structured_outputs={"regex": "a"}),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, logprobs=2,
                             structured_outputs={"regex": "a"}),
              SamplingParams(temperature=0)]
    sp = SamplingBatch.build([(p, 0, 0) for p in params], rows)
    mask[2] = -1
    step = jax.jit(sample_step)
    tokens, lp, _ = step(jnp.asarray(logits), sp,
                         TokenTables.unbiased(jnp.zeros((1, vocab), jnp.int32)), mask)
    tokens = np.asarray(tokens)
    assert allowed[0, tokens[0]] and allowed[1, tokens[1]]
    assert tokens[0] == np.argmax(np.where(allowed[0], logits[0], -np.inf))
    assert tokens[2] == np.argmax(logits[2])
    lse = np.log(np.exp(logits[1][allowed[1]]).sum())
    np.testing.assert_allclose(float(lp.logprob[1]), logits[1, tokens[1]] - lse, rtol=1e-5)


# --- tool-call parsers -------------------------------------------------------------------
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
LLAMA = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "time", ' \
        '"parameters": {}}'
CALLS = (ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("time", "{}"))


@pytest.mark.parametrize("parser, text, content, calls", [
    (HermesToolParser(), HERMES, "Let me check.\n", CALLS),
    (HermesToolParser(), "no calls here <tool_", "no calls here <tool_", ()),
    (HermesToolParser(), "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", ()),
    (HermesToolParser(), '<tool_call>{"name": "time", "arguments": {}}', None, CALLS[1:]),
    (Llama3JsonToolParser(), LLAMA, None, CALLS),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "time", "arguments": {}}', None, CALLS[1:]),
    (Llama3JsonToolParser(), "The weather is {fine}.", "The weather is {fine}.", ()),
    (Llama3JsonToolParser(), '{"name": "time", "parameters": {}} and more', '{"name": "time", '
                             '"parameters": {}} and more', ()),
])
def test_parsers_split_content_and_calls(parser, text, content, calls):
    parsed = parser.parse(text, final=True)
    assert parsed.content == content and parsed.calls == calls


@given(st.data())
def test_streamed_parse_in_any_split_equals_the_whole(data):
    """Content deltas join to the whole parse's content (modulo whitespace-only content a
    stream may show before a call) and each call is emitted once, in order."""
    text, parser = data.draw(st.sampled_from([(HERMES, HermesToolParser()),
                                              (LLAMA, Llama3JsonToolParser()),
                                              ("plain text, <tool but no call", HermesToolParser()),
                                              ("plain {text}", Llama3JsonToolParser())]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    stream = ToolCallStream(parser)
    content, calls = "", []
    for end in cuts:
        new, items, _ = stream.update(text[:end], final=False)
        content += new
        calls += items
    new, items, _ = stream.update(text, final=True)
    content += new
    calls += items
    whole = parser.parse(text, final=True)
    assert content.strip() == (whole.content or "").strip()
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.calls]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(c["id"].startswith("call_") for c in calls)


def test_guess_parser_from_the_chat_template():
    assert guess_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert guess_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert guess_parser("{{ messages }}") is None and guess_parser(None) is None
    assert guess_parser("{{ '<|eom_id|>' }}") == "llama3_json"


def test_the_registry_builds_each_format_and_refuses_unknown_names():
    """Every format module's parser is registered under its own name, implements the one
    interface and shows itself in templates; an unknown name is a typed error naming the
    flag."""
    assert list(PARSERS) == ["qwen3_coder", "hermes", "mistral", "deepseek_v3", "openai",
                             "llama3_json", "pythonic"]
    for name, cls in PARSERS.items():
        assert issubclass(cls, ToolParser) and cls.name == name and cls.template_markers
        assert type(get_parser(name)) is cls
    with pytest.raises(RequestError) as e:
        get_parser("pythonic_v0")
    assert e.value.field == "tool_call_parser" and "hermes" in str(e.value)


# --- tool_choice -> constraint ------------------------------------------------------------
TOOL_DICTS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"]}}},
    {"type": "function", "function": {"name": "time"}}]
TOOLS = [ToolParam.model_validate(t) for t in TOOL_DICTS]  # as the request model holds them


def test_tool_choice_modes():
    assert plan_tools(None, None).mode == "none"
    assert plan_tools(TOOLS, None, parser="hermes").mode == "auto"
    assert plan_tools(TOOLS, "none").constraint is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint.schema == TOOL_DICTS[0]["function"]["parameters"]
    call = named.parser.parse('{"city": "Oslo"}')
    assert call.calls == (ToolCall("get_weather", '{"city": "Oslo"}'),) and call.content is None
    assert named.finish_reason("stop", call.calls) == "stop"
    required = plan_tools(TOOLS, "required", parallel_tool_calls=False)
    schema = required.constraint.schema
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    out = '[{"name": "time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]'
    parsed = required.parser.parse(out)
    assert [c.name for c in parsed.calls] == ["time", "get_weather"]
    assert required.finish_reason("stop", parsed.calls) == "tool_calls"
    assert required.parser.parse(out[:40], final=False).calls == (ToolCall("time", "{}"),)


@pytest.mark.parametrize("tools, choice, field", [
    ("x", None, "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([TOOL_DICTS[1], TOOL_DICTS[1]], "required", "tools[1].function.name"),
    (TOOL_DICTS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOL_DICTS, "sometimes", "tool_choice"),
    (TOOL_DICTS, "auto", "tool_choice"),  # no parser configured
])
def test_tool_fields_refused_naming_the_field(tools, choice, field):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools,
            "tool_choice": choice}
    with pytest.raises(InputError) as e:  # the request's path: its model, then the plan
        parse_chat(json.dumps(body).encode())
    assert e.value.field == field


def test_template_messages_decode_arguments():
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert out[1] == msgs[1] and msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'
    with pytest.raises(ToolsError) as e:
        template_messages([{"role": "assistant", "tool_calls": [
            {"function": {"name": "t", "arguments": "{bad"}}]}])
    assert e.value.field == "messages[0].tool_calls[0].function.arguments"


# --- request fields ---------------------------------------------------------------------
def constraint_from_body(body: dict, tool=None):
    """The constraint of a chat request with these fields (validated as the server does)."""
    req = parse_body(ChatCompletionRequest, json.dumps(
        {"messages": [{"role": "user", "content": "x"}], **body}).encode())
    return constraint_from_request(req, tool)


def test_request_fields_map_to_one_constraint():
    c = constraint_from_body({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}, "strict": True}},
        "structured_outputs": {"disable_any_whitespace": True}})
    assert c.source == "response_format" and c.params.disable_any_whitespace
    assert constraint_from_body({"response_format": {"type": "json_object"}}).params.json_object
    assert constraint_from_body({"response_format": {"type": "text"}}).params is None
    assert constraint_from_body({"guided_choice": ["a"]}).params.choice == ("a",)
    assert constraint_from_body({"structured_outputs": {"regex": "[ab]"}}).params.regex == "[ab]"
    tool = plan_tools(TOOLS, "required").constraint
    assert constraint_from_body({}, tool).params == tool
    for body, field in [({"guided_regex": "a", "guided_json": {}}, "guided_regex"),
                        ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                         "guided_regex"),
                        ({"response_format": {"type": "yaml"}}, "response_format.type"),
                        ({"guided_choice": "a"}, "guided_choice"),
                        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn")]:
        with pytest.raises(ValueError) as e:
            constraint_from_body(body)
        assert e.value.field == field, body
    with pytest.raises(ValueError) as e:
        constraint_from_body({"guided_json": {}}, tool)
    assert e.value.field == "tool_choice"


def test_regex_outputs_of_random_walks_match(compiler, tok):
    """Random walks through the mask always end in a full match (the property the engine
    tests check with a model)."""
    filler = MaskFiller(VOCAB)
    pattern = r"(yes|no)-[0-9]{1,3}"
    rng = np.random.default_rng(2)
    for _ in range(10):
        g = compiler.matcher(StructuredOutputsParams(regex=pattern))
        out = []
        while not g.is_stopped:
            allowed = np.nonzero(_allowed(filler.fill([(0, g)], 1)[0]))[0]
            t = int(rng.choice(allowed))
            if t == EOS:
                break
            assert g.accept(t)
            out.append(t)
        assert re.fullmatch(pattern, tok.decode(out)), tok.decode(out)
