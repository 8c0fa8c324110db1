"""The burst experiment: K users arrive at once, each with a P-word prompt.

1. `burst_prompts` builds K deterministic synthetic prompts of exactly P words (words drawn,
   with a seed, from the tokenizer's own vocabulary).
2. Arms are `scheduler.parse_arm` specs such as "token_budget:budget=512" or
   "prefill_first:cap=4"; `Arm.config` turns one into a `SchedulerConfig` over the base cache.
3. `run_arm` submits the burst to a fresh `Engine` over an already warmed runner (same
   params, KV cache and compiled executables for every arm) and steps it until every user is
   done or the window closes. It returns a `BurstRun`: step records and token times.
4. `burst_metrics` reduces a `BurstRun`, real or simulated, to the rows of the burst table.

NOTE: the window starts at the burst (every request's arrival time) and closes at
`t0 + window_s` or at the end of the last step, whichever is first. Only steps that start
inside it and tokens delivered inside it count.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Mapping, Sequence

import scheduler
from arcjax.engine.engine import Engine
from arcjax.engine.tokenizer import Tokenizer
from arcjax.runtime.buckets import Bucket, BucketSet
from arcjax.sampling_params import SamplingParams
from scheduler import metrics
from scheduler.arms import KNOB_SHORT, Arm
from scheduler.metrics import engagement, knob_report, markdown_table
from scheduler.simulate import RequestRecord, simulate

# A fallback word list for tokenizers whose vocabulary holds too few whole words.
_FALLBACK_WORDS = tuple(
    "the of and to in is for that with as on by this be are from or it at an not which can "
    "value list data file name line return import class self type error test path index key "
    "time string number object function module result state table model token block step "
    "cache query batch prompt user server request output input first last next order queue".split())
_MIN_POOL = 32


def word_pool(tokenizer: Tokenizer | None) -> tuple[str, ...]:
    """Whole ASCII words (>= 2 letters) in the tokenizer's vocabulary, sorted; or a fixed list."""
    if tokenizer is None:
        return _FALLBACK_WORDS
    words = set()
    for i in range(tokenizer.vocab_size):
        w = tokenizer.decode([i]).strip()
        if len(w) >= 2 and w.isascii() and w.isalpha():
            words.add(w)
    return tuple(sorted(words)) if len(words) >= _MIN_POOL else _FALLBACK_WORDS


def burst_prompts(pool: Sequence[str], num_users: int, num_words: int, seed: int) -> list[str]:
    """`num_users` prompts of exactly `num_words` space-separated words; same seed, same prompts."""
    if num_users < 1 or num_words < 1:
        raise ValueError(f"need num_users >= 1 and num_words >= 1, got {num_users}, {num_words}")
    out = []
    for user in range(num_users):
        rng = random.Random(f"{seed}:{user}")  # str seeds hash deterministically (sha512)
        out.append(" ".join(rng.choice(pool) for _ in range(num_words)))
    return out


# --- one run ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class BurstRun:
    """What one arm produced, on the engine or in the simulator (one clock, seconds).

    Attributes:
      arm: the arm's name.
      t0: the burst (every request's arrival time).
      window_s: the configured window length.
      requests: per user: arrival_time and token_times (scheduler.simulate.RequestRecord).
      steps: every step run, in order: start, end, prefill_tokens, decode_tokens, engaged
        (scheduler.metrics.StepRecord, from the engine's trace or the simulator).
      max_new_tokens: tokens every user asked for (a user with fewer at the window's end is
        still waiting for its next token: an open stall).
      configured_knobs: SchedulerConfig field -> value the arm set explicitly.
    """

    arm: str
    t0: float
    window_s: float
    requests: tuple[RequestRecord, ...]
    steps: tuple
    max_new_tokens: int
    configured_knobs: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def window(self) -> tuple[float, float]:
        """[burst, burst + window_s], closed early at the last step's end."""
        last = self.steps[-1].end if self.steps else self.t0
        return self.t0, min(self.t0 + self.window_s, last)


