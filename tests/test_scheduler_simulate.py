"""Tests of scheduler.metrics, scheduler.simulate and the two scheduler scripts."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Request, SchedulerConfig, parse_arm
from scheduler import metrics
from scheduler.simulate import CostModel, burst, simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Req:
    arrival_time: float
    token_times: tuple


@dataclasses.dataclass
class Step:
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int


# ---- metrics ---------------------------------------------------------------------------------

@settings(max_examples=50)
@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=30), st.sampled_from([0, 10, 50, 90, 100]))
def test_percentile_matches_numpy(values, q):
    assert metrics.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_metrics_on_a_hand_made_run():
    requests = [Req(0.0, (1.0, 2.0, 5.0)), Req(0.5, (3.0,)), Req(1.0, ())]
    steps = [Step(0.0, 1.0, 100, 0), Step(1.0, 2.0, 50, 1), Step(2.0, 3.0, 0, 2),
             Step(3.0, 5.0, 0, 1)]
    assert metrics.ttfts(requests) == [1.0, 2.5]
    assert metrics.tokens_in_window(requests, 0.0, 2.0) == 2
    assert metrics.users_with_first_token(requests, 0.0, 2.0) == 1
    assert metrics.throughput(requests, 0.0, 4.0) == pytest.approx(3 / 4)
    assert metrics.longest_gap(requests) == 3.0
    assert metrics.inter_token_gaps(requests[0]) == [1.0, 3.0]
    kinds = metrics.steps_by_kind(steps)
    assert (kinds["prompt"].count, kinds["mixed"].count, kinds["decode"].count) == (1, 1, 2)
    assert kinds["decode"].mean_s == pytest.approx(1.5)
    assert metrics.prefill_wall(steps) == 2.0
    summary = metrics.summarize(requests, steps)
    assert summary.window == (0.0, 5.0) and summary.tokens_delivered == 4
    assert (summary.ttft_min, summary.ttft_max) == (1.0, 2.5)
    clipped = metrics.summarize(requests, steps, window=(0.0, 2.0))
    assert clipped.tokens_delivered == 2 and clipped.ttft_max == 1.0
    assert clipped.longest_gap == 1.0  # the 3 s gap ends after the window
    table = metrics.format_table({"run": summary})
    assert "TTFT p50" in table and "1 / 1,000 ms" in table


def test_metrics_without_tokens_are_nan_not_errors():
    summary = metrics.summarize([Req(0.0, ())], [])
    assert math.isnan(summary.ttft_p50) and summary.tokens_delivered == 0


# ---- cost model and simulator ----------------------------------------------------------------

def test_cost_model_json_round_trip():
    cost = CostModel(c0=0.01, c_prefill=1e-4, c_decode=2e-3, c_kv=1e-7)
    assert CostModel.from_json(cost.to_json()) == cost
    with pytest.raises(ValueError, match="c_bogus"):
        CostModel.from_json({"c_bogus": 1.0})


def _config(**overrides):
    values = dict(max_num_batched_tokens=512, chunk_tile=64, block_size=16, num_blocks=2048)
    values.update(overrides)
    return SchedulerConfig(**values)


@pytest.mark.parametrize("policy", ["prefill_first", "alternate", "token_budget"])
def test_simulation_delivers_every_token_deterministically(policy):
    requests = burst(12, 200, 8) + (Request(request_id="late", prompt_token_ids=(1,) * 50,
                                            max_tokens=5, arrival_time=3.0),)
    config, cost = _config(policy=policy), CostModel(c0=0.01, c_prefill=1e-3, c_decode=1e-3)
    first, again = simulate(config, cost, requests), simulate(config, cost, requests)
    assert first == again and first.unfinished == 0
    for record, request in zip(first.requests, sorted(requests, key=lambda r: r.arrival_time)):
        assert len(record.token_times) == request.max_tokens
        assert record.token_times[0] > record.arrival_time
        assert list(record.token_times) == sorted(record.token_times)
    assert first.summary().tokens_delivered == sum(r.max_tokens for r in requests)
    gaps = [(a.end, b.start) for a, b in zip(first.steps, first.steps[1:]) if a.end != b.start]
    assert gaps == [(gaps[0][0], 3.0)] and gaps[0][0] < 3.0  # idle only until "late" arrives


def test_simulation_stops_at_until():
    result = simulate(_config(), CostModel(), burst(8, 300, 50), until=2.0)
    assert result.unfinished > 0 and result.steps[-1].start < 2.0


def test_cap_chops_prefill_into_more_smaller_steps_for_the_same_work():
    """docs/motivation.md: the cap turns a few long prompt steps into more, shorter ones; decode is
    not slowed and the prefill work is the same (up to c0 per extra step); TTFT min drops."""
    cost = CostModel()
    off = _config(policy="prefill_first", max_num_batched_tokens=4096)
    on = dataclasses.replace(off, prefill_max_seqs=4)
    requests = burst(32, 380, 16)
    a = metrics.summarize(*_run(off, cost, requests))
    b = metrics.summarize(*_run(on, cost, requests))
    assert b.kinds["prompt"].count > a.kinds["prompt"].count
    assert b.kinds["prompt"].mean_s < a.kinds["prompt"].mean_s
    extra = (b.kinds["prompt"].count - a.kinds["prompt"].count) * cost.c0
    assert b.prefill_wall == pytest.approx(a.prefill_wall + extra)
    assert b.ttft_min < a.ttft_min


def test_token_budget_keeps_decoding_users_flowing_through_a_burst():
    """Users already decoding when a burst of long prompts lands: legacy stops them for whole
    prompt steps; token_budget keeps giving them a token every (mixed) step."""
    cost = CostModel(c0=0.005, c_prefill=2e-4, c_decode=1e-3)
    early = tuple(Request(request_id=f"early{i}", prompt_token_ids=(1,) * 64, max_tokens=200)
                  for i in range(4))
    late = tuple(dataclasses.replace(r, request_id=f"late{r.request_id}", arrival_time=0.05)
                 for r in burst(32, 1000, 4))
    gaps = {}
    for policy in ("prefill_first", "token_budget"):
        result = simulate(_config(policy=policy, max_num_batched_tokens=1024, chunk_tile=128),
                          cost, early + late)
        gaps[policy] = metrics.longest_gap([r for r in result.requests
                                            if str(r.request_id).startswith("early")])
    assert gaps["token_budget"] < 0.5 * gaps["prefill_first"]
    assert gaps["token_budget"] <= cost.c0 + 1024 * cost.c_prefill + 4 * cost.c_decode + 1e-9


def _run(config, cost, requests):
    result = simulate(config, cost, requests)
    return result.requests, result.steps


# ---- scripts ---------------------------------------------------------------------------------

def _script(name, *args):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _simulate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("simulate_script",
                                                  ROOT / "scripts" / "simulate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_simulate_script_run_gives_every_arm():
    sim_script = _simulate_script()
    arms = ("prefill_first", "prefill_first:prefill_max_seqs=2", "token_budget")
    sim = sim_script.SimulateConfig(
        users=8, prompt_tokens=100, system_prompt_tokens=0, max_tokens=4, window_s=0.0,
        variants=tuple(parse_arm(a) for a in arms), base=_config(), cost=CostModel())
    res = sim_script.run(sim)
    assert list(res.summaries) == list(arms)
    assert all(s.users_with_first_token == 8 for s in res.summaries.values())
    assert res.engaged["prefill_first:prefill_max_seqs=2"]["cap_deferred"] > 0
    assert "cap_deferred" not in res.engaged["prefill_first"]
    # the cap spreads admissions over more prompt steps
    capped, free = (res.summaries[a].kinds["prompt"].count for a in arms[1::-1])
    assert capped > free


def test_simulate_script_prints_the_burst_table():  # the command line itself
    out = _script("simulate.py", "--users=4", "--prompt_tokens=50", "--max_tokens=2",
                  "--variants=token_budget")
    assert "TTFT p50" in out and "token_budget" in out


def test_bench_script_runs_small():
    out = _script("bench_scheduler.py", "--running=8", "--waiting=16", "--prompt_tokens=64",
                  "--repeats=20", "--steps=5", "--max_num_seqs=8,16", "--burst=4")
    assert out.count("token_budget") == 4  # 2 max_num_seqs x prefix caching off / on
    assert out.count("add_request with 16 waiting") == 2


def test_simulate_script_calibrates_from_rows(tmp_path):
    """--calibrate_from fits the cost model to step rows with known coefficients and
    simulates with it (the printed model carries the recovered coefficients)."""
    rows = []
    for i in range(60):
        p, d = (i * 37) % 900, (i * 7) % 40
        rows.append({"prefill_tokens": p, "decode_tokens": d, "kv_read": 0,
                     "cycle_s": 0.01 + 2e-4 * p + 1e-3 * d})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _script("simulate.py", "--users=4", "--prompt_tokens=64", "--max_tokens=4",
                  f"--calibrate_from={path}", "--variants=token_budget")
    assert "calibrated from" in out and "R^2 1.000" in out
    cost = json.loads(out.split("cost ", 1)[1].splitlines()[0])
    assert cost["c_prefill"] == pytest.approx(2e-4, rel=1e-6)
    assert cost["c_decode"] == pytest.approx(1e-3, rel=1e-6)


def test_step_kind_and_markdown_table_have_one_home():
    assert [metrics.step_kind(p, d) for p, d in ((5, 0), (5, 1), (0, 3), (0, 0))] == [
        "prompt", "mixed", "decode", "idle"]
    table = metrics.markdown_table(["", "a"], [["row", "1"], ["longer row", "22"]])
    assert table.splitlines() == ["|            | a  |", "|------------|----|",
                                  "| row        | 1  |", "| longer row | 22 |"]


def test_cost_model_defaults_are_the_derived_legacy_h200():
    from scheduler.simulate import COST_PRESETS

    cost = CostModel()
    assert COST_PRESETS["h200_legacy"] == cost
    assert cost.c_decode == pytest.approx((2.3275 - 0.7055) / 96)
    assert cost.c0 == pytest.approx(0.7055 - 32 * cost.c_decode)
    assert cost.c_prefill == pytest.approx(43.2 / 12160) and cost.c_kv == 0.0
    # the fit reproduces the measured decode steps of docs/motivation.md
    assert cost.c0 + 32 * cost.c_decode == pytest.approx(0.7055)
    assert cost.c0 + 128 * cost.c_decode == pytest.approx(2.3275)


def test_parse_arm_is_validated():
    from scheduler import ARM_KEYS, KNOB_SHORT, ConfigError, parse_arm

    arm = parse_arm("token_budget:budget=512:floor=2")
    assert arm.policy == "token_budget" and arm.name == "token_budget:budget=512:floor=2"
    assert dict(arm.overrides) == {"max_num_batched_tokens": 512, "prefill_floor_steps": 2}
    config = arm.config(SchedulerConfig(num_blocks=64))
    assert (config.policy, config.max_num_batched_tokens, config.num_blocks) == (
        "token_budget", 512, 64)
    assert parse_arm("prefill_first:prefill_max_seqs=4:floor=0").configured_knobs == {
        "prefill_max_seqs": 4}
    assert KNOB_SHORT["max_num_seqs"] == "seqs" and ARM_KEYS["seqs"] == "max_num_seqs"
    for bad, field in (("fastest", "policy"), ("token_budget:budget", "budget"),
                       ("token_budget:speed=3", "speed"), ("alternate:cap=x", "prefill_max_seqs")):
        with pytest.raises(ConfigError) as err:
            parse_arm(bad)
        assert err.value.field == field and repr(bad) in str(err.value)


def test_shared_system_prompt_is_computed_once():
    """N users share an S-token system prompt: with prefix caching the later admissions skip
    it (no prefill cost), every token is still delivered, and TTFT drops."""
    from scheduler.simulate import shared_prefix_burst

    requests = shared_prefix_burst(16, 512, 40, 8)
    assert all(r.prompt_token_ids[:512] == requests[0].prompt_token_ids[:512] for r in requests)
    assert len({r.prompt_token_ids for r in requests}) == 16
    cost = CostModel(c0=0.01, c_prefill=1e-3, c_decode=1e-3)
    runs = {}
    for caching in (False, True):
        config = _config(policy="token_budget", enable_prefix_caching=caching)
        runs[caching] = simulate(config, cost, requests)
        assert runs[caching].unfinished == 0
        assert runs[caching].summary().tokens_delivered == 16 * 8
    off, on = runs[False], runs[True]
    assert off.cached_tokens == 0
    assert on.cached_tokens >= 15 * 512  # every user after the first skips the system prompt
    prefill = {c: sum(s.prefill_tokens for s in r.steps) for c, r in runs.items()}
    assert prefill[True] + on.cached_tokens == prefill[False]
    assert on.summary().ttft_p50 < off.summary().ttft_p50


def test_burst_works_with_prefix_caching():
    config = _config(enable_prefix_caching=True)
    result = simulate(config, CostModel(), burst(8, 300, 4))
    assert result.unfinished == 0 and result.cached_tokens == 0  # distinct prompts


def test_simulate_script_shared_system_prompt():
    args = ("--users=8", "--system_prompt_tokens=256", "--prompt_tokens=32", "--max_tokens=4",
            "--variants=token_budget")
    on, off = _script("simulate.py", *args), _script("simulate.py", *args, "--noprefix_caching")
    assert "256-token shared system prompt" in on
    assert "served by the prefix cache: 0" in off and "served by the prefix cache: 0" not in on
