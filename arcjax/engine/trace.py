"""Per-step trace: a run summary and JSONL export of `StepRecord`s.

The record type is `scheduler.metrics.StepRecord`, the one step record of the project: the
simulator writes the same type, so every metric reads real and simulated runs alike.

NOTE: step times are taken after the device result is on the host, so the sum of
step durations is a lower bound of the wall time spent in `step()`; the self-check
reports that fraction (the rest is host work between steps: emitting outputs,
detokenizing, the caller's own code).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Iterable, Mapping

from scheduler.metrics import StepRecord, engagement, knob_report

__all__ = ["StepRecord", "summarize", "write_jsonl"]


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

