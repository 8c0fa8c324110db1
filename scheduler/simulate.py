"""Runs the planner against a cost model instead of a model: same schedule/commit code path.

  1. Requests join (add_request) at the first step that starts at or after their arrival time.
  2. plan = schedule(state, config); the step lasts cost.step_time(plan). Prompt tokens served
     from the prefix cache are not in the plan's rows, so they cost nothing.
  3. A fake sampler returns one token per sampling row (lengths come from max_tokens), and
     commit(plan.state, plan, tokens, now=step end) folds them in.
  4. Every sampled token is delivered at its step's end; every step is recorded.

Deterministic: no clock, no randomness. Metrics come from scheduler.metrics, like a real run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from scheduler import metrics
from scheduler.metrics import StepRecord
from scheduler.commit import commit
from scheduler.scheduler_config import SchedulerConfig
from scheduler.step_plan import StepPlan
from scheduler.policies import schedule
from scheduler.request import Request, RequestId
from scheduler.state import SchedulerState, add_request


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Step time = c0 + c_prefill * prefill_tokens + c_decode * decode_rows + c_kv * kv_read.

    kv_read is the keys every row attends over (its kv_len), summed over the step's rows. Prompt
    tokens served from the prefix cache are not computed, so they cost nothing here.

    The defaults are the legacy H200 server of docs/motivation.md (~2B model, MTP depth 3), derived
    from its figures (the one definition; COST_PRESETS["h200_legacy"] is this):
      c_prefill: 12,160 prompt tokens in 43.2 s (K=32) -> 3.553 ms/token (281 tok/s); K=128's total
        prefill wall (171.3-176.5 s for 128 x 380 = 48,640 tokens: 276-284 tok/s) agrees.
      c0, c_decode: the decode-only steps at full occupancy: 32 rows 705.5 ms (mean of 709 and
        702), 128 rows 2,327.5 ms (mean of 2,335 and 2,320) -> 16.90 ms/row and c0 = 164.8 ms.
      c_kv: 0 (the figures do not separate attention reads from per-row cost).

    Attributes (seconds):
      c0: fixed cost of a step.
      c_prefill: per prompt token computed.
      c_decode: per decode row.
      c_kv: per key read by attention.
    """

    c0: float = 0.7055 - 32 * (2.3275 - 0.7055) / 96
    c_prefill: float = 43.2 / 12160
    c_decode: float = (2.3275 - 0.7055) / 96
    c_kv: float = 0.0

    def step_time(self, plan: StepPlan) -> float:
        kv_read = sum(plan.kv_lens) if self.c_kv else 0
        return (self.c0 + self.c_prefill * plan.num_prefill_tokens
                + self.c_decode * plan.num_decode_rows + self.c_kv * kv_read)

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, float]) -> "CostModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown cost model fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**{k: float(v) for k, v in data.items()})


# Named cost models (for --cost_model style flags): the legacy H200 server is the default one.
COST_PRESETS: dict[str, CostModel] = {"h200_legacy": CostModel()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """When one request arrived and when each of its tokens was delivered."""

    request_id: RequestId
    arrival_time: float
    token_times: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    """A simulated run: per-request token times (TTFT and inter-token gaps follow from them, see
    scheduler.metrics), per-step records, the clock at the end, and requests left unfinished."""

    requests: tuple[RequestRecord, ...]
    steps: tuple[StepRecord, ...]
    end_time: float
    unfinished: int

    def summary(self, window: tuple[float, float] | None = None) -> metrics.BurstSummary:
        """The burst metrics of this run (scheduler.metrics.summarize)."""
        return metrics.summarize(self.requests, self.steps, window)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache saved over the run."""
        return sum(step.cached_tokens for step in self.steps)

    def engagement(self) -> dict[str, int]:
        """Steps in which each knob engaged (knobs that never did are left out)."""
        return {k: n for k, n in metrics.engagement(self.steps).items() if n}


def burst(num_users: int, prompt_tokens: int, max_tokens: int, *,
          arrival_time: float = 0.0) -> tuple[Request, ...]:
    """`num_users` requests arriving together, each with a distinct prompt of `prompt_tokens`."""
    return tuple(
        Request(request_id=i, max_tokens=max_tokens, arrival_time=arrival_time,
                prompt_token_ids=tuple(1 + (i * 7919 + j) % 32000 for j in range(prompt_tokens)))
        for i in range(num_users))


def shared_prefix_burst(num_users: int, prefix_tokens: int, unique_tokens: int, max_tokens: int,
                        *, arrival_time: float = 0.0) -> tuple[Request, ...]:
    """`num_users` requests arriving together, each an S-token system prompt shared by all
    (`prefix_tokens`) followed by U tokens of its own (`unique_tokens`)."""
    prefix = tuple(1 + (j * 31) % 32000 for j in range(prefix_tokens))
    return tuple(
        Request(request_id=i, max_tokens=max_tokens, arrival_time=arrival_time,
                prompt_token_ids=prefix + tuple(1 + (i * 7919 + 17 + j) % 32000
                                                for j in range(unique_tokens)))
        for i in range(num_users))


def simulate(config: SchedulerConfig, cost: CostModel, requests: Iterable[Request], *,
             until: float | None = None) -> SimResult:
    """Runs the requests to completion (or until simulated time `until`).

    Raises whatever add_request raises for a request that cannot be served.
    """
    pending = sorted(requests, key=lambda r: r.arrival_time)
    times: dict[RequestId, list[float]] = {r.request_id: [] for r in pending}
    arrivals = {r.request_id: float(r.arrival_time) for r in pending}
    state = SchedulerState.empty(config)
    steps: list[StepRecord] = []
    now = float(pending[0].arrival_time) if pending else 0.0
    i = 0
    while (i < len(pending) or state.has_work()) and (until is None or now < until):
        while i < len(pending) and pending[i].arrival_time <= now:
            state = add_request(state, pending[i])
            i += 1
        if not state.has_work():
            now = float(pending[i].arrival_time)
            continue
        plan = schedule(state, config)
        if plan.is_empty:  # a step that only preempted; nothing ran
            if not plan.preempted:
                raise RuntimeError(f"planner made no progress at step {state.step}")
            state = plan.state
            continue
        end = now + cost.step_time(plan)
        sampled = [1 + (state.step + row) % 997 for row in range(plan.num_sampled)]
        state, _ = commit(plan.state, plan, sampled, end)
        for rid, samples in zip(plan.request_ids, plan.samples):
            if samples:
                times[rid].append(end)
        steps.append(StepRecord(start=now, end=end, prefill_tokens=plan.num_prefill_tokens,
                                decode_tokens=plan.num_decode_tokens, num_seqs=plan.num_seqs,
                                engaged=plan.engaged.as_dict(), index=len(steps),
                                cached_tokens=plan.num_cached_tokens))
        now = end
    records = tuple(RequestRecord(request_id=rid, arrival_time=arrivals[rid],
                                  token_times=tuple(t)) for rid, t in times.items())
    unfinished = len(state.request_ids()) + len(pending) - i
    return SimResult(requests=records, steps=tuple(steps), end_time=now, unfinished=unfinished)
