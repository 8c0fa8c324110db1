"""Speculative decoding end to end (n-gram and draft-model proposers) on tiny models.

Exactness: greedy tokens equal transformers' (hence speculation off's, tests/test_engine.py)
for every test architecture, every policy, overlapped scheduling on and off, prefix caching,
KV pressure (preemption), both proposers, a draft model that proposes garbage; seeded sampling
with every sampling feature gives the tokens of speculation off, token for token, and the
distribution of sampled tokens under independent seeds passes a chi-square test of stated
power. Tensor parallelism runs in tests/test_parallel.py's subprocess (forced CPU devices).
Also: per-request and per-step counts, the batch-size cut-off, /metrics counters, and typed
errors for configurations that cannot work, raised before any weights load.
"""

import dataclasses

import numpy as np
import pytest

import arcjax
from arcjax import SamplingParams
from arcjax.engine.trace import summarize
from arcjax.errors import EngineConfigError
from support.engines import GEOMETRY, GREEDY, engine_prompts, expected_greedy, tiny_llm
from support.hf_models import ARCHS, hf_greedy, tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None}  # on for whole batches
SCHEDULE = dict(chunk_tile=16, max_num_batched_tokens=64)  # support.engines.SCHEDULES[0]'s


def _spec_llm(arch="LlamaForCausalLM", spec=NGRAM, **options):
    return tiny_llm(arch, speculative_config=spec, **{**SCHEDULE, **options})


def _generate(llm, params=GREEDY, prompts=None):
    outs = llm.generate(engine_prompts() if prompts is None else prompts, params, use_tqdm=False)
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    return outs


def _spec(llm) -> dict:
    return summarize(list(llm.engine.trace), 1.0)["spec_decode"]


def _tokens(outs):
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("policy", ["token_budget", "alternate", "prefill_first"])
def test_every_policy_overlapped_or_not_equals_transformers(policy):
    for overlapped in (False, True):
        llm = _spec_llm(policy=policy, async_scheduling=overlapped)
        outs = _generate(llm)
        assert _tokens(outs) == expected_greedy()
        spec = _spec(llm)
        assert spec["num_accepted_tokens"] > 0 and spec["num_draft_tokens"] > spec[
            "num_accepted_tokens"], "drafts both accepted and rejected"
        # per-request counts add up to the trace's
        assert sum(o.metrics.num_draft_tokens for o in outs) == spec["num_draft_tokens"]
        assert sum(o.metrics.num_accepted_tokens for o in outs) == spec["num_accepted_tokens"]


def test_kv_pressure_preemption_and_prefix_caching():
    """8 prompts of 90 tokens + 16 outputs need 848 KV slots of the 768: sequences are
    preempted and recompute (their drafts take only blocks left free); with prefix caching on
    and off (the same compiled steps as the other tests: same geometry)."""
    rs = np.random.RandomState(5)
    prompts = [rs.randint(3, 384, 90).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [hf_greedy(tiny_model_dir("LlamaForCausalLM"), p, 16) for p in prompts]
    for caching in (False, True):
        llm = _spec_llm(enable_prefix_caching=caching)
        assert _tokens(_generate(llm, params, prompts)) == want
        assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0
        assert _spec(llm)["num_drafts"] > 0


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "LlamaForCausalLM"])
def test_other_architectures(arch):
    """One request (its verification rows exercise each architecture's layers; batching is
    the Llama tests' business): one verification bucket to compile per model."""
    prompt = engine_prompts()[1]
    llm = _spec_llm(arch)
    assert _tokens(_generate(llm, prompts=[prompt])) == [
        hf_greedy(tiny_model_dir(arch), prompt, GREEDY.max_tokens)]
    assert _spec(llm)["num_drafts"] > 0


