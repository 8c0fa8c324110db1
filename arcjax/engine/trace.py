"""Per-step trace: one record per engine step, a run summary, JSONL export.

NOTE: step times are taken after the device result is on the host, so the sum of
step durations is a lower bound of the wall time spent in `step()`; the self-check
reports that fraction (the rest is host work between steps: emitting outputs,
detokenizing, the caller's own code).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Iterable, Mapping

from scheduler.metrics import step_kind


@dataclasses.dataclass(frozen=True)
class StepRecord:
    index: int
    start: float
    end: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    bucket: tuple[int, int, int]  # (T, S, max_q_len)
    compiled: bool  # this step compiled its bucket (never after warm-up)
    engaged: Mapping  # the plan's record of what each scheduling knob did
    sampled: tuple[str, ...] = ()  # requests that got a token this step
    error: str | None = None  # set when the step failed (its requests finished "error")
    cached_tokens: int = 0  # prompt tokens admitted this step from the prefix cache

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


def summarize(records: list[StepRecord], wall_time: float,
              configured_knobs: Mapping[str, object] = ()) -> dict:
    """Run summary: step counts by kind, step-time coverage of wall time, and for every
    configured knob whether it ever engaged and how often."""
    kinds = Counter(r.kind for r in records)
    busy = sum(r.duration for r in records)
    knobs = knob_report(engagement(records), configured_knobs)
    cached = sum(r.cached_tokens for r in records)
    computed = sum(r.prefill_tokens for r in records)
    return {
        "steps": len(records),
        "steps_by_kind": dict(kinds),
        "compiles_in_run": sum(r.compiled for r in records),
        "step_time_s": busy,
        "wall_time_s": wall_time,
        "step_time_fraction_of_wall": busy / wall_time if wall_time > 0 else None,
        "knobs": knobs,
        # Prompt tokens served from the prefix cache over all prompt tokens the steps admitted
        # or computed (recomputation after preemption counts as computed).
        "prefix_cache": {"cached_tokens": cached, "computed_prompt_tokens": computed,
                         "hit_rate": cached / (cached + computed) if cached + computed else None},
        "knobs_never_engaged": [k for k, v in knobs.items() if not v["engaged"]],
    }


def write_jsonl(records: Iterable[StepRecord], path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")

