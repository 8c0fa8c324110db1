"""Overlapped scheduling (`scheduler.advance`): plan step N+1 while step N is in flight.

A random workload is driven with a random interleaving: at each iteration the driver either
commits the plan in flight and then plans (serial), or advances it with placeholder tokens,
plans the next step, and only then commits the first plan with its real tokens (overlapped).
Aborts land at random points, including between those calls (two plans in flight). The fake
model is a function of (request, position), so every request's correct outputs are known in
advance ("truth"); the checks:

  * every finished request's outputs equal the truth cut at its stop or max_tokens: the serial
    outputs (also compared with the serial driver, tests/support/scheduler_drivers.py);
  * every plan: budgets and max_num_seqs hold, token ids are the truth except placeholders,
    which appear exactly at decode rows fed by the plan in flight;
  * blocks: free, cached and held partition the cache after every call, each row reads exactly
    its own tokens' KV (the ghost cache, writing the true tokens in launch order, as the device
    does), no cached block is written, cached digests match their tokens, nothing leaks.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import PLACEHOLDER, Request, SchedulerConfig, SchedulerState
from scheduler import abort, add_request, advance, commit, schedule
from scheduler.scheduler_errors import CommitError, StepOrderError, UnknownRequestError
from support.scheduler_drivers import drive, drive_overlapped
from support.scheduler_workloads import HYPOTHESIS_SETTINGS, OVERLAP_MODES, fake_token, workloads


@settings(max_examples=120, **HYPOTHESIS_SETTINGS)
@given(workloads(), OVERLAP_MODES)
def test_overlapped_outputs_equal_serial(workload, overlap):
    """Any interleaving of serial and overlapped steps gives the serial outputs."""
    outputs = drive_overlapped(workload, overlap, [])
    serial = drive(workload, sampler=fake_token)
    assert outputs == {rid: f.output_token_ids for rid, f in serial.outputs.items()}


@settings(max_examples=80, **HYPOTHESIS_SETTINGS)
@given(workloads(policy="token_budget"), st.just([True]))
def test_always_overlapped_token_budget(workload, overlap):
    drive_overlapped(workload, overlap, [])


@settings(max_examples=80, **HYPOTHESIS_SETTINGS)
@given(workloads(aborts=True), OVERLAP_MODES, st.data())
def test_aborts_while_two_plans_are_in_flight(workload, overlap, data):
    """Aborts before planning, between the next plan and the fill, and after: nothing leaks,
    nobody finishes twice, every survivor gets its serial outputs."""
    points = data.draw(st.lists(st.tuples(
        st.integers(0, 40), st.integers(0, len(workload.requests) - 1), st.integers(0, 2)),
        max_size=4))
    drive_overlapped(workload, overlap, points)


@settings(max_examples=60, **HYPOTHESIS_SETTINGS)
@given(workloads(pressure=True, shared=True), OVERLAP_MODES)
def test_overlap_under_kv_pressure_with_prefix_caching(workload, overlap):
    """Preemptions of rows whose newest token is a placeholder (their digests are recomputed
    at the fill) and shared prefixes."""
    config = dataclasses.replace(workload.config, enable_prefix_caching=True)
    drive_overlapped(dataclasses.replace(workload, config=config), overlap, [])


@settings(max_examples=60, **HYPOTHESIS_SETTINGS)
@given(workloads(windows=True, shared=True), OVERLAP_MODES)
def test_overlap_with_a_sliding_window(workload, overlap):
    """Blocks a window releases while the step before is still in flight (the device runs that
    step before any later one reuses them): every row reads its own tokens inside its window,
    and outputs are the serial ones."""
    outputs = drive_overlapped(workload, overlap, [])
    serial = drive(workload, sampler=fake_token)
    assert outputs == {rid: f.output_token_ids for rid, f in serial.outputs.items()}


# ---- units ------------------------------------------------------------------------------------

def _two_decoders(**kw):
    config = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, chunk_tile=4, **kw)
    state = SchedulerState.empty(config)
    for rid in ("a", "b"):
        state = add_request(state, Request(request_id=rid, prompt_token_ids=(1, 2, 3),
                                           max_tokens=3))
    return config, state


def test_advance_twice_or_committing_out_of_order_is_refused():
    config, state = _two_decoders()
    p1 = schedule(state, config)
    ahead = advance(p1.state, p1)
    assert ahead.decoding.recent == ((PLACEHOLDER,), (PLACEHOLDER,))
    p2 = schedule(ahead, config)
    assert p2.token_ids == (PLACEHOLDER, PLACEHOLDER)
    with pytest.raises(StepOrderError):
        advance(p2.state, p2)  # step 1 is still unfilled
    with pytest.raises(StepOrderError):
        commit(p2.state, p2, [5, 6], 1.0)  # step 1 first
    with pytest.raises(CommitError):
        commit(p2.state, p1, [5], 1.0)
    with pytest.raises(CommitError):
        commit(p2.state, p1, [5, 6], 1.0, finished_ids=["zz"])
    with pytest.raises(StepOrderError):
        schedule(p2.state, config)  # step 2 in flight
    state, done = commit(p2.state, p1, [5, 6], 1.0, finished_ids=["b"])
    assert [(f.request_id, f.output_token_ids, f.reason) for f in done] == [("b", (6,), "stop")]
    assert state.decoding.ids == ("a",) and state.decoding.recent == ((5,),)
    state, done = commit(state, p2, [7, 8], 2.0)  # b's row of step 2 is dropped
    assert done == () and state.decoding.outputs(0) == (5, 7)
    assert state.pool.num_in_use == 1


def test_length_finish_waits_for_its_token_and_can_be_aborted():
    config = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=64, chunk_tile=4)
    state = SchedulerState.empty(config)
    for rid in ("a", "b"):
        state = add_request(state, Request(request_id=rid, prompt_token_ids=(1, 2), max_tokens=1))
    p1 = schedule(state, config)
    ahead = advance(p1.state, p1)
    assert ahead.pool.num_in_use == 0 and not ahead.has_work()
    assert set(ahead.request_ids()) == {"a", "b"}
    ahead = abort(ahead, "a")
    with pytest.raises(UnknownRequestError):
        abort(ahead, "a")
    state, done = commit(ahead, p1, [9, 10], 3.0)
    assert [(f.request_id, f.output_token_ids, f.reason, f.finish_time) for f in done] == [
        ("b", (10,), "length", 3.0)]
    assert state.request_ids() == ()


def test_preempting_a_placeholder_row_refills_its_tokens_and_digests():
    """b's newest token is a placeholder when a's decode preempts it; the fill puts the real
    token in b's waiting sequence and recomputes the digest of the block it completes."""
    from scheduler.prefix import chain_hashes

    config = SchedulerConfig(num_blocks=4, block_size=2, max_num_batched_tokens=64, chunk_tile=2,
                             watermark_blocks=0, enable_prefix_caching=True)
    state = SchedulerState.empty(config)
    state = add_request(state, Request(request_id="a", prompt_token_ids=(1, 2, 3, 4),
                                       max_tokens=3))
    state = add_request(state, Request(request_id="b", prompt_token_ids=(5, 6, 7), max_tokens=3))
    p1 = schedule(state, config)
    assert p1.request_ids == ("a", "b") and p1.num_sampled == 2
    p2 = schedule(advance(p1.state, p1), config)
    assert p2.preempted == ("b",) and p2.request_ids == ("a",)
    assert p2.state.unfilled.preempted == ("b",)
    (b,) = p2.state.waiting
    assert b.tokens == (5, 6, 7, PLACEHOLDER)
    state, done = commit(p2.state, p1, [40, 50], 1.0)
    assert done == ()
    (b,) = state.waiting
    assert b.tokens == (5, 6, 7, 50)
    assert b.block_hashes == chain_hashes((5, 6, 7, 50), 2)
    state, done = commit(state, p2, [41], 2.0)
    assert state.decoding.outputs(0) == (40, 41)
    while state.has_work():  # serial from here: b recomputes and resumes after its token 50
        plan = schedule(state, config)
        state, fin = commit(plan.state, plan, [60 + i for i in range(plan.num_sampled)], 3.0)
        done += fin
    outs = {f.request_id: f.output_token_ids for f in done}
    assert outs["a"][:2] == (40, 41) and outs["b"][0] == 50 and len(outs["b"]) == 3


def test_abandon_and_forget_the_prefix_cache():
    from scheduler import abandon, forget_prefix_cache

    config = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=64, chunk_tile=4)
    state = SchedulerState.empty(config)
    for rid in ("a", "b"):
        state = add_request(state, Request(request_id=rid, prompt_token_ids=tuple(range(1, 10)),
                                           max_tokens=3))
    p1 = schedule(state, config)
    p2 = schedule(advance(p1.state, p1), config)
    with pytest.raises(StepOrderError):
        abandon(p2.state, [p2])  # the advanced plan p1 is not abandoned
    with pytest.raises(StepOrderError):
        forget_prefix_cache(p2.state)
    dropped = abandon(p2.state, [p1, p2])
    assert dropped.request_ids() == () and dropped.pool.num_in_use == 0
    assert not dropped.in_flight and dropped.unfilled is None
    assert dropped.pool.cached_free_blocks()  # the prompts' full blocks were cached
    fresh = forget_prefix_cache(dropped)
    assert not fresh.pool.cached_free_blocks() and fresh.pool.num_free == config.num_blocks
    # nothing held: any in-flight state clears, whatever plans are named
    assert not abandon(abort(abort(p2.state, "a"), "b"), []).in_flight