def test_draft_model_same_weights_accepts_everything_and_garbage_draft_stays_exact():
    same = {"method": "draft_model", "model": tiny_model_dir("LlamaForCausalLM"),
            "num_speculative_tokens": 3, "disable_by_batch_size": None}
    garbage = dict(same, model=tiny_model_dir("LlamaForCausalLM", seed=1))
    chosen = [0, 3, 5]  # 3, 9 and 1 tokens: the draft model's catch-up is one small step
    prompts, want = [engine_prompts()[i] for i in chosen], [expected_greedy()[i] for i in chosen]
    for overlapped in (False, True):
        llm = _spec_llm(spec=same, async_scheduling=overlapped)
        assert _tokens(_generate(llm, prompts=prompts)) == want
        spec = _spec(llm)
        assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] > 2
    llm = _spec_llm(spec=garbage, async_scheduling=False)
    assert _tokens(_generate(llm, prompts=prompts)) == want
    spec = _spec(llm)
    assert spec["num_draft_tokens"] > 10 and spec["acceptance_rate"] < 0.2


def test_seeded_sampling_with_every_feature_equals_speculation_off():
    """Position j of a verified row draws with the key of the (made + j)-th token and counts
    the drafts before it in its penalties: outputs are those of plain decoding."""
    params = [SamplingParams(max_tokens=8, temperature=0.8 + 0.1 * (i % 3), top_k=(0, 6)[i % 2],
                             top_p=(1.0, 0.9)[i % 2], min_p=0.05 * (i % 2), seed=40 + i,
                             presence_penalty=0.3 * (i % 2), frequency_penalty=0.2,
                             repetition_penalty=(1.0, 1.2)[i % 2], min_tokens=2,
                             stop_token_ids=(7,), logprobs=2, ignore_eos=True, n=1 + (i == 1))
              for i in range(len(engine_prompts()))]

    def run(llm):
        outs = _generate(llm, params)
        return ([[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs],
                [[{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs]
                 for o in outs])

    spec_llm = _spec_llm()
    (got, got_lp), (want, want_lp) = run(spec_llm), run(tiny_llm(**SCHEDULE))
    assert _spec(spec_llm)["num_drafts"] > 0
    assert got == want
    for a, b in zip(got_lp, want_lp):  # computed in a verification row or a decode row
        assert [e.keys() for e in a] == [e.keys() for e in b]
        assert np.allclose([v for e in a for v in e.values()],
                           [v for e in b for v in e.values()], atol=1e-4)


def test_sampled_distribution_matches_speculation_off():
    """The first K = 3 tokens of N = 300 requests per arm (top_k = 2, temperature 1: 8
    possible sequences; drafts from the target's own weights, greedy, so the target accepts
    each with probability p(draft) and rejects it otherwise), independent seeds per arm:
    chi-square test of homogeneity on the joint (t1, t2, t3), cells with an expected count
    under 5 pooled, alpha = 0.001. Power: against a shift of Cohen's w = 0.3 (a 'medium'
    effect) at this N and degrees of freedom it is computed below and asserted >= 0.9. (With
    equal seeds the two arms are identical: see the test above.)"""
    from scipy import stats

    n, alpha = 300, 1e-3
    prompt = engine_prompts()[5]  # one token: the draft model's catch-up is one token per row
    draft = {"method": "draft_model", "model": tiny_model_dir("LlamaForCausalLM"),
             "num_speculative_tokens": 3, "disable_by_batch_size": None}

    def draws(seed0, spec):
        llm = _spec_llm(spec=draft) if spec else tiny_llm(**SCHEDULE)
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=seed0 + i,
                                 ignore_eos=True) for i in range(n)]
        outs = _generate(llm, params, prompts=[prompt] * n)
        return [tuple(o.token_ids) for o in outs], llm

    off, _ = draws(0, False)
    on, llm = draws(10_000, True)
    spec = _spec(llm)
    assert spec["num_draft_tokens"] >= n and 0.1 < spec["acceptance_rate"] < 0.9
    cells = sorted(set(off) | set(on))
    table = np.array([[sample.count(c) for c in cells] for sample in (off, on)])
    expected = table.sum(0) / 2
    big = expected >= 5
    if (~big).any():
        table = np.column_stack([table[:, big], table[:, ~big].sum(1)])
    _, p_value, dof, _ = stats.chi2_contingency(table)
    assert p_value > alpha, (p_value, table)
    critical = stats.chi2.ppf(1 - alpha, dof)
    power = stats.ncx2.sf(critical, dof, 2 * n * 0.3 ** 2)
    assert power >= 0.9, power


