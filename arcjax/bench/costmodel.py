"""Calibrating `scheduler.simulate.CostModel` to a real run, and simulating burst arms with it.

1. `replay_rows`: replays a real run through the simulator (the same planner, requests and
   config; step i lasts what it really lasted), which yields each step's plan features the
   engine trace lacks (kv_read: keys read by attention, summed over rows). The replay must
   reproduce the trace's prefill/decode token counts step for step, else it raises.
2. `fit_cost_model`: non-negative least squares of each step's cycle time (start to the next
   step's start: device work plus the host work around it, i.e. what the scheduler sees) on
   [1, prefill_tokens, decode_rows, kv_read]. Returns the model and its error.
3. `simulate_arm`: one burst arm through `scheduler.simulate.simulate`, as a `BurstRun`.

Calibration rows are JSONL (`write_rows` / `read_rows`); an engine trace written by
`arcjax.engine.trace.write_jsonl` is read too (cycle times from consecutive starts, no kv_read).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

import scheduler
from scheduler.arms import Arm
from arcjax.bench.burst import BurstRun
from scheduler.metrics import step_kind
from scheduler.simulate import COST_PRESETS, CostModel, simulate

FEATURES = ("prefill_tokens", "decode_tokens", "kv_read")  # with a constant: c0
COEFFS = ("c0", "c_prefill", "c_decode", "c_kv")

def burst_requests(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   t0: float = 0.0) -> tuple[scheduler.Request, ...]:
    """The burst as the planner sees it: ids "0".."K-1", all arriving at t0 (as `run_arm`)."""
    return tuple(scheduler.Request(request_id=str(i), prompt_token_ids=tuple(ids),
                                   max_tokens=max_new_tokens, arrival_time=t0)
                 for i, ids in enumerate(prompts))


def cycle_times(steps: Sequence) -> list[float]:
    """Start-to-next-start of each step; the last one gets its duration plus the median
    host gap (end to next start) of the others."""
    gaps = [b.start - a.end for a, b in zip(steps, steps[1:])]
    tail = statistics.median(gaps) if gaps else 0.0
    return ([b.start - a.start for a, b in zip(steps, steps[1:])]
            + ([steps[-1].end - steps[-1].start + tail] if steps else []))


class _ReplayCost:
    """A cost model that returns the measured cycle times and records each plan's features."""

    def __init__(self, cycles: Sequence[float]):
        self.cycles, self.features = list(cycles), []

    def step_time(self, plan) -> float:
        i = len(self.features)
        self.features.append((plan.num_prefill_tokens, plan.num_decode_tokens, sum(plan.kv_lens)))
        return self.cycles[i] if i < len(self.cycles) else 0.0


def replay_rows(config: scheduler.SchedulerConfig, requests: Sequence[scheduler.Request],
                steps: Sequence, arm: str = "") -> list[dict]:
    """One calibration row per real step: its measured times and its plan's features.

    Raises:
      ValueError: the replayed plans do not match the trace (another config or workload).
    """
    cost = _ReplayCost(cycle_times(steps))
    simulate(config, cost, requests)
    rows = []
    for i, (step, cycle) in enumerate(zip(steps, cost.cycles)):
        if i >= len(cost.features):
            raise ValueError(f"arm {arm}: the replay ended after {i} of {len(steps)} steps")
        p, d, kv = cost.features[i]
        if (p, d) != (step.prefill_tokens, step.decode_tokens):
            raise ValueError(f"arm {arm}: replay diverged at step {i}: planned {p} prefill / {d} "
                             f"decode tokens, the trace has {step.prefill_tokens} / "
                             f"{step.decode_tokens}")
        rows.append({"arm": arm, "index": i, "start": step.start, "end": step.end,
                     "cycle_s": cycle, "prefill_tokens": p, "decode_tokens": d, "kv_read": kv,
                     "num_seqs": getattr(step, "num_seqs", None),
                     "compiled": bool(getattr(step, "compiled", False))})
    return rows


def write_rows(rows: Iterable[Mapping], path) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r)) + "\n")


