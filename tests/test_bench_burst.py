"""The burst benchmark's pieces (prompts, arms, metrics, cost-model fit, replay) and one small
end-to-end run of scripts/bench_burst.py (real engine + simulation) on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

import scheduler
from arcjax.bench import burst, costmodel
from arcjax.engine.tokenizer import Tokenizer
from scheduler.simulate import CostModel, RequestRecord, simulate
from support.hf_models import tiny_model_with_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_burst.py")


# --- prompts -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A small byte-level BPE tokenizer (no model needed)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    text = ("the quick brown fox jumps over the lazy dog while a burst of users waits for "
            "its first token and the scheduler chunks every prompt into tiles ") * 30
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer.from_dir(path)


def test_prompts_are_deterministic_with_the_word_count(tokenizer):
    pool = burst.word_pool(tokenizer)
    a = burst.burst_prompts(pool, 5, 37, seed=3)
    assert a == burst.burst_prompts(pool, 5, 37, seed=3)
    assert [len(p.split()) for p in a] == [37] * 5
    assert len(set(a)) == 5  # every user has its own prompt
    assert a != burst.burst_prompts(pool, 5, 37, seed=4)
    assert burst.burst_prompts(pool, 3, 37, seed=3) == a[:3]  # user i's prompt ignores K
    assert all(w in pool for p in a for w in p.split())


def test_word_pool_holds_whole_words_or_falls_back(tokenizer):
    pool = burst.word_pool(tokenizer)
    assert {"quick", "brown", "scheduler"} <= set(pool)
    assert pool == tuple(sorted(set(pool))) and all(w.isalpha() and len(w) >= 2 for w in pool)
    assert burst.word_pool(None) == burst._FALLBACK_WORDS
    with pytest.raises(ValueError):
        burst.burst_prompts(pool, 0, 10, seed=0)


# --- metrics from a synthetic trace --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    engaged: dict = dataclasses.field(default_factory=dict)


def synthetic_run(window_s: float = 100.0, t0: float = 10.0) -> burst.BurstRun:
    """Burst at t0 (10 by default): from t=10, two 2 s prompt steps (user a, then b), then 1 s
    decode steps; user c never gets a token."""
    steps = (Step(10, 12, 400, 0, {"cap_deferred": 1}), Step(12, 14, 400, 1, {"cap_deferred": 1}),
             Step(14, 15, 0, 2), Step(15, 16, 0, 2), Step(16, 17, 0, 1))
    requests = (RequestRecord(request_id="a", arrival_time=t0, token_times=(12, 14, 15, 16)),
                RequestRecord(request_id="b", arrival_time=t0, token_times=(14, 15, 16, 17)),
                RequestRecord(request_id="c", arrival_time=t0, token_times=()))
    return burst.BurstRun(arm="x", t0=t0, window_s=window_s, requests=requests, steps=steps,
                          max_new_tokens=4,
                          configured_knobs={"prefill_max_seqs": 1, "prefill_floor_steps": 2})


def test_metrics_of_a_synthetic_trace():
    m = burst.burst_metrics(synthetic_run())
    assert m["window_s"] == 7.0  # closed at the last step's end
    assert (m["ttft_min_s"], m["ttft_max_s"]) == (2.0, 4.0)
    assert m["ttft_p50_s"] == pytest.approx(3.0)
    assert m["ttft_p90_s"] == pytest.approx(3.8)
    assert m["users_with_first_token"] == 2 and m["num_users"] == 3
    assert m["tokens_delivered"] == 8
    assert m["tokens_per_s"] == pytest.approx(8 / 7)
    assert m["steps_by_kind"]["prompt"] == {"steps": 1, "mean_ms": pytest.approx(2000)}
    assert m["steps_by_kind"]["mixed"] == {"steps": 1, "mean_ms": pytest.approx(2000)}
    assert m["steps_by_kind"]["decode"] == {"steps": 3, "mean_ms": pytest.approx(1000)}
    assert m["prefill_wall_s"] == 4.0 and m["prefill_tokens"] == 800
    assert m["max_decode_gap_s"] == 2.0  # user a: 12 -> 14 while b's prompt ran
    assert m["mean_step_s"] == pytest.approx(7 / 5)
    assert m["gap_p99_s"] == pytest.approx(1.95)  # gaps 2, 1, 1, 1, 1, 1
    assert m["max_stall_s"] == 2.0 and m["stall_over_mean_step"] == pytest.approx(2.0 / 1.4)
    assert m["knobs"]["prefill_max_seqs"] == {"value": 1, "engaged_steps": 2, "engaged": True}
    assert m["knobs_never_engaged"] == ["prefill_floor_steps"]
    assert m["engagement"] == {"cap_deferred": 2}


def test_metrics_inside_a_short_window():
    m = burst.burst_metrics(synthetic_run(window_s=4.5))  # closes at 14.5
    assert m["window_s"] == 4.5
    assert m["tokens_delivered"] == 3  # a@12, a@14, b@14
    assert m["users_with_first_token"] == 2
    assert m["steps_by_kind"]["decode"]["steps"] == 0
    assert m["max_decode_gap_s"] == 2.0  # a: 12 -> 14
    assert m["max_stall_s"] == 2.0  # open: a since 14, b since 14 (0.5 s each)
    m = burst.burst_metrics(synthetic_run(window_s=5.9))  # closes at 15.9: a waits since 15
    assert m["max_decode_gap_s"] == 2.0 and m["max_stall_s"] == pytest.approx(2.0)
    m = burst.burst_metrics(synthetic_run(window_s=3.5))  # closes at 13.5: a waits since 12
    assert m["max_decode_gap_s"] == 0.0 and m["max_stall_s"] == pytest.approx(1.5)


def test_median_run_and_table():
    runs = [synthetic_run(t0=t0) for t0 in (10.0, 9.0, 11.0)]
    run, m = burst.median_run(runs)
    assert run.t0 == 10.0 and m["ttft_p50_s"] == pytest.approx(3.0)
    assert m["ttft_p50_repeats_s"] == pytest.approx([3.0, 4.0, 2.0])
    table = burst.format_table([m])
    assert "| TTFT p50" in table and "3.00 s" in table and "floor=2: NEVER" in table


# --- cost model ----------------------------------------------------------------------------------

def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = CostModel(c0=0.05, c_prefill=4e-4, c_decode=2e-3, c_kv=3e-6)
    rows = []
    for _ in range(200):
        p, d = int(rng.integers(0, 2048)), int(rng.integers(0, 64))
        kv = d * int(rng.integers(100, 900)) + p
        t = true.c0 + true.c_prefill * p + true.c_decode * d + true.c_kv * kv
        rows.append({"prefill_tokens": p, "decode_tokens": d, "kv_read": kv, "cycle_s": t})
    model, report = costmodel.fit_cost_model(rows)
    for name, value in true.to_json().items():
        assert getattr(model, name) == pytest.approx(value, rel=1e-6)
    assert report.rmse_s < 1e-9 and report.r2 == pytest.approx(1.0)
    # Noise of 1 ms: coefficients still close.
    noisy = [dict(r, cycle_s=r["cycle_s"] + rng.normal(0, 1e-3)) for r in rows]
    model, report = costmodel.fit_cost_model(noisy)
    assert model.c_prefill == pytest.approx(true.c_prefill, rel=0.03)
    assert model.c_decode == pytest.approx(true.c_decode, rel=0.1)
    assert 5e-4 < report.rmse_s < 2e-3


def test_fit_without_kv_read_and_save_load(tmp_path):
    rows = [{"prefill_tokens": p, "decode_tokens": d, "cycle_s": 0.1 + 1e-3 * p + 1e-2 * d}
            for p in (0, 128, 512) for d in (0, 4, 9)]
    model, report = costmodel.fit_cost_model(rows)
    assert report.features == ("prefill_tokens", "decode_tokens") and model.c_kv == 0.0
    assert (model.c0, model.c_prefill, model.c_decode) == pytest.approx((0.1, 1e-3, 1e-2))
    path = tmp_path / "fit.json"
    costmodel.save_cost_model(model, path)
    assert costmodel.load_cost_model(path) == model


def test_engine_trace_reads_as_calibration_rows(tmp_path):
    from scheduler.metrics import StepRecord
    from arcjax.engine.trace import write_jsonl

    records, t = [], 0.0
    for i, (p, d) in enumerate([(512, 0), (0, 4), (256, 4), (0, 8), (128, 8)]):
        cycle = 0.01 + 1e-4 * p + 2e-3 * d
        records.append(StepRecord(index=i, start=t, end=t + cycle - 0.001, prefill_tokens=p,
                                  decode_tokens=d, num_seqs=1, bucket=(512, 8, 512),
                                  compiled=False, engaged={}))
        t += cycle
    write_jsonl(records, tmp_path / "trace.jsonl")
    rows = costmodel.read_rows(tmp_path / "trace.jsonl")
    assert [r["cycle_s"] for r in rows] == pytest.approx(
        [0.01 + 1e-4 * r["prefill_tokens"] + 2e-3 * r["decode_tokens"] for r in rows])
    model, report = costmodel.fit_cost_model(rows)
    assert report.features == ("prefill_tokens", "decode_tokens")
    assert (model.c0, model.c_prefill, model.c_decode) == pytest.approx((0.01, 1e-4, 2e-3))


def test_replay_of_a_simulated_run_recovers_its_cost_model(tmp_path):
    """Calibrating on a run of the simulator itself must give back the simulator's costs."""
    true = CostModel(c0=0.02, c_prefill=5e-4, c_decode=3e-3, c_kv=2e-5)
    prompts = [[1 + (u + j) % 97 for j in range(100 + 37 * u)] for u in range(6)]
    requests = costmodel.burst_requests(prompts, 9)
    config = scheduler.SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, num_blocks=64)
    result = simulate(config, true, requests)
    rows = costmodel.replay_rows(config, requests, result.steps, "tb")
    assert len(rows) == len(result.steps)
    assert [r["cycle_s"] for r in rows[:-1]] == pytest.approx(
        [s.end - s.start for s in result.steps[:-1]])
    costmodel.write_rows(rows, tmp_path / "rows.jsonl")
    model, report = costmodel.fit_cost_model(costmodel.read_rows(tmp_path / "rows.jsonl"))
    assert report.features == costmodel.FEATURES
    for name, value in true.to_json().items():
        assert getattr(model, name) == pytest.approx(value, rel=1e-6, abs=1e-9)
    # Another config plans other steps: the replay notices.
    with pytest.raises(ValueError, match="diverged"):
        costmodel.replay_rows(dataclasses.replace(config, max_num_batched_tokens=128),
                              requests, result.steps)


