"""Structured outputs in the engine, on tiny random-weight models: the grammar's mask alone
must make every output valid. JSON schemas validate (`jsonschema`), regex outputs match,
choice outputs are a choice, Lark grammars parse; under every policy, with overlapped
scheduling on and off, prefix caching, n > 1 and seeded sampling. Unconstrained requests
batched with constrained ones are token-for-token what they are alone. Failed steps roll
the grammar back; bad constraints are typed errors at submission.

Every schema and pattern here forces termination within max_tokens (bounded strings,
enums, no additional properties, the default bounded whitespace), so "stop" is the only
right finish reason.
"""

import json
import re

import jsonschema
import pytest

from arcjax import LLM, SamplingParams, StructuredOutputsError, StructuredOutputsParams
from support.engines import GEOMETRY as ENGINE_GEOMETRY
from support.engines import SCHEDULES
from support.hf_models import ARCHS, tiny_model_dir, tiny_model_with_tokenizer

# The geometry and schedules of support.engines: compiled steps are shared with the engine
# tests' (the structured tests add only the split forward/sampling executables).
GEOMETRY = {**ENGINE_GEOMETRY, **SCHEDULES[0]}
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Naïve café, 東京 and more", "return n"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},  # ASCII: bytes bounded too
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "fox"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 1}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)\."
CHOICES = ["alpha", "beta gamma", "δ"]
LARK = 'start: "f(" num ("," num)? ")"\nnum: /[0-9]{1,2}/'
MAX_TOKENS = 80  # schedule 3's 12 blocks of 8 hold prompt + 80


def _constraints():
    return [StructuredOutputsParams(json=SCHEMA),  # the default, bounded whitespace
            StructuredOutputsParams(regex=REGEX),
            StructuredOutputsParams(choice=CHOICES),
            StructuredOutputsParams(grammar=LARK)]


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"f\([0-9]{1,2}(,[0-9]{1,2})?\)", text), text


def _llm(arch="LlamaForCausalLM", **options):
    return LLM(tiny_model_with_tokenizer(arch), **{**GEOMETRY, **options})


def _run(llm, temperature=0.0, n=1, prompts=PROMPTS[:2]):
    """Every constraint on every prompt (greedy or seeded); checks each output."""
    params, kinds = [], []
    for c in _constraints():
        for i, _ in enumerate(prompts):
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature,
                                         seed=7 + i, n=n, structured_outputs=c))
            kinds.append(c.kind)
    outs = llm.generate(list(prompts) * len(_constraints()), params, use_tqdm=False)
    for out, kind in zip(outs, kinds):
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text, c.finish_reason)
            _check(kind, c.text)
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("schedule, overlap, prefix", [
    (0, False, True), (1, False, False), (2, False, True), (0, True, True), (3, True, False)])
def test_every_output_matches_its_constraint(schedule, overlap, prefix):
    """Every policy (schedule 3 preempts: 12 KV blocks), overlapped or serial, with and
    without prefix caching."""
    llm = _llm(async_scheduling=overlap, enable_prefix_caching=prefix, **SCHEDULES[schedule])
    _run(llm)
    if "num_kv_blocks" in SCHEDULES[schedule]:
        assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0


def test_overlapped_equals_serial_with_sampling_and_n():
    """Seeded sampling and n = 2: the overlapped loop (masks filled while the forward
    runs) gives exactly the serial loop's tokens."""
    runs = [_run(_llm(async_scheduling=on), temperature=0.8, n=2) for on in (False, True)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch", ARCHS[1:])
def test_other_architectures(arch):
    _run(_llm(arch, async_scheduling=False), prompts=PROMPTS[2:3])


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours():
    llm = _llm(async_scheduling=True)
    plain = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.9, seed=3, top_p=0.9, ignore_eos=True,
                            logprobs=2)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS, plain + [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=c)
        for c in _constraints()], use_tqdm=False)
    for a, b in zip(alone, mixed[:2]):
        assert a.token_ids == b.token_ids
    assert [e.keys() for e in alone[1].outputs[0].logprobs] == [
        e.keys() for e in mixed[1].outputs[0].logprobs]


def test_bad_constraints_are_refused_at_submission_and_nothing_is_disturbed():
    llm = _llm()
    for bad, field in [({"regex": "(open"}, "structured_outputs.regex"),
                       ({"json": {"type": "integer", "minimum": 3, "maximum": 1}},
                        "structured_outputs.json"),
                       ({"grammar": "start: nowhere"}, "structured_outputs.grammar")]:
        with pytest.raises(StructuredOutputsError) as e:
            llm.engine.add_request("hello", SamplingParams(structured_outputs=bad))
        assert e.value.field == field
    assert not llm.engine.has_unfinished()
    ids_only = LLM(tiny_model_dir("LlamaForCausalLM"), **GEOMETRY)  # no tokenizer.json
    with pytest.raises(StructuredOutputsError) as e:
        ids_only.engine.add_request([5, 6, 7], SamplingParams(structured_outputs={"regex": "a"}))
    assert e.value.field == "structured_outputs"


def test_a_failed_commit_rolls_the_grammar_back(monkeypatch):
    """The failed step's token leaves the matcher too (it follows the committed tokens)."""
    import scheduler

    llm = _llm(async_scheduling=False)
    rid = llm.engine.add_request(PROMPTS[0], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured_outputs={"regex": REGEX}))
    for _ in range(3):
        llm.engine.step()
    req = llm.engine.requests[rid]
    before = len(req.token_ids)
    assert req.grammar.num_tokens == before > 0
    real = scheduler.commit
    monkeypatch.setattr(scheduler, "commit", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("injected commit failure")))
    llm.engine.step()
    monkeypatch.setattr(scheduler, "commit", real)
    assert req.finish_reason == "error"
    assert req.grammar.num_tokens == len(req.token_ids) == before


def test_json_object_outputs_are_objects_or_valid_prefixes():
    """json_object cannot force termination: a finished output is a JSON object, one cut
    by max_tokens is a prefix the grammar accepts."""
    llm = _llm()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.7, seed=1,
                                                structured_outputs={"json_object": True}),
                        use_tqdm=False)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length" and o.text.lstrip().startswith("{")


@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_decoding_keeps_outputs_valid_and_unchanged(overlap):
    """n-gram drafts on constrained rows: drafts are cut to what the grammar accepts, each
    verified position gets the mask of the grammar after the drafts before it, and the
    matcher advances by every accepted token. Greedy and seeded outputs are valid and equal
    to those without speculation; drafts were verified and some accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": None}
    for temperature in (0.0, 0.8):
        plain = _run(_llm(async_scheduling=overlap), temperature=temperature)
        llm = _llm(async_scheduling=overlap, speculative_config=spec)
        assert _run(llm, temperature=temperature) == plain, temperature
        records = list(llm.engine.trace)
        assert sum(r.spec_draft_tokens for r in records) > 0
        assert sum(r.spec_accepted_tokens for r in records) > 0


def test_speculative_drafts_are_cut_to_the_grammar():
    """A draft model with the target's own weights drafts its unconstrained greedy tokens;
    under a choice constraint most of them are not allowed: the grammar cuts them (only
    drafts it accepts reach the step) and the outputs are still a choice."""
    spec = {"method": "draft_model", "model": tiny_model_with_tokenizer(),
            "num_speculative_tokens": 3, "disable_by_batch_size": None}
    llm = _llm(async_scheduling=False, speculative_config=spec)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].text in CHOICES and o.finish_reason == "stop" for o in outs)
    alone = _llm(async_scheduling=False).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
