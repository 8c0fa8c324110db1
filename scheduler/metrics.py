"""Burst metrics as pure functions, shared by the simulator, the real engine and the burst bench.

Inputs are duck-typed so engine records fit as they are:
  requests: objects with `arrival_time` (s) and `token_times` (s, one per output token, in order);
  steps: objects with `start`, `end` (s), `prefill_tokens` and `decode_tokens`.

Times are on one clock; a window [start, end] bounds what counts as delivered.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

STEP_KINDS = ("prompt", "mixed", "decode")


class RequestTimes(Protocol):
    arrival_time: float
    token_times: Sequence[float]


class StepTimes(Protocol):
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def step_kind(prefill_tokens: int, decode_tokens: int) -> str:
    """"prompt" (prefill only), "mixed", "decode" (decode only) or "idle" (nothing ran).

    The one definition of a step's kind: `StepPlan.kind` and `steps_by_kind` both call it.
    """
    if prefill_tokens:
        return "mixed" if decode_tokens else "prompt"
    return "decode" if decode_tokens else "idle"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A pipe table: every column padded to its widest cell, a `|---|` rule under the header."""
    lines = [list(header), *map(list, rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(lines[0]), rule, *map(fmt, lines[1:])])


def ttfts(requests: Iterable[RequestTimes], window_end: float = math.inf) -> list[float]:
    """Time to first token of every request whose first token came by `window_end`."""
    return [r.token_times[0] - r.arrival_time for r in requests
            if r.token_times and r.token_times[0] <= window_end]


def tokens_in_window(requests: Iterable[RequestTimes], start: float, end: float) -> int:
    """Output tokens delivered inside [start, end]."""
    return sum(1 for r in requests for t in r.token_times if start <= t <= end)


def users_with_first_token(requests: Iterable[RequestTimes], start: float, end: float) -> int:
    """Requests whose first token arrived inside [start, end]."""
    return sum(1 for r in requests if r.token_times and start <= r.token_times[0] <= end)


def throughput(requests: Iterable[RequestTimes], start: float, end: float) -> float:
    """Aggregate output tokens per second over the window."""
    return tokens_in_window(requests, start, end) / (end - start) if end > start else math.nan


def inter_token_gaps(request: RequestTimes) -> list[float]:
    """Times between consecutive tokens of one request."""
    return [b - a for a, b in zip(request.token_times, request.token_times[1:])]


def longest_gap(requests: Iterable[RequestTimes]) -> float:
    """Longest time between two consecutive tokens of any one request (0 if none has two)."""
    return max((b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])),
               default=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KindStats:
    """Steps of one kind: how many and their mean duration (s)."""

    count: int
    mean_s: float


def steps_by_kind(steps: Iterable[StepTimes]) -> dict[str, KindStats]:
    """Count and mean duration of prompt-only, mixed and decode-only steps."""
    durations: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}
    for step in steps:
        kind = step_kind(step.prefill_tokens, step.decode_tokens)
        if kind in durations:
            durations[kind].append(step.end - step.start)
    return {kind: KindStats(count=len(d), mean_s=sum(d) / len(d) if d else 0.0)
            for kind, d in durations.items()}


