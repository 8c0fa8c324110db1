"""Per-step trace: the engine's ring of `StepRecord`s with its sink and self-check
(`StepTrace`: it builds each step's record too), a run summary and JSONL export.

The record type is `scheduler.metrics.StepRecord`, the one step record of the project: the
simulator writes the same type, so every metric reads real and simulated runs alike.

NOTE: a step's record spans from its planning to its tokens being on the host. With
overlapped scheduling those spans overlap (step N+1 is planned and launched before step
N's tokens are read), so the summary's step time is the union of the spans, a lower bound
of the wall time spent in `step()`; the rest is host work outside any step (emitting
outputs, detokenizing, the caller's own code).

Device idle time between consecutive steps (`device_idle_gaps`) is the time from one
step's completion on the device to the next step's dispatch, when positive. The
completion time is exact when the runner watches completions (`ModelRunner.
watch_completion`, which scripts/bench_throughput.py turns on); otherwise it
is when the host received the tokens, which overlapped scheduling reads only after the
next dispatch (so unwatched overlapped gaps read 0).
"""

from __future__ import annotations

import collections
import json
from collections import Counter
from typing import Callable, Iterable, Mapping

import scheduler
from arcjax.runtime.buckets import Bucket
from arcjax.runtime.step_handle import StepHandle
from arcjax.runtime.step_output import StepOutput
from arcjax.spec_decode.speculator import SpecCounts
from pallas_kernels.verified import VERIFY_COMMAND
from scheduler.metrics import StepRecord, engagement, knob_report, spec_decode_summary

__all__ = ["StepRecord", "StepTrace", "attention_report", "busy_time", "device_idle_gaps",
           "layer_loop_report", "summarize", "write_jsonl"]


class StepTrace:
    """The engine's trace (stepping thread): a ring of the last `capacity` records, an
    optional sink called with each, and per request the tokens the trace sampled for it
    (`check` compares them with the requests' outputs)."""

    def __init__(self, capacity: int):
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self.sink: Callable[[StepRecord], None] | None = None  # e.g. a JSONL writer
        self.sink_error: str | None = None  # why a failing sink was detached
        self.num_steps = 0
        self._sampled: dict[str, int] = {}  # per held request
        self._errors: list[str] = []

    def step_record(self, plan: scheduler.StepPlan, *, start: float, end: float,
                    bucket: Bucket, compiled: bool, handle: StepHandle, out: StepOutput,
                    sampled: tuple[str, ...], spec: SpecCounts) -> StepRecord:
        """The record of a step that ran: what it planned and ran in (`bucket`; `compiled`:
        its launch acquired an executable), when it was dispatched and when the device
        finished it (`handle`: waits for the completion watcher, when one watches), the
        tokens each expert received, the requests it `sampled` for and its speculative
        decoding counts."""
        return StepRecord(
            index=self.num_steps, start=start, end=end, prefill_tokens=plan.num_prefill_tokens,
            decode_tokens=plan.num_decode_tokens, num_seqs=plan.num_seqs,
            bucket=(bucket.tokens, bucket.seqs, bucket.max_q_len), compiled=compiled,
            engaged=plan.engaged.as_dict(), sampled=sampled,
            cached_tokens=plan.num_cached_tokens, dispatched=handle.dispatched,
            ready=handle.wait_ready(), expert_tokens=out.expert_tokens(),
            **spec.record_fields())

    def failed_record(self, plan: scheduler.StepPlan | None, *, start: float, end: float,
                      error: str) -> StepRecord:
        """The record of a step that failed (`plan`: None when planning itself failed)."""
        return StepRecord(
            index=self.num_steps, start=start, end=end, prefill_tokens=0, decode_tokens=0,
            num_seqs=plan.num_seqs if plan else 0, bucket=(0, 0, 0), compiled=False,
            engaged=(plan.engaged if plan else scheduler.Engaged()).as_dict(), sampled=(),
            error=error)

    def record(self, record: StepRecord, *, strict: bool) -> None:
        """Appends a record and hands it to the sink. A sink that raises is detached;
        `strict`: the error is raised too (the step fails) and nothing is appended."""
        if self.sink is not None:
            try:
                self.sink(record)
            except Exception as e:  # noqa: BLE001
                self.sink_error = f"trace_sink failed and was detached: {e!r}"
                self.sink = None
                if strict:
                    raise
        self.num_steps += 1
        self.records.append(record)

    def admit(self, request_id: str) -> None:
        self._sampled[request_id] = 0

    def sampled(self, counts: Mapping[str, int]) -> None:
        """Adds the tokens a step sampled per request (all of them or, when a request is
        unknown, none: KeyError)."""
        unknown = [rid for rid in counts if rid not in self._sampled]
        if unknown:
            raise KeyError(f"the trace admitted no request {unknown}")
        for rid, count in counts.items():
            self._sampled[rid] += count

    def release(self, request_id: str, num_tokens: int) -> None:
        traced = self._sampled.pop(request_id, 0)
        if traced != num_tokens:
            self._errors.append(f"{request_id}: {num_tokens} tokens, {traced} traced")

    def check(self, held: Mapping[str, int]) -> int:
        """Self-check: every request released so far had exactly as many tokens as the
        trace sampled for it, and so far every request of `held` (id -> tokens) too.
        Returns len(held). Raises AssertionError listing disagreements."""
        bad = self._errors + [f"{rid}: {n} tokens, {self._sampled.get(rid)} traced"
                              for rid, n in held.items() if n != self._sampled.get(rid)]
        if bad:
            raise AssertionError(f"trace disagrees with outputs: {bad}")
        return len(held)