def run_arm(warm: Engine, arm: Arm, base: scheduler.SchedulerConfig,
            prompts: Sequence[Sequence[int]], max_new_tokens: int,
            window_s: float) -> tuple[BurstRun, Engine]:
    """Runs one burst on a fresh `Engine` over `warm`'s runner (params, KV cache, compiled
    executables) with `arm.config(base)`. Greedy, EOS ignored: every user wants exactly
    max_new_tokens. Steps until all are done or the window closes.

    Returns the run and the engine (its trace, for export).
    """
    config = arm.config(base)
    if not config.same_cache(warm.sched_config):
        raise ValueError(f"arm {arm.name}: the KV cache geometry differs from the warm engine's")
    engine = Engine(warm.runner, warm.tokenizer, config, max_model_len=warm.max_model_len)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for ids in prompts:  # validate everything before the clock starts
        engine.check(ids, params)
    latest = {}  # request id -> its newest output (token times so far)

    def sink(out):
        latest[out.request_id] = out

    t0 = engine.clock()
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params, request_id=str(i), arrival_time=t0, sink=sink)
    deadline = t0 + window_s
    while engine.has_unfinished() and engine.clock() < deadline:
        engine.run_step()
    requests = tuple(RequestRecord(request_id=str(i), arrival_time=t0,
                                   token_times=latest[str(i)].metrics.token_times
                                   if str(i) in latest else ())
                     for i in range(len(prompts)))
    run = BurstRun(arm=arm.name, t0=t0, window_s=window_s, requests=requests,
                   steps=tuple(engine.trace), max_new_tokens=max_new_tokens,
                   configured_knobs=arm.configured_knobs)
    return run, engine


# --- warm-up ---------------------------------------------------------------------------------

class _BucketRecorder:
    """A simulator cost model that notes each plan's bucket and lasts 1 s per step."""

    def __init__(self, buckets: BucketSet):
        self.buckets, self.seen = buckets, set()

    def step_time(self, plan) -> float:
        self.seen.add(self.buckets.select(plan.num_tokens, plan.num_seqs, plan.decode_only))
        return 1.0


def planned_buckets(buckets: BucketSet, config: scheduler.SchedulerConfig,
                    requests: Sequence[scheduler.Request]) -> set[Bucket]:
    """The buckets a run of `requests` under `config` selects, found by running the planner
    alone (it is deterministic: with EOS ignored, the engine plans exactly the same steps)."""
    recorder = _BucketRecorder(buckets)
    simulate(config, recorder, requests)
    return recorder.seen


# --- metrics ---------------------------------------------------------------------------------

def engaged_counts(steps) -> dict[str, int]:
    """Steps in which each `Engaged` field acted (only those that did)."""
    return {k: n for k, n in engagement(steps).items() if n}


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def burst_metrics(run: BurstRun) -> dict:
    """The burst table's rows for one run; the same code for real and simulated runs.

    Everything in docs/motivation.md's tables comes from `scheduler.metrics.summarize` over the
    window (TTFT percentiles are over the users served in it: read them with
    users_with_first_token). Added here: "mean_step_s", the wall time per step over the window
    (step work plus host work between steps), which a decode gap is compared with, and the
    knobs' engagement. Times are seconds; None where undefined.
    """
    start, end = run.window
    s = metrics.summarize(run.requests, run.steps, (start, end))
    inside = [st for st in run.steps if st.end <= end]
    mean_step = (inside[-1].end - inside[0].start) / len(inside) if inside else None
    counts = engaged_counts(inside)
    open_waits = [end - ts[-1] for ts in ([t for t in r.token_times if t <= end]
                                          for r in run.requests)
                  if ts and len(ts) < run.max_new_tokens]
    stall = max([s.longest_gap, *open_waits])
    gaps = [g for r in run.requests
            for g in metrics.inter_token_gaps(RequestRecord(
                request_id=r.request_id, arrival_time=r.arrival_time,
                token_times=tuple(t for t in r.token_times if t <= end)))]
    knobs = knob_report(counts, run.configured_knobs)
    return {
        "arm": run.arm,
        "num_users": s.num_requests,
        "window_s": end - start,
        "ttft_p50_s": _finite(s.ttft_p50),
        "ttft_p90_s": _finite(s.ttft_p90),
        "ttft_max_s": _finite(s.ttft_max),
        "ttft_min_s": _finite(s.ttft_min),
        "tokens_per_s": _finite(s.throughput),
        "tokens_delivered": s.tokens_delivered,
        "users_with_first_token": s.users_with_first_token,
        "steps_by_kind": {k: {"steps": v.count, "mean_ms": 1e3 * v.mean_s}
                          for k, v in s.kinds.items()},
        "prefill_wall_s": s.prefill_wall,
        "prefill_tokens": sum(st.prefill_tokens for st in inside),
        "mean_step_s": mean_step,
        "max_decode_gap_s": s.longest_gap,
        "gap_p99_s": _finite(metrics.percentile(gaps, 99)),
        "max_stall_s": stall,
        "stall_over_mean_step": stall / mean_step if mean_step else None,
        "compiles_in_run": sum(bool(getattr(st, "compiled", False)) for st in run.steps),
        "knobs": knobs,
        "knobs_never_engaged": [k for k, v in knobs.items() if not v["engaged"]],
        "engagement": counts,
        "ttft_s": metrics.ttfts(run.requests, end),
    }


# --- tables ----------------------------------------------------------------------------------

def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} s" if x >= 1 else f"{1e3 * x:.0f} ms" if x >= 0.01 else f"{1e3 * x:.2f} ms"


