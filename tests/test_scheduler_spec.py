"""Speculative decoding in the pure planner: draft tokens on decode rows, variable acceptance.

The property tests drive random workloads (every policy, chunked prefill, KV pressure and
preemption, prefix caching, aborts, knobs changing between steps) with a proposer whose drafts
are right with a random per-row probability, so every acceptance count 0 .. k occurs. The fake
model is a function of (request, position), so the outputs are known: with speculation they
must equal the outputs without it. `drive` (tests/support/scheduler_drivers.py) checks every
plan and state as usual, plus: drafts take only what the rest of the step left (the plan
without them is the same), a row never drafts past max_tokens, rows read exactly their own KV
(drafts included), and only blocks full of verified tokens are ever cached.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import PLACEHOLDER, CommitError, InputError, Request, SchedulerConfig
from scheduler import SchedulerState, abort, add_request, advance, commit, schedule
from support.scheduler_drivers import drive, drive_overlapped
from support.scheduler_workloads import HYPOTHESIS_SETTINGS, OVERLAP_MODES, drafter, fake_token
from support.scheduler_workloads import workloads

_SEEDS = st.integers(0, 2**16)


def _outputs(trace) -> dict:
    return {rid: f.output_token_ids for rid, f in trace.outputs.items()}


@settings(max_examples=70, **HYPOTHESIS_SETTINGS)
@given(workloads(aborts=True), _SEEDS)
def test_speculation_changes_no_output(workload, seed):
    """Random acceptance counts under every policy, KV pressure, prefix caching and aborts: the
    outputs without speculation, and tokens per row step up with what was accepted."""
    spec = _outputs(drive(workload, sampler=fake_token, propose=drafter(seed, fake_token)))
    plain = _outputs(drive(workload, sampler=fake_token))
    if not workload.aborts:
        assert spec.keys() == plain.keys()
    # an abort lands at a step number: a faster run may finish the request before it
    assert {rid: spec[rid] for rid in spec.keys() & plain.keys()} == {
        rid: plain[rid] for rid in spec.keys() & plain.keys()}


@settings(max_examples=50, **HYPOTHESIS_SETTINGS)
@given(workloads(windows=True, aborts=True), _SEEDS)
def test_speculation_under_sliding_windows_changes_no_output(workload, seed):
    """Every layer slides and rows verify drafts: blocks behind each window still go back to
    the pool, draft positions read exactly their window (`drive`'s GhostCache and window
    checks), and outputs equal those without drafts."""
    spec = _outputs(drive(workload, sampler=fake_token, propose=drafter(seed, fake_token)))
    plain = _outputs(drive(workload, sampler=fake_token))
    assert {rid: spec[rid] for rid in spec.keys() & plain.keys()} == {
        rid: plain[rid] for rid in spec.keys() & plain.keys()}
    if not workload.aborts:
        assert spec.keys() == plain.keys()


@settings(max_examples=20, **HYPOTHESIS_SETTINGS)
@given(workloads(max_requests=5), _SEEDS)
def test_speculation_is_pure(workload, seed):
    drive(workload, sampler=fake_token, propose=drafter(seed, fake_token), purity=True)


@settings(max_examples=25, **HYPOTHESIS_SETTINGS)
@given(workloads(), _SEEDS, st.data())
def test_knobs_may_change_between_steps_with_drafts(workload, seed, data):
    configs = [dataclasses.replace(workload.config, policy=p, max_num_seqs=m)
               for p in ("token_budget", "alternate", "prefill_first") for m in (1, 6)]
    choices = data.draw(st.lists(st.integers(0, len(configs) - 1), min_size=1, max_size=30))
    base = dataclasses.replace(workload, config=dataclasses.replace(
        workload.config, policy="token_budget"))  # what the per-state checks assume
    trace = drive(base, sampler=fake_token, propose=drafter(seed, fake_token),
                  config_for_step=lambda step: configs[choices[step % len(choices)]])
    assert _outputs(trace) == _outputs(drive(workload, sampler=fake_token))


@settings(max_examples=60, **HYPOTHESIS_SETTINGS)
@given(workloads(), OVERLAP_MODES, _SEEDS, st.data())
def test_overlapped_with_drafts_equals_serial(workload, overlap, seed, data):
    """Any interleaving of serial and overlapped steps, with drafts (rows verifying drafts in
    flight are held out of the next plan until the fill), aborts anywhere: serial outputs."""
    points = data.draw(st.lists(st.tuples(
        st.integers(0, 40), st.integers(0, len(workload.requests) - 1), st.integers(0, 2)),
        max_size=3))
    outputs = drive_overlapped(workload, overlap, points, propose=drafter(seed, fake_token))
    if not points:
        assert outputs == _outputs(drive(workload, sampler=fake_token))


# ---- units ------------------------------------------------------------------------------------

def _decoding(num_blocks=32, block_size=4, budget=64, prompt=(1, 2, 3), max_tokens=12, **kw):
    """A state whose one request "a" is decode-ready (its prompt computed, one token sampled)."""
    config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, chunk_tile=4,
                             max_num_batched_tokens=budget, **kw)
    state = add_request(SchedulerState.empty(config),
                        Request(request_id="a", prompt_token_ids=prompt, max_tokens=max_tokens))
    plan = schedule(state, config)
    state, _ = commit(plan.state, plan, [10], 0.0)
    return config, state


def test_drafts_extend_the_row_and_commit_takes_what_was_accepted():
    config, state = _decoding()
    plan = schedule(state, config, {"a": (11, 12, 13, 14)})
    assert plan.lengths == (5,) and plan.starts == (3,) and plan.num_spec_tokens == 4
    assert plan.token_ids == (10, 11, 12, 13, 14) and plan.sample_counts == (5,)
    assert plan.chunks[0].spec_token_ids == (11, 12, 13, 14)
    assert len(plan.block_tables[0]) == 2  # positions 0 .. 7
    state, done = commit(plan.state, plan, [(11, 12, 30)], 1.0)  # 2 accepted, then 30
    assert done == () and state.decoding.outputs(0) == (10, 11, 12, 30)
    assert state.num_computed("a") == 6 and len(state.decoding.tables[0]) == 2
    plan = schedule(state, config, {"a": (31,)})
    state, _ = commit(plan.state, plan, [(40,)], 2.0)  # rejected: only the target's token
    assert state.decoding.outputs(0) == (10, 11, 12, 30, 40) and state.num_computed("a") == 7
    assert state.pool.num_in_use == 2


def test_rejected_blocks_are_released_and_never_cached():
    config, state = _decoding(block_size=2, enable_prefix_caching=True)
    plan = schedule(state, config, {"a": (11, 12, 13, 14, 15)})
    assert len(plan.block_tables[0]) == 5  # positions 0 .. 8
    state, _ = commit(plan.state, plan, [(50,)], 1.0)  # nothing accepted
    assert state.decoding.tables[0] == plan.block_tables[0][:2]  # 4 positions computed
    assert state.pool.num_in_use == 2
    cached = {state.pool.cache.records[b].digest for b in range(config.num_blocks)
              if state.pool.ref_count(b) is not None}
    assert len(cached) == 2  # (1, 2) and (3, 10): nothing holding a rejected draft


def test_drafts_never_pass_max_tokens_or_the_budget_or_the_watermark():
    config, state = _decoding(max_tokens=3)  # 1 output so far: 2 more at most
    plan = schedule(state, config, {"a": (11, 12, 13)})
    assert plan.spec_token_ids == ((11,),) and not plan.engaged.drafts_trimmed
    config, state = _decoding(budget=4)
    plan = schedule(state, config, {"a": (11, 12, 13, 14, 15)})
    assert plan.spec_token_ids == ((11, 12, 13),) and plan.engaged.drafts_trimmed == 1
    # 6 blocks, watermark 1; b holds 3, a 2 once its next token (position 4) opens one: a
    # drafts up to the end of that block (positions 5 .. 7)
    config, state = _decoding(num_blocks=6, watermark_blocks=1)
    state = add_request(state, Request(request_id="b", prompt_token_ids=(5,) * 11,
                                       max_tokens=2))
    plan = schedule(state, config)
    state, _ = commit(plan.state, plan, [15, 20], 1.0)
    plan = schedule(state, config, {"a": (11, 12, 13, 14, 15)})
    assert plan.spec_token_ids == ((11, 12, 13), ()) and plan.engaged.drafts_trimmed == 1
    assert plan.state.pool.num_free == config.watermark_blocks


def test_drafts_finish_a_request_at_max_tokens_and_at_a_stop():
    config, state = _decoding(max_tokens=4)
    plan = schedule(state, config, {"a": (11, 12, 13)})
    _, done = commit(plan.state, plan, [(11, 12, 13)], 1.0)
    assert [(f.output_token_ids, f.reason) for f in done] == [((10, 11, 12, 13), "length")]
    plan = schedule(state, config, {"a": (11, 12, 13)})
    after, done = commit(plan.state, plan, [(11, 12)], 1.0, finished_ids=["a"])
    assert [(f.output_token_ids, f.reason) for f in done] == [((10, 11, 12), "stop")]
    assert after.pool.num_in_use == 0


def test_bad_drafts_and_bad_entries_are_refused():
    config, state = _decoding()
    for bad in ({"a": (1, -2)}, {"a": "xy"}, {"a": (1.5,)}):
        with pytest.raises(InputError) as e:
            schedule(state, config, bad)
        assert e.value.field == "spec_token_ids"
    plan = schedule(state, config, {"a": (11, 12)})
    for entry in ((), (1, 2, 3, 4)):
        with pytest.raises(CommitError):
            commit(plan.state, plan, [entry], 1.0)
    assert schedule(state, config, {"zz": (1,)}).spec_token_ids == ()  # not decoding: ignored


def test_advance_holds_rows_with_drafts_until_the_fill():
    config, state = _decoding()
    state = add_request(state, Request(request_id="b", prompt_token_ids=(4, 5), max_tokens=8))
    plan = schedule(state, config, {"a": (11, 12)})  # a verifies, b is admitted
    ahead = advance(plan.state, plan)
    assert [row.seq.request_id for row in ahead.verifying] == ["a"]
    assert ahead.decoding.ids == ("b",) and ahead.has_work()
    assert ahead.num_computed("a") == 3 and ahead.num_running == 2
    nxt = schedule(ahead, config, {"a": (1,), "b": (7,)})  # a is held: not planned
    assert nxt.request_ids == ("b",) and nxt.token_ids == (PLACEHOLDER, 7)
    state, done = commit(nxt.state, plan, [(11, 12, 13), 20], 1.0)
    assert done == () and state.verifying == ()
    assert state.decoding.ids == ("a", "b") and state.decoding.outputs(0) == (10, 11, 12, 13)
    state, _ = commit(state, nxt, [(7, 21)], 2.0)  # b's draft 7 accepted, then 21
    assert state.decoding.outputs(1) == (20, 7, 21)
    for rid in ("a", "b"):
        state = abort(state, rid)
    assert state.pool.num_in_use == 0


def test_a_held_row_can_be_aborted():
    config, state = _decoding()
    plan = schedule(state, config, {"a": (11, 12)})
    ahead = abort(advance(plan.state, plan), "a")
    assert ahead.verifying == () and ahead.pool.num_in_use == 0 and not ahead.has_work()
    state, done = commit(schedule(ahead, config).state, plan, [(11,)], 1.0)
    assert done == () and state.request_ids() == ()