def read_rows(path) -> list[dict]:
    """Calibration rows, or an engine trace (StepRecord JSONL) turned into rows."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if rows and "cycle_s" not in rows[0]:
        steps = [_Step(r["start"], r["end"]) for r in rows]
        for r, c in zip(rows, cycle_times(steps)):
            r["cycle_s"] = c
    return rows


@dataclasses.dataclass(frozen=True)
class _Step:
    start: float
    end: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitReport:
    """How well a fitted model explains the steps it was fitted on (seconds)."""

    num_steps: int
    features: tuple[str, ...]  # the features present in the data (kv_read may be missing)
    rmse_s: float
    mean_abs_rel_err: float  # mean |predicted - measured| / measured
    max_abs_err_s: float
    r2: float
    by_kind: Mapping[str, Mapping[str, float]]  # kind -> steps, measured and predicted means

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        kinds = ", ".join(f"{k}: {v['steps']} steps, measured {1e3 * v['measured_s']:.1f} ms, "
                          f"predicted {1e3 * v['predicted_s']:.1f} ms"
                          for k, v in self.by_kind.items())
        return (f"fit over {self.num_steps} steps ({', '.join(self.features)}): RMSE "
                f"{1e3 * self.rmse_s:.1f} ms, mean |relative error| "
                f"{100 * self.mean_abs_rel_err:.1f}%, "
                f"max |error| {1e3 * self.max_abs_err_s:.1f} ms, R^2 {self.r2:.3f}; {kinds}")


def fit_cost_model(rows: Sequence[Mapping]) -> tuple[CostModel, FitReport]:
    """Non-negative least squares of cycle time on [1, prefill_tokens, decode_tokens, kv_read].

    A feature missing from the rows (kv_read in a plain engine trace) or constant zero gets
    coefficient 0. Columns are scaled to unit maximum before solving (conditioning).
    """
    if len(rows) < 2:
        raise ValueError(f"need at least 2 steps to fit, got {len(rows)}")
    present = [f for f in FEATURES if all(r.get(f) is not None for r in rows)
               and any(r[f] for r in rows)]
    x = np.array([[1.0] + [float(r[f]) for f in present] for r in rows])  # [N, 1 + F]
    y = np.array([float(r["cycle_s"]) for r in rows])  # [N]
    scale = np.abs(x).max(axis=0)
    coef, _ = nnls(x / scale, y)
    coef = coef / scale
    values = dict(zip(["c0"] + [COEFFS[1 + FEATURES.index(f)] for f in present], coef))
    model = CostModel(**{c: float(values.get(c, 0.0)) for c in COEFFS})
    pred = x @ coef
    err = pred - y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    by_kind = {}
    for kind in ("prompt", "mixed", "decode"):
        idx = [i for i, r in enumerate(rows) if step_kind(r["prefill_tokens"], r["decode_tokens"]) == kind]
        if idx:
            by_kind[kind] = {"steps": len(idx), "measured_s": float(y[idx].mean()),
                             "predicted_s": float(pred[idx].mean())}
    report = FitReport(
        num_steps=len(rows), features=tuple(present),
        rmse_s=float(np.sqrt((err ** 2).mean())),
        mean_abs_rel_err=float((np.abs(err) / np.maximum(y, 1e-12)).mean()),
        max_abs_err_s=float(np.abs(err).max()),
        r2=1.0 - float((err ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan"),
        by_kind=by_kind)
    return model, report


def save_cost_model(model: CostModel, path) -> None:
    """Writes the model as `CostModel.to_json()` (also readable by scripts/simulate.py)."""
    with open(path, "w") as f:
        json.dump(model.to_json(), f, indent=2)
        f.write("\n")


def load_cost_model(path) -> CostModel:
    """A cost model JSON file, or the name of a preset (scheduler.simulate.COST_PRESETS)."""
    if str(path) in COST_PRESETS:
        return COST_PRESETS[str(path)]
    with open(path) as f:
        return CostModel.from_json(json.load(f))


def simulate_arm(arm: Arm, base: scheduler.SchedulerConfig, requests: Sequence[scheduler.Request],
                 cost: CostModel, window_s: float) -> BurstRun:
    """One arm through the simulator: the burst (same max_tokens for all) at t = 0, steps until
    done or window_s."""
    result = simulate(arm.config(base), cost, requests, until=window_s)
    return BurstRun(arm=arm.name, t0=0.0, window_s=window_s, requests=result.requests,
                    steps=result.steps, max_new_tokens=max(r.max_tokens for r in requests),
                    configured_knobs=arm.configured_knobs)
