"""Property-based tests of the step planner: random workloads driven through schedule/commit.

The harness (`drive`, tests/support/scheduler_drivers.py) keeps its own mirror of every request
(prompt + outputs it was told about) and checks each plan and each committed state against it,
independently of the planner's code:

  1. plan: budgets, row order, cursors, chunk tiles, sampling rows, token ids, block slots,
     admissions (cap, FCFS), preemptions, stall-freedom (token_budget);
  2. state after commit: every block free or owned by exactly one sequence, tables sized to the
     cursors, queues ordered, the partial-prefill limit;
  3. trace: the decode floor, liveness (see `test_liveness_*`), finished outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import POLICIES, Request, SchedulerConfig, SchedulerState
from scheduler import add_request, blocks_for, commit, schedule
from scheduler.prefix import chain_hashes
from support.scheduler_drivers import drive
from support.scheduler_workloads import HYPOTHESIS_SETTINGS, Workload, fake_token, workloads


# ---- budgets, chunks, blocks, FCFS, stall-freedom: checked on every step of random workloads ----

@settings(max_examples=150, **HYPOTHESIS_SETTINGS)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    drive(workload)


@settings(max_examples=60, **HYPOTHESIS_SETTINGS)
@given(workloads(aborts=True))
def test_aborts_free_everything(workload):
    drive(workload)


@settings(max_examples=25, **HYPOTHESIS_SETTINGS)
@given(workloads(max_requests=6))
def test_purity_inputs_unchanged_and_plans_repeatable(workload):
    drive(workload, purity=True)


@settings(max_examples=60, **HYPOTHESIS_SETTINGS)
@given(workloads(policy="token_budget", pressure=False, prefill_floor_steps=0))
def test_token_budget_mixes_prefill_and_decode_in_one_step(workload):
    """Stall-freedom itself is checked on every step by check_plan; here: whenever a prompt and a
    decode both have room, they share the step (no decode-only step while a prompt waits with
    budget, blocks and slots left)."""
    trace = drive(workload)
    for pre, plan in trace.steps:
        if plan.num_decode_rows and not plan.num_prefill_tokens:
            assert not pre.partial or plan.engaged.partials_held or plan.preempted
            assert not pre.waiting or plan.engaged.active(), "prompt left out for no reason"


# ---- prefix caching ---------------------------------------------------------------------------

@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(workloads(shared=True, aborts=True))
def test_prefix_caching_changes_no_output(workload):
    """Shared prefixes (ending inside a block, block-aligned, whole prompts): with caching on or
    off every request generates the same tokens (and `drive` checks, every step, that each row
    reads exactly its own tokens' KV, that cached digests match a recomputation from the token
    lists, that no cached block is written, and that blocks in use return to 0)."""
    outputs = {}
    for caching in (False, True):
        config = dataclasses.replace(workload.config, enable_prefix_caching=caching)
        trace = drive(dataclasses.replace(workload, config=config), sampler=fake_token)
        outputs[caching] = {rid: f.output_token_ids for rid, f in trace.outputs.items()}
        saved = sum(plan.num_cached_tokens for _, plan in trace.steps)
        assert saved == 0 or caching
    assert outputs[False] == outputs[True]


# ---- sliding windows --------------------------------------------------------------------------

@settings(max_examples=80, **HYPOTHESIS_SETTINGS)
@given(workloads(windows=True, aborts=True))
def test_sliding_window_releases_exactly_the_blocks_behind_each_window(workload):
    """Every layer slides: after each plan every running sequence holds exactly the blocks its
    window still reads, from its cursor on (check_window), the rest being back in the pool;
    every row reads the right token in every slot of its window (GhostCache); `drive`'s other
    checks (partition of the blocks, liveness guard, outputs) hold as without a window."""
    drive(workload)


@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(workloads(windows=True, shared=True, aborts=True))
def test_sliding_window_prefix_caching_changes_no_output(workload):
    """With a window, a waiting sequence reuses a cached prefix as far as its window needs it
    (the blocks before may be gone): outputs are those without caching, and every row still
    reads exactly its own tokens inside its window."""
    outputs = {}
    for caching in (False, True):
        config = dataclasses.replace(workload.config, enable_prefix_caching=caching)
        trace = drive(dataclasses.replace(workload, config=config), sampler=fake_token)
        outputs[caching] = {rid: f.output_token_ids for rid, f in trace.outputs.items()}
    assert outputs[False] == outputs[True]


def test_sliding_window_bounds_the_blocks_of_a_long_generation():
    """One request generating 200 tokens with a 16-token window in blocks of 4 holds at most
    16 / 4 + 1 blocks at any time; without the window it ends up holding 51."""
    held = {}
    for window in (None, 16):
        config = SchedulerConfig(block_size=4, num_blocks=64, sliding_window=window,
                                 chunk_tile=4, max_num_batched_tokens=8)
        request = Request(request_id=0, prompt_token_ids=tuple(range(1, 6)), max_tokens=200)
        trace = drive(Workload(config=config, requests=(request,), stop_after=(None,)))
        held[window] = max(plan.state.pool.num_in_use for _, plan in trace.steps)
    assert held[16] == 16 // 4 + 1 and held[None] == blocks_for(5 + 200 - 1, 4)


def test_window_prefix_survives_evicted_early_blocks():
    """A cached prefix whose first blocks were evicted is still reused as far as the window
    reaches back; without a window (all blocks needed) it is not."""
    from scheduler.prefix import PrefixCache
    from scheduler.window import window_prefix

    digests = chain_hashes(tuple(range(40)), 4)  # 10 blocks
    cache = PrefixCache.empty(16).registered([(b, d) for b, d in enumerate(digests)])
    cache, _ = cache.released((0, 1, 2))  # a window slid past them: released first, evicted first
    cache, _ = cache.released(tuple(range(3, 10)))
    evicted, cache = cache.evicted(3)
    assert sorted(evicted) == [0, 1, 2] and cache.longest_prefix(digests) == ()
    got = window_prefix(cache, digests, window=9, block_size=4)
    # a query at 40 reads keys 32..40: blocks 8, 9 cached -> the whole 10-block prefix
    assert got == (None,) * 8 + (cache.lookup(digests[8]), cache.lookup(digests[9]))
    assert window_prefix(cache, digests, window=1000, block_size=4) == ()


# ---- the cap ---------------------------------------------------------------------------------

def _columns(plan):
    return (plan.request_ids, plan.starts, plan.lengths, plan.samples, plan.token_ids,
            plan.block_tables, plan.preempted)


@settings(max_examples=60, **HYPOTHESIS_SETTINGS)
@given(workloads(prefill_max_seqs=0))
def test_cap_zero_reproduces_uncapped_plans(workload):
    uncapped = dataclasses.replace(workload, config=dataclasses.replace(
        workload.config, prefill_max_seqs=10**9))
    a, b = drive(workload), drive(uncapped)
    assert [_columns(p) for _, p in a.steps] == [_columns(p) for _, p in b.steps]


def test_cap_limits_admissions_in_legacy_burst():
    config = SchedulerConfig(policy="prefill_first", max_num_batched_tokens=4096,
                             prefill_max_seqs=4, max_num_seqs=64, block_size=16, num_blocks=4096)
    requests = tuple(Request(request_id=i, prompt_token_ids=(1,) * 100, max_tokens=3)
                     for i in range(10))
    trace = drive(Workload(config=config, requests=requests, stop_after=(None,) * 10))
    first = trace.steps[0][1]
    assert first.num_seqs == 4 and first.engaged.cap_deferred == 6


# ---- the floor -------------------------------------------------------------------------------

@settings(max_examples=80, **HYPOTHESIS_SETTINGS)
@given(workloads(), st.sampled_from(POLICIES), st.integers(0, 3))
def test_floor_keeps_decode_steps_between_prefill_steps(workload, policy, floor):
    config = dataclasses.replace(workload.config, policy=policy, prefill_floor_steps=floor)
    trace = drive(dataclasses.replace(workload, config=config))
    required = max(1, floor) if policy == "alternate" else floor
    decode_only = None  # decode-only steps since the last step with prefill; None: no prefill yet
    for pre, plan in trace.steps:
        if plan.num_prefill_tokens:
            if decode_only is not None and len(pre.decoding):
                assert decode_only >= required, f"prefill after {decode_only} decode steps"
            decode_only = 0
        elif plan.num_decode_rows and decode_only is not None:
            decode_only += 1


# ---- liveness --------------------------------------------------------------------------------

def _liveness_bound(workload: Workload, preemptions: int) -> int:
    """Steps within which everything finishes; see the test docstrings for the derivation."""
    return workload.last_arrival + 1 + workload.total_work + preemptions * workload.longest


@settings(max_examples=100, **HYPOTHESIS_SETTINGS)
@given(workloads(pressure=False))
def test_liveness_without_kv_pressure(workload):
    """Without KV pressure nothing is preempted and, once every request has arrived, every step
    computes at least one token of some request (check_plan: no empty plan while work exists).
    A request computes at most prompt + max_tokens - 1 tokens, so all requests finish within
    last_arrival + 1 + sum(prompt + max_tokens - 1) steps."""
    trace = drive(workload)
    assert trace.num_preempted == 0
    assert len(trace.steps) <= _liveness_bound(workload, 0)


@settings(max_examples=150, **HYPOTHESIS_SETTINGS)
@given(workloads(pressure=True, aborts=True))
def test_liveness_under_kv_pressure_and_aborts(workload):
    """Under KV pressure a preemption throws away at most longest - 1 computed tokens and can cost
    one step with no token, so the bound grows by `longest` per preemption. Preemptions stay
    finite because the best-ranked unfinished request is never preempted (checked on every step
    by check_plan) and so finishes, then the next one, and so on. `drive` also fails if a run
    exceeds last_arrival + 1 + total_work * (requests + 2) steps (a livelock guard)."""
    trace = drive(workload)
    assert len(trace.steps) <= _liveness_bound(workload, trace.num_preempted)


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_happens_and_recompute_keeps_outputs(caching):
    """Two sequences that cannot both grow in a tiny cache: the later one is preempted, recomputes
    prompt + outputs, and its outputs survive (the harness checks them token by token). With
    prefix caching the readmission skips the full blocks still cached (its own, released)."""
    config = SchedulerConfig(policy="token_budget", max_num_batched_tokens=8, chunk_tile=4,
                             block_size=2, num_blocks=6, max_num_seqs=4,
                             enable_prefix_caching=caching)
    requests = tuple(Request(request_id=i, prompt_token_ids=(5, 6, 7), max_tokens=8)
                     for i in range(2))
    trace = drive(Workload(config=config, requests=requests, stop_after=(None, None)))
    assert trace.num_preempted >= 1
    preempted = {rid for _, plan in trace.steps for rid in plan.preempted}
    assert preempted == {1}, "the most recently admitted sequence is the victim"
    admissions = [(plan.starts[i], plan.lengths[i], plan.num_cached[i])
                  for pre, plan in trace.steps for i, rid in enumerate(plan.request_ids)
                  if rid == 1 and any(s.request_id == 1 for s in pre.waiting)]
    assert len(admissions) >= 2
    start, length, cached = admissions[-1]  # the readmission: prompt + kept outputs
    assert start + length > 3
    if caching:
        assert cached > 0 and start == cached
        assert trace.outputs[1].num_cached_tokens == admissions[0][2]  # the first admission's
    else:
        assert cached == 0 and start == 0


@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(workloads(), st.data())
def test_knobs_may_change_between_steps(workload, data):
    """The state is policy-agnostic: switching policy and knobs each step keeps every invariant."""
    configs = [dataclasses.replace(workload.config, policy=p, prefill_floor_steps=f)
               for p in POLICIES for f in (0, 1)]
    choices = data.draw(st.lists(st.integers(0, len(configs) - 1), min_size=1, max_size=50))
    pick = lambda step: configs[choices[step % len(choices)]]  # noqa: E731
    drive(dataclasses.replace(workload, config=dataclasses.replace(
        workload.config, policy="token_budget")), config_for_step=pick)


@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(workloads(max_num_partial_prefills=3, pressure=False), st.data())
def test_max_num_seqs_may_shrink_between_steps(workload, data):
    """max_num_seqs bounds the rows of every step, even when it drops below the number of
    sequences already running (continuing partial prefills are capped too)."""
    seqs = data.draw(st.lists(st.sampled_from([1, 2, 6]), min_size=1, max_size=20))
    policy = data.draw(st.sampled_from(POLICIES))
    pick = lambda step: dataclasses.replace(  # noqa: E731
        workload.config, policy=policy, max_num_seqs=seqs[step % len(seqs)])
    drive(dataclasses.replace(workload, config=dataclasses.replace(
        workload.config, policy=policy)), config_for_step=pick)


def test_shrinking_max_num_seqs_caps_partial_prefills():
    config = SchedulerConfig(max_num_batched_tokens=8, chunk_tile=4, block_size=4,
                             long_prefill_token_threshold=4, num_blocks=64, max_num_seqs=4,
                             max_num_partial_prefills=2)
    state = SchedulerState.empty(config)
    for i in range(2):
        state = add_request(state, Request(request_id=i, prompt_token_ids=(1,) * 20,
                                           max_tokens=2))
    plan = schedule(state, config)
    state, _ = commit(plan.state, plan, [], 0.0)
    assert len(state.partial) == 2  # both mid-prefill
    narrow = dataclasses.replace(config, max_num_seqs=1)
    plan = schedule(state, narrow)
    assert plan.num_seqs == 1 and plan.engaged.seqs_full and plan.engaged.partials_held == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_long_prompt_never_blocks_forever(policy):
    """A prompt longer than the budget is chunked (or, legacy, run alone) and finishes."""
    config = SchedulerConfig(policy=policy, max_num_batched_tokens=16, chunk_tile=8,
                             block_size=4, num_blocks=64)
    requests = (Request(request_id="long", prompt_token_ids=tuple(range(100)), max_tokens=2),
                Request(request_id="short", prompt_token_ids=(1, 2), max_tokens=3))
    trace = drive(Workload(config=config, requests=requests, stop_after=(None, None)))
    assert set(trace.finished_at) == {"long", "short"}
    if policy == "prefill_first":
        assert any(plan.engaged.oversize_prompt for _, plan in trace.steps)
