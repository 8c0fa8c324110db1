"""Overlapped scheduling (`scheduler.advance`): plan step N+1 while step N is in flight.

A random workload is driven with a random interleaving: at each iteration the driver either
commits the plan in flight and then plans (serial), or advances it with placeholder tokens,
plans the next step, and only then commits the first plan with its real tokens (overlapped).
Aborts land at random points, including between those calls (two plans in flight). The fake
model is a function of (request, position), so every request's correct outputs are known in
advance ("truth"); the checks:

  * every finished request's outputs equal the truth cut at its stop or max_tokens: the serial
    outputs (also compared with the serial driver of test_scheduler_properties.py);
  * every plan: budgets and max_num_seqs hold, token ids are the truth except placeholders,
    which appear exactly at decode rows fed by the plan in flight;
  * blocks: free, cached and held partition the cache after every call, each row reads exactly
    its own tokens' KV (the ghost cache, writing the true tokens in launch order, as the device
    does), no cached block is written, cached digests match their tokens, nothing leaks.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from scheduler import PLACEHOLDER, Request, SchedulerConfig, SchedulerState
from scheduler import abort, add_request, advance, commit, schedule
from scheduler.scheduler_errors import CommitError, StepOrderError, UnknownRequestError
from test_scheduler_properties import _SETTINGS, GhostCache, _sampler, check_blocks
from test_scheduler_properties import drive, verified, workloads


@dataclasses.dataclass
class _Truth:
    """What the ghost cache needs of a request: its true token list."""

    tokens_: tuple[int, ...]

    def tokens(self) -> tuple[int, ...]:
        return self.tokens_


def _truth(request: Request) -> tuple[int, ...]:
    prompt = request.prompt_token_ids
    return prompt + tuple(_sampler(request.request_id, len(prompt) + j)
                          for j in range(request.max_tokens))


def _expected(request: Request, stop_after: int | None) -> tuple[tuple[int, ...], str]:
    n = request.max_tokens
    reason = "length"
    if stop_after is not None and stop_after <= n:
        n, reason = stop_after, "stop"
    return _truth(request)[len(request.prompt_token_ids):][:n], reason


def _check_plan(plan, config: SchedulerConfig, truth: dict, feeds: dict) -> None:
    """Budgets, and token ids: the truth, or a placeholder exactly where the previous plan's
    sampled token feeds a decode row (`feeds`: ids that plan sampled -> position sampled)."""
    if plan.num_tokens > config.max_num_batched_tokens:
        assert config.policy == "prefill_first" and plan.num_seqs == 1
        assert plan.engaged.oversize_prompt
    assert plan.num_seqs <= config.max_num_seqs
    assert len(set(plan.request_ids)) == plan.num_seqs
    cu = plan.cu_seqlens
    ids = plan.token_ids
    for i, rid in enumerate(plan.request_ids):
        start, length = plan.starts[i], plan.lengths[i]
        row = ids[cu[i]:cu[i + 1]]
        drafts = plan.row_spec_token_ids(i)
        assert row[len(row) - len(drafts):] == drafts
        if PLACEHOLDER in row:
            assert i < plan.num_decode_rows and row == (PLACEHOLDER,) + drafts
            assert feeds.get(rid) == start, "a placeholder not fed by the plan in flight"
        else:
            assert row == truth[rid].tokens()[start:start + length - len(drafts)] + drafts
            assert feeds.get(rid) != start or i >= plan.num_decode_rows


def drive_overlapped(workload, overlap: list[bool], abort_points: list[tuple[int, int, int]],
                     propose=None):
    """Runs the workload; `overlap[i % len]` picks the mode of iteration i; `abort_points` are
    (iteration, request index, where: 0 before planning, 1 between plan and fill, 2 after);
    `propose(state)`: draft tokens by request id (speculative decoding), or None."""
    config = workload.config
    requests = {r.request_id: r for r in workload.requests}
    stop_after = {r.request_id: s for r, s in zip(workload.requests, workload.stop_after)}
    truth = {rid: _Truth(_truth(r)) for rid, r in requests.items()}
    ghost = GhostCache(block_size=config.block_size, window=config.sliding_window)
    pending = list(workload.requests)
    status = {rid: "pending" for rid in requests}
    outputs = {}
    state = SchedulerState.empty(config)
    in_flight = None  # the plan launched and not committed
    limit = 20 + 4 * (workload.last_arrival + 1 + workload.total_work * (len(requests) + 2))

    def sample(plan):
        tokens, stopped = [], []
        for r, (rid, start, n, s) in enumerate(zip(plan.request_ids, plan.starts, plan.lengths,
                                                   plan.samples)):
            if s:
                drafts = plan.row_spec_token_ids(r)
                first = start + n - len(drafts)  # position of the row's first new token
                out = (verified(_sampler, rid, start, drafts) if drafts
                       else (truth[rid].tokens()[first],))
                made = first - len(requests[rid].prompt_token_ids) + 1
                stop = stop_after[rid]
                if status[rid] == "live" and stop is not None and made <= stop < made + len(out):
                    out = out[:stop - made + 1]
                    stopped.append(rid)
                tokens.append(out if drafts else out[0])
        return tokens, stopped

    def finish(records, step):
        for f in records:
            assert status[f.request_id] == "live", f"{f.request_id} finished twice"
            assert (f.output_token_ids, f.reason) == _expected(
                requests[f.request_id], stop_after[f.request_id])
            assert f.finish_time == float(step)
            status[f.request_id] = "finished"
            outputs[f.request_id] = f.output_token_ids

    def aborts(step, where, state):
        for when, index, at in abort_points:
            rid = workload.requests[index].request_id
            if when == step and at == where and status[rid] == "live":
                state = abort(state, rid)
                status[rid] = "aborted"
                check_blocks(state, config, exact=False)
        return state

    def launch(plan, feeds):
        _check_plan(plan, config, truth, feeds)
        ghost.run(plan, plan.state, truth)
        check_blocks(plan.state, config, exact=False)

    step = 0
    while pending or state.has_work() or in_flight is not None:
        assert step <= limit, f"not finished within {limit} iterations"
        while pending and pending[0].arrival_time <= step:
            request = pending.pop(0)
            state = add_request(state, request)
            status[request.request_id] = "live"
        state = aborts(step, 0, state)
        if in_flight is not None and overlap[step % len(overlap)]:
            prev = in_flight
            ahead = advance(state, prev)
            assert ahead.unfilled is not None and not ahead.in_flight
            check_blocks(ahead, config, exact=False)
            feeds = {rid: s + n for rid, s, n, smp in zip(
                prev.request_ids, prev.starts, prev.lengths, prev.samples) if smp}
            if ahead.verifying:
                event("rows with drafts in flight held out of the next plan")
            plan = schedule(ahead, config, propose(ahead) if propose else None)
            in_flight = None if plan.is_empty else plan
            state = plan.state
            if state.unfilled is not None and state.unfilled.preempted:
                event("preempted a row whose newest token is a placeholder")
            if ahead.unfilled.finished:
                event("finished by length before its token was known")
            if in_flight is not None:
                launch(plan, feeds)
            state = aborts(step, 1, state)
            tokens, stopped = sample(prev)
            if set(stopped) & set(plan.request_ids):
                event("a stopped request had a row in the next plan")
            state, records = commit(state, prev, tokens, float(step), stopped)
            assert state.unfilled is None
            finish(records, step)
        else:
            if in_flight is not None:
                tokens, stopped = sample(in_flight)
                state, records = commit(state, in_flight, tokens, float(step), stopped)
                finish(records, step)
                in_flight = None
                check_blocks(state, config, exact=True)
                ghost.check(state)
            plan = schedule(state, config, propose(state) if propose else None)
            state = plan.state
            if not plan.is_empty:
                launch(plan, {})
                in_flight = plan
        state = aborts(step, 2, state)
        check_blocks(state, config, exact=False)
        assert state.held == frozenset(state.request_ids())
        step += 1
    assert all(s in ("finished", "aborted") for s in status.values()), status
    assert state.pool.num_free == config.num_blocks and state.pool.num_in_use == 0
    assert state.unfilled is None and not state.in_flight
    ghost.check(state)
    return outputs


_OVERLAP = st.lists(st.booleans(), min_size=1, max_size=6)


@settings(max_examples=120, **_SETTINGS)
@given(workloads(), _OVERLAP)
def test_overlapped_outputs_equal_serial(workload, overlap):
    """Any interleaving of serial and overlapped steps gives the serial outputs."""
    outputs = drive_overlapped(workload, overlap, [])
    serial = drive(workload, sampler=_sampler)
    assert outputs == {rid: f.output_token_ids for rid, f in serial.outputs.items()}


@settings(max_examples=80, **_SETTINGS)
@given(workloads(policy="token_budget"), st.just([True]))
def test_always_overlapped_token_budget(workload, overlap):
    drive_overlapped(workload, overlap, [])


@settings(max_examples=80, **_SETTINGS)
@given(workloads(aborts=True), _OVERLAP, st.data())
def test_aborts_while_two_plans_are_in_flight(workload, overlap, data):
    """Aborts before planning, between the next plan and the fill, and after: nothing leaks,
    nobody finishes twice, every survivor gets its serial outputs."""
    points = data.draw(st.lists(st.tuples(
        st.integers(0, 40), st.integers(0, len(workload.requests) - 1), st.integers(0, 2)),
        max_size=4))
    drive_overlapped(workload, overlap, points)


@settings(max_examples=60, **_SETTINGS)
@given(workloads(pressure=True, shared=True), _OVERLAP)
def test_overlap_under_kv_pressure_with_prefix_caching(workload, overlap):
    """Preemptions of rows whose newest token is a placeholder (their digests are recomputed
    at the fill) and shared prefixes."""
    config = dataclasses.replace(workload.config, enable_prefix_caching=True)
    drive_overlapped(dataclasses.replace(workload, config=config), overlap, [])


@settings(max_examples=60, **_SETTINGS)
@given(workloads(windows=True, shared=True), _OVERLAP)
def test_overlap_with_a_sliding_window(workload, overlap):
    """Blocks a window releases while the step before is still in flight (the device runs that
    step before any later one reuses them): every row reads its own tokens inside its window,
    and outputs are the serial ones."""
    outputs = drive_overlapped(workload, overlap, [])
    serial = drive(workload, sampler=_sampler)
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