def prefill_wall(steps: Iterable[StepTimes]) -> float:
    """Total duration of steps that computed prompt tokens."""
    return sum(s.end - s.start for s in steps if s.prefill_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BurstSummary:
    """The burst table of one run (times in seconds)."""

    num_requests: int
    window: tuple[float, float]
    ttft_p50: float
    ttft_p90: float
    ttft_max: float
    ttft_min: float
    throughput: float
    tokens_delivered: int
    users_with_first_token: int
    kinds: Mapping[str, KindStats]
    prefill_wall: float
    longest_gap: float


def summarize(requests: Sequence[RequestTimes], steps: Sequence[StepTimes],
              window: tuple[float, float] | None = None) -> BurstSummary:
    """All burst metrics. The default window runs from the first arrival to the last token."""
    if window is None:
        first = min((r.arrival_time for r in requests), default=0.0)
        last = max((t for r in requests for t in r.token_times), default=first)
        window = (first, last)
    start, end = window
    inside = [s for s in steps if s.end <= end]
    delays = ttfts(requests, end)
    return BurstSummary(
        num_requests=len(requests), window=window,
        ttft_p50=percentile(delays, 50), ttft_p90=percentile(delays, 90),
        ttft_max=max(delays, default=math.nan), ttft_min=min(delays, default=math.nan),
        throughput=throughput(requests, start, end),
        tokens_delivered=tokens_in_window(requests, start, end),
        users_with_first_token=users_with_first_token(requests, start, end),
        kinds=steps_by_kind(inside), prefill_wall=prefill_wall(inside),
        longest_gap=longest_gap([_Clipped(r, end) for r in requests]),
    )


@dataclasses.dataclass(frozen=True)
class _Clipped:
    """A request's tokens up to the window end."""

    request: RequestTimes
    end: float

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def token_times(self) -> list[float]:
        return [t for t in self.request.token_times if t <= self.end]


def format_table(columns: Mapping[str, BurstSummary]) -> str:
    """The burst table of docs/motivation.md, one column per run."""
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell) -> None:
        rows.append((label, [cell(s) for s in columns.values()]))

    row("TTFT p50", lambda s: f"{s.ttft_p50:.2f} s")
    row("TTFT p90", lambda s: f"{s.ttft_p90:.2f} s")
    row("TTFT max", lambda s: f"{s.ttft_max:.2f} s")
    row("TTFT min", lambda s: f"{s.ttft_min:.2f} s")
    row("aggregate throughput over the window", lambda s: f"{s.throughput:.2f} tok/s")
    row("tokens delivered", lambda s: f"{s.tokens_delivered}")
    row("users with a first token", lambda s: f"{s.users_with_first_token} / {s.num_requests}")
    for kind, label in (("prompt", "prompt-only"), ("mixed", "mixed"), ("decode", "decode-only")):
        row(f"{label} steps / mean duration",
            lambda s, kind=kind: f"{s.kinds[kind].count} / {s.kinds[kind].mean_s * 1e3:,.0f} ms")
    row("total prefill wall", lambda s: f"{s.prefill_wall:.1f} s")
    row("longest gap between two tokens of a user", lambda s: f"{s.longest_gap:.2f} s")
    row("window", lambda s: f"{s.window[1] - s.window[0]:.1f} s")
    return markdown_table(["", *columns], [[label, *cells] for label, cells in rows])


# --- step records and knob engagement -----------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One step, real (the engine's trace) or simulated (`scheduler.simulate`).

    Attributes:
      start, end: the step's times (seconds, the run's clock).
      prefill_tokens, decode_tokens, num_seqs: what ran.
      engaged: what each scheduling knob did (`Engaged.as_dict()`; falsy = did not act).
      cached_tokens: prompt tokens admitted this step from the prefix cache.
      index: the step's number in its run.
      bucket: (T, S, max_q_len) the engine ran it in (None in simulation).
      compiled: the engine had to acquire an executable in this step (never after warm-up).
      sampled: requests that got a token this step (engine).
      error: set when the engine's step failed (its requests finished "error").
      dispatched: when the step was handed to the device (engine; None in simulation).
      ready: when the device finished it, if the engine watched (`ModelRunner.
        watch_completion`), else None. `device_idle_gaps` reads both.
    """

    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    engaged: Mapping[str, object]
    cached_tokens: int = 0
    index: int = 0
    bucket: tuple[int, int, int] | None = None
    compiled: bool = False
    sampled: tuple = ()
    error: str | None = None
    dispatched: float | None = None
    ready: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        return step_kind(self.prefill_tokens, self.decode_tokens)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["engaged"] = _jsonable(dict(self.engaged))
        return d


def _jsonable(x):
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# Scheduler config field -> the `engaged` entry that records it acting.
KNOB_ENGAGEMENT = {
    "prefill_max_seqs": "cap_deferred",
    "prefill_floor_steps": "floor_held",
    "long_prefill_token_threshold": "long_prefill_capped",
    "max_num_partial_prefills": "partial_limit",
    "max_num_batched_tokens": "budget_full_at",
    "max_num_seqs": "seqs_full",
    "chunk_tile": "tile_trimmed",
}


def engagement(records: Iterable[StepRecord]) -> dict[str, int]:
    """How many steps each knob engaged in (knobs that never engaged map to 0).

    An `engaged` entry is falsy (0, False, ()) exactly when its knob did not act.
    """
    counts: Counter = Counter()
    for r in records:
        for knob, value in r.engaged.items():
            counts[knob] += bool(value)
    return dict(counts)


def knob_report(counts: Mapping[str, int], configured: Mapping[str, object]) -> dict:
    """For every configured knob (config field name): its value, and in how many steps
    its `engaged` entry acted."""
    report = {}
    for knob, value in dict(configured).items():
        n = counts.get(KNOB_ENGAGEMENT.get(knob, knob), 0)
        report[knob] = {"value": value, "engaged_steps": n, "engaged": n > 0}
    return report