def test_cut_off_by_batch_size():
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(len(engine_prompts()))]
    llm = _spec_llm(spec=dict(NGRAM, disable_by_batch_size=2))
    outs = _generate(llm, params)
    assert all(list(o.token_ids) == e[:4 + 3 * i] for i, (o, e) in enumerate(zip(
        outs, [hf for hf in _expected_long()])))
    drafting = [r for r in llm.engine.trace if r.spec_drafts]
    assert drafting and all(r.num_seqs <= 2 for r in drafting)


def _expected_long():
    return [hf_greedy(tiny_model_dir("LlamaForCausalLM"), p, 4 + 3 * i)
            for i, p in enumerate(engine_prompts())]


def test_async_llm_and_metrics_counters():
    import asyncio

    from prometheus_client import generate_latest

    from arcjax.entrypoints.openai.server_metrics import ServerMetrics

    async def run(llm):
        last = None
        async for out in llm.generate(engine_prompts()[1], GREEDY, request_id="a"):
            last = out
        return last

    llm = arcjax.AsyncLLM(tiny_model_dir("LlamaForCausalLM"), speculative_config=NGRAM,
                          **{**GEOMETRY, **SCHEDULE})
    metrics = ServerMetrics(llm.engine, "m")
    llm.engine.trace_sink = metrics.on_step
    try:
        out = asyncio.run(run(llm))
    finally:
        llm.shutdown()
    assert list(out.token_ids) == expected_greedy()[1]
    text = generate_latest(metrics.registry).decode()
    drafts = sum(r.spec_drafts for r in llm.engine.trace)
    assert drafts > 0
    assert f'arcjax_spec_decode_num_drafts_total{{model_name="m"}} {float(drafts)}' in text
    for name in ("num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert f"arcjax_spec_decode_{name}_total" in text


@pytest.mark.parametrize("spec,field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33},
     "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
])
def test_bad_configs_are_typed_errors(spec, field):
    with pytest.raises(EngineConfigError) as e:
        arcjax.LLM(tiny_model_dir("LlamaForCausalLM"), speculative_config=spec)
    assert e.value.field == field


def test_draft_model_that_cannot_work_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    import json
    import shutil

    from arcjax.engine import build

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(build, "load_model", no_loading)
    target = tiny_model_dir("LlamaForCausalLM")
    other = tmp_path / "draft"
    other.mkdir()
    cfg = json.loads(open(f"{target}/config.json").read())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 500}))
    for spec in ({"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
                 {"model": str(tmp_path / "missing"), "num_speculative_tokens": 2}):
        with pytest.raises(EngineConfigError) as e:
            arcjax.LLM(target, speculative_config=spec)
        assert e.value.field == "speculative_config.model"
    short = tmp_path / "short"
    shutil.copytree(other, short)
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    with pytest.raises(EngineConfigError, match="positions"):
        arcjax.LLM(target, max_model_len=128, speculative_config={
            "method": "draft_model", "model": str(short), "num_speculative_tokens": 2})


def test_serve_flag_parses_json():
    from arcjax.engine.engine_config import EngineConfig
    from arcjax.entrypoints.cli import parse_serve

    cmd = parse_serve(["serve", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = EngineConfig.from_options(None, **cmd.engine_options)
    assert dataclasses.asdict(config.speculative_config) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5, "model": None, "disable_by_batch_size": 4}