def busy_time(records: Iterable[StepRecord]) -> float:
    """Seconds covered by at least one step's [start, end] span (their union)."""
    total, reach = 0.0, float("-inf")
    for r in sorted(records, key=lambda r: r.start):
        if r.end > reach:
            total += r.end - max(r.start, reach)
            reach = r.end
    return total


def device_idle_gaps(records: list[StepRecord]) -> list[float]:
    """Per pair of consecutive successful steps: max(0, next dispatch - this completion)
    (completion = `ready`, else the host's `end`). Pairs without a dispatch time are skipped."""
    steps = [r for r in records if r.error is None and r.dispatched is not None]
    return [max(0.0, b.dispatched - (a.ready if a.ready is not None else a.end))
            for a, b in zip(steps, steps[1:])]


def summarize(records: list[StepRecord], wall_time: float,
              configured_knobs: Mapping[str, object] = ()) -> dict:
    """Run summary: step counts by kind, step-time coverage of wall time, for every
    configured knob whether it ever engaged and how often, and speculative decoding's
    acceptance (`scheduler.metrics.spec_decode_summary`)."""
    kinds = Counter(r.kind for r in records)
    busy = busy_time(records)
    gaps = device_idle_gaps(records)
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
        "device_idle_gap_s": {"total": sum(gaps), "mean": sum(gaps) / len(gaps) if gaps else None,
                              "watched": bool(records) and all(
                                  r.ready is not None for r in records if r.error is None)},
        "knobs": knobs,
        # Prompt tokens served from the prefix cache over all prompt tokens the steps admitted
        # or computed (recomputation after preemption counts as computed).
        "prefix_cache": {"cached_tokens": cached, "computed_prompt_tokens": computed,
                         "hit_rate": cached / (cached + computed) if cached + computed else None},
        "knobs_never_engaged": [k for k, v in knobs.items() if not v["engaged"]],
        # speculative decoding: acceptance rate, mean acceptance length, per position
        "spec_decode": spec_decode_summary(records),
    }


def attention_report(configured: str, impls: Mapping[tuple[int, int, int], str],
                     records: Iterable[StepRecord] | None = None,
                     verified: Mapping[tuple[int, int, int], bool | None] | None = None) -> dict:
    """Which attention implementation the engine's steps run.

    Args:
      configured: the engine's `attention_impl` ("auto" or an implementation).
      impls: (T, S, max_q_len) -> implementation, resolved when each bucket was compiled
        (`ModelRunner.attention_impls`).
      records: the steps to report on (only the buckets they ran in, with step counts);
        None = every bucket acquired so far.
      verified: (T, S, max_q_len) -> whether a recorded GPU pass vouches for the bucket's
        implementation (`ModelRunner.attention_verified`; None: nothing to verify);
        None = not reported.

    Returns:
      {"configured", "decode": implementations of the decode-only buckets (max_q_len 1),
      "prefill": those of the buckets with prompt chunks (prefill, mixed, speculative
      verification), "buckets": [{"tokens", "seqs", "max_q_len", "impl"[, "verified"]
      [, "steps"]}]}; the lists are sorted and empty when no such bucket ran. With
      `verified`: also "verified" (no reported bucket runs a GPU kernel without a
      recorded pass) and, when false, "unverified" (those implementations) and
      "verify_command" (what records a pass, on the GPU).
    """
    steps = None
    if records is not None:
        steps = Counter(r.bucket for r in records if r.bucket in impls)
    buckets = sorted(impls if steps is None else steps)
    kinds: dict[str, set[str]] = {"decode": set(), "prefill": set()}
    rows = []
    for b in buckets:
        kinds["decode" if b[2] == 1 else "prefill"].add(impls[b])
        row = {"tokens": b[0], "seqs": b[1], "max_q_len": b[2], "impl": impls[b]}
        if verified is not None:
            row["verified"] = verified.get(b)
        if steps is not None:
            row["steps"] = steps[b]
        rows.append(row)
    report = {"configured": configured, **{k: sorted(v) for k, v in kinds.items()},
              "buckets": rows}
    if verified is not None:
        unverified = sorted({r["impl"] for r in rows if r["verified"] is False})
        report["verified"] = not unverified
        if unverified:
            report |= {"unverified": unverified, "verify_command": VERIFY_COMMAND}
    return report


def layer_loop_report(configured: str, loops: Mapping[tuple[int, int, int], str],
                      records: Iterable[StepRecord]) -> dict:
    """How the engine's steps ran the decoder's layers (arcjax/model/layer_arrays.py).

    Args:
      configured: the engine's `layer_loop` ("auto", "scan" or "unrolled").
      loops: (T, S, max_q_len) -> "scan" | "unrolled", per bucket acquired
        (`ModelRunner.layer_loops`).
      records: the steps to report on (only the buckets they ran in).

    Returns:
      {"configured", "decode": the layer loops of the decode-only buckets (max_q_len 1),
      "prefill": those of the buckets with prompt chunks}, sorted lists (empty when no
      such bucket ran).
    """
    kinds: dict[str, set[str]] = {"decode": set(), "prefill": set()}
    for b in {r.bucket for r in records if r.bucket in loops}:
        kinds["decode" if b[2] == 1 else "prefill"].add(loops[b])
    return {"configured": configured, **{k: sorted(v) for k, v in kinds.items()}}


def write_jsonl(records: Iterable[StepRecord], path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")