def test_simulate_arm_and_cycle_times():
    prompts = [[3] * 300 for _ in range(4)]
    requests = costmodel.burst_requests(prompts, 4)
    base = scheduler.SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, num_blocks=128)
    run = costmodel.simulate_arm(scheduler.parse_arm("prefill_first:cap=1"), base, requests,
                                 CostModel(c0=1.0, c_prefill=0.0, c_decode=0.0), 100.0)
    m = burst.burst_metrics(run)
    # One prompt per step (cap=1), each 1 s: first tokens at 1, 2, 3, 4 s.
    assert sorted(m["ttft_s"]) == [1.0, 2.0, 3.0, 4.0]
    assert m["knobs"]["prefill_max_seqs"]["engaged_steps"] == 3
    steps = [Step(0, 1, 1, 0), Step(1.5, 2, 1, 0), Step(2.1, 3, 1, 0)]
    assert costmodel.cycle_times(steps) == pytest.approx([1.5, 0.6, 0.9 + 0.3])


# --- end to end ----------------------------------------------------------------------------------

def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_script_end_to_end(tmp_path):
    """Real run of two arms with --compare, then the same arms (plus one whose knob cannot
    engage) in simulation with the fitted cost model: that run must fail loudly."""
    model = tiny_model_with_tokenizer()
    out, plot, rows, fit = (tmp_path / n for n in ("b.json", "b.png", "rows.jsonl", "fit.json"))
    arms = "--arms=prefill_first:cap=2,token_budget:budget=128"
    common = (f"--model={model}", "--num_users=4", "--prompt_words=40", "--max_new_tokens=3",
              "--window_s=60", "--max_num_batched_tokens=128")
    proc = _run(*common, arms, f"--out={out}", f"--plot={plot}", f"--trace_out={rows}",
                f"--save_cost_model={fit}", "--compare")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [m["arm"] for m in res["real"]] == ["prefill_first:cap=2", "token_budget:budget=128"]
    for m in res["real"]:
        assert m["users_with_first_token"] == 4 and m["tokens_delivered"] == 12
        assert m["compiles_in_run"] == 0 and not m["knobs_never_engaged"]
    assert res["engine"]["compiles_after_warmup"] == 0
    assert len(res["comparisons"][0]["sim_over_real"]) == 2
    image = matplotlib.image.imread(plot)  # a real PNG: decodes, has the expected layout
    assert image.shape[1] > 1000 and image.shape[0] > 500  # 11 in wide at 110 dpi; 3 panels
    assert image[..., :3].std() > 0.05  # not blank: curves and bars were drawn
    assert costmodel.read_rows(rows)[0]["kv_read"] > 0
    assert set(json.loads(fit.read_text())) == {"c0", "c_prefill", "c_decode", "c_kv"}

    sim_out = tmp_path / "sim.json"
    proc = _run(*common, arms + ",prefill_first:cap=8", "--simulate", f"--cost_model={fit}",
                f"--out={sim_out}")
    assert proc.returncode != 0
    assert "prefill_first:cap=8: configured prefill_max_seqs never engaged" in proc.stderr
    sim = json.loads(sim_out.read_text())["simulated"]
    assert [m["users_with_first_token"] for m in sim] == [4, 4, 4]
    assert all(math.isfinite(m["ttft_p50_s"]) for m in sim)
