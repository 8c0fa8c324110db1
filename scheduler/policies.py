"""`schedule`: which phases each policy runs in a step. The mechanics live in planner.py.

  prefill_first  (legacy) a step is prefill-only or decode-only. If prefill work can run (floor
                 permitting), the step admits waiting prompts whole, FCFS, while blocks, the budget
                 and the cap allow; otherwise every decode-ready sequence decodes one token.
  alternate      prefill steps (partials, then new prompts, chunked to the budget) alternate with
                 decode steps: at least max(1, prefill_floor_steps) decode steps between two
                 prefill steps while anything decodes.
  token_budget   (default, stall-free) every step: decodes first, then partial prefills, then new
                 prompts, chunked to fill what is left of the budget. The floor, if set, holds the
                 prefill part back for F steps after a step with prefill; decodes always run.

Knobs common to all policies: prefill_max_seqs caps admissions (waiting -> running) per step;
prefill_floor_steps counts steps that had decode rows and no prefill; max_num_seqs bounds running
sequences; watermark_blocks is kept free by admissions.

NOTE: legacy whole-prompt prefill cannot split a prompt, so a lone prompt longer than
max_num_batched_tokens runs alone in its step (engaged.oversize_prompt). It is the only case where
a step exceeds the budget.

NOTE: liveness. add_request refuses what cannot fit alone in the cache, so the best-ranked
unfinished request (smallest key) always fits once the others leave. It is never preempted:
victims rank below their requester, and a decode row preempts itself only when it ranks lowest
of all unscheduled sequences, which the best-ranked one never does while others run. Decoding,
it moves every step (token_budget), every other step (alternate) or after at most one prompt step
per waiting request (prefill_first). Waiting for blocks or budget, it keeps everyone behind it out
(FCFS; a held partial blocks admissions), so the others only finish or leave. A plan is never empty
while work exists unless it preempted. Hence every request finishes: without preemption within
last_arrival + 1 + sum(prompt + max_tokens - 1) steps, each preemption adding at most the longest
request's length (checked in tests/test_scheduler_properties.py). Prefix caching keeps all this:
cached blocks nobody holds count as free (they are evicted on demand), a hit only shortens the
work, and a shared block is freed only when its last holder releases it.
"""

from __future__ import annotations

from scheduler.scheduler_config import GEOMETRY_FIELDS, SchedulerConfig
from scheduler.scheduler_errors import ConfigError, StepOrderError
from scheduler.step_plan import StepPlan
from scheduler.planner import StepBuilder
from scheduler.spec import Drafts, check_drafts
from scheduler.state import SchedulerState


def schedule(state: SchedulerState, config: SchedulerConfig,
             spec_token_ids: Drafts | None = None) -> StepPlan:
    """Plans one step. Pure: reads only its arguments, returns new values, mutates nothing.

    Args:
      state: the state after the previous commit (not one with a plan in flight).
      config: the knobs for this step; may differ from the state's config except for the cache
        geometry and the adapter slots (`scheduler_config.GEOMETRY_FIELDS`).
      spec_token_ids: speculative decoding: draft tokens proposed for decode-ready requests
        (by id; others are ignored). A decode row verifies as many of its drafts as what is
        left of the budget and of the free blocks above the watermark allows, never past
        max_tokens (scheduler/spec.py); `plan.spec_token_ids` says how many each row got.

    Returns:
      The plan; `plan.state` is what `commit` takes with the step's sampled tokens.

    Raises:
      InputError: a draft that is not a sequence of int token ids >= 0.
      StepOrderError: `state` already has a plan in flight.
      ConfigError: `config` describes another KV cache than the state's (a field of
        `GEOMETRY_FIELDS` differs: block_size, num_blocks, enable_prefix_caching, sliding_window,
        kv_cache_groups, num_host_blocks or max_loras; the error names the field).
    """
    if state.in_flight:
        raise StepOrderError(f"step {state.step}: commit the plan in flight before scheduling")
    if config is not state.config and not config.same_cache(state.config):
        field = next(f for f in GEOMETRY_FIELDS if getattr(config, f) != getattr(state.config, f))
        raise ConfigError(field, f"{', '.join(GEOMETRY_FIELDS)} must match the state's config")
    if spec_token_ids:
        check_drafts(spec_token_ids)
    builder = StepBuilder(state, config, spec_token_ids)
    decoding = len(state.decoding) > 0
    prefill_work = bool(state.partial or state.waiting)
    floor = config.prefill_floor_steps
    if config.policy == "alternate":
        floor = max(1, floor)
    floor_open = not decoding or state.decode_steps_since_prefill >= floor
    if prefill_work and not floor_open:
        builder.hold_for_floor()
    if config.policy == "token_budget":
        builder.run_decodes()
        if floor_open:
            builder.run_partials(whole=False)
            builder.admit(whole=False)
    else:
        whole = config.policy == "prefill_first"
        if floor_open and prefill_work:
            builder.run_partials(whole)
            builder.admit(whole)
        if not builder.num_rows:
            builder.run_decodes()
    return builder.build()
