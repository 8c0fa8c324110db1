"""What users get back: `RequestOutput` with its `RequestMetrics`."""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: tuple[float, ...]  # host time each output token became known
    finished_time: float | None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return (None if self.first_scheduled_time is None
                else self.first_scheduled_time - self.arrival_time)

    @property
    def itl(self) -> tuple[float, ...]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return statistics.fmean(self.itl) if len(self.token_times) > 1 else None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str  # all generated text so far (stop string excluded)
    token_ids: tuple[int, ...]  # all generated token ids so far
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" | "error" | None while running
    metrics: RequestMetrics
    delta_text: str = ""  # text new since the previous output for this request
    error: str | None = None  # why the request finished with reason "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