def _kind_cell(m: Mapping, kind: str) -> str:
    k = m["steps_by_kind"][kind]
    return f"{k['steps']} / {k['mean_ms']:,.0f} ms" if k["steps"] else "0 / -"


def _knob_cell(m: Mapping) -> str:
    if not m["knobs"]:
        return "(none set)"
    return ", ".join(f"{KNOB_SHORT.get(k, k)}={v['value']}: "
                     + (f"{v['engaged_steps']} steps" if v["engaged"] else "NEVER")
                     for k, v in m["knobs"].items())


_ROWS = (
    ("TTFT p50", lambda m: _s(m["ttft_p50_s"])),
    ("TTFT p90", lambda m: _s(m["ttft_p90_s"])),
    ("TTFT max", lambda m: _s(m["ttft_max_s"])),
    ("TTFT min", lambda m: _s(m["ttft_min_s"])),
    ("TTFT p50 of every repeat", lambda m: ", ".join(
        _s(x) for x in m.get("ttft_p50_repeats_s", ())) if len(m.get("ttft_p50_repeats_s", ())) > 1
     else ""),
    ("aggregate throughput over the window",
     lambda m: "-" if m["tokens_per_s"] is None else f"{m['tokens_per_s']:.1f} tok/s"),
    ("tokens delivered", lambda m: f"{m['tokens_delivered']}"),
    ("users with a first token", lambda m: f"{m['users_with_first_token']} / {m['num_users']}"),
    ("prompt-only steps / mean duration", lambda m: _kind_cell(m, "prompt")),
    ("mixed steps / mean duration", lambda m: _kind_cell(m, "mixed")),
    ("decode-only steps / mean duration", lambda m: _kind_cell(m, "decode")),
    ("total prefill wall", lambda m: f"{m['prefill_wall_s']:.1f} s"),
    ("mean step time (wall / steps)",
     lambda m: "-" if m["mean_step_s"] is None else f"{1e3 * m['mean_step_s']:,.0f} ms"),
    ("inter-token gap p99 / longest", lambda m: f"{_s(m['gap_p99_s'])} / "
     f"{_s(m['max_decode_gap_s'])}"),
    ("longest decode stall, open ones included (x mean step)",
     lambda m: _s(m["max_stall_s"])
     + ("" if m["stall_over_mean_step"] is None else f" ({m['stall_over_mean_step']:.1f}x)")),
    ("configured knobs engaged", _knob_cell),
    ("window", lambda m: f"{m['window_s']:.1f} s"),
)


def format_table(results: Sequence[Mapping]) -> str:
    """The burst table of docs/motivation.md, one column per arm (dicts from `burst_metrics`)."""
    body = [[label, *(cell(m) for m in results)] for label, cell in _ROWS]
    return markdown_table(["", *(m["arm"] for m in results)],
                          [row for row in body if any(row[1:])])


def ratio_rows(real: Sequence[Mapping], simulated: Sequence[Mapping]) -> list[dict]:
    """Simulation against the real run, per arm: TTFT p50/p90 predicted / measured."""
    out = []
    for r, s in zip(real, simulated):
        row = {"arm": r["arm"]}
        for q in ("p50", "p90"):
            a, b = r[f"ttft_{q}_s"], s[f"ttft_{q}_s"]
            row[f"{q}_real_s"], row[f"{q}_sim_s"] = a, b
            row[f"{q}_ratio"] = b / a if a and b is not None else None
        out.append(row)
    return out


def format_ratios(rows: Sequence[Mapping]) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    return markdown_table(
        ["arm", "TTFT p50 real", "p50 sim", "sim/real", "TTFT p90 real", "p90 sim", "sim/real"],
        [[r["arm"], _s(r["p50_real_s"]), _s(r["p50_sim_s"]), f(r["p50_ratio"]),
          _s(r["p90_real_s"]), _s(r["p90_sim_s"]), f(r["p90_ratio"])] for r in rows])


def median_run(runs: Sequence[BurstRun]) -> tuple[BurstRun, dict]:
    """Of one arm's repeated runs, the one with the median TTFT p50 (a served-nobody p50 counts
    as infinite), with its metrics; "ttft_p50_repeats_s" lists every run's p50."""
    scored = [(burst_metrics(r), r) for r in runs]
    key = lambda mr: math.inf if mr[0]["ttft_p50_s"] is None else mr[0]["ttft_p50_s"]  # noqa: E731
    ordered = sorted(scored, key=key)
    m, run = ordered[(len(ordered) - 1) // 2]
    m["ttft_p50_repeats_s"] = [x["ttft_p50_s"] for x, _ in scored]
    m["ttft_p90_repeats_s"] = [x["ttft_p90_s"] for x, _ in scored]
    return run, m
