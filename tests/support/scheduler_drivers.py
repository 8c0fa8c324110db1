"""Drivers that run a scheduler workload to the end through schedule/commit, checking every
plan and state (`scheduler_invariants`): `drive` runs the serial loop against its own mirror
of every request; `drive_overlapped` interleaves serial and overlapped steps (`advance` with
placeholder tokens, two plans in flight) with aborts at random points, against the outputs
the fake model makes known in advance."""

from __future__ import annotations

import copy
import dataclasses

from hypothesis import event
from hypothesis.control import currently_in_test_context

from scheduler import PLACEHOLDER, Request, SchedulerConfig, SchedulerState
from scheduler import abort, add_request, advance, commit, schedule
from support.scheduler_invariants import GhostCache, check_blocks, check_drafts_use_leftovers
from support.scheduler_invariants import check_adapters, check_plan, check_state
from support.scheduler_workloads import Workload, fake_token, verified

@dataclasses.dataclass(kw_only=True)
class Mirror:
    """What the test knows about one request, independently of the scheduler."""

    request: Request
    outputs: list[int] = dataclasses.field(default_factory=list)
    status: str = "pending"  # pending, live, finished, aborted

    def tokens(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids + tuple(self.outputs)

    @property
    def adapter(self) -> int | None:
        return self.request.adapter


@dataclasses.dataclass(kw_only=True)
class Trace:
    steps: list[tuple[SchedulerState, object]]  # (state before schedule, plan)
    finished_at: dict
    num_preempted: int
    outputs: dict = dataclasses.field(default_factory=dict)  # request id -> Finished


def drive(workload: Workload, *, step_limit: int | None = None, purity: bool = False,
          config_for_step=None, sampler=None, propose=None) -> Trace:
    """Runs the workload to completion, checking every plan and state; returns the trace.

    `sampler(request_id, position)` gives the token sampled at `position` (default: a function
    of the step and the row). `propose(state)` gives draft tokens by request id (speculative
    decoding; needs `sampler`, the model that verifies them)."""
    config = workload.config
    ghost = GhostCache(block_size=config.block_size, window=config.sliding_window)
    mirror = {r.request_id: Mirror(request=r) for r in workload.requests}
    pending = list(workload.requests)
    stop_after = {r.request_id: s for r, s in zip(workload.requests, workload.stop_after)}
    state = SchedulerState.empty(config)
    trace = Trace(steps=[], finished_at={}, num_preempted=0)
    limit = step_limit or workload.last_arrival + 1 + workload.total_work * (len(mirror) + 2)
    step = 0
    while pending or state.has_work():
        assert step <= limit, f"not finished within {limit} steps"
        while pending and pending[0].arrival_time <= step:
            request = pending.pop(0)
            state = add_request(state, request)
            mirror[request.request_id].status = "live"
        in_flight_aborts = []
        for when, index, in_flight in workload.aborts:
            rid = workload.requests[index].request_id
            if when == step and mirror[rid].status == "live" and rid not in in_flight_aborts:
                if in_flight:
                    in_flight_aborts.append(rid)
                else:
                    state = abort(state, rid)
                    mirror[rid].status = "aborted"
        step_config = config_for_step(step) if config_for_step else config
        if purity:
            snapshot = copy.deepcopy(state)
        drafts = propose(state) if propose else None
        plan = schedule(state, step_config, drafts)
        if drafts:
            check_drafts_use_leftovers(state, step_config, plan)
        if purity:
            assert state == snapshot, "schedule mutated its input"
            assert schedule(state, step_config, drafts) == plan, "same inputs, different plans"
            assert schedule(snapshot, copy.deepcopy(step_config),
                            copy.deepcopy(drafts)) == plan, "equal inputs differ"
        check_plan(state, plan, step_config, mirror)
        ghost.run(plan, plan.state, mirror)
        trace.steps.append((state, plan))
        trace.num_preempted += len(plan.preempted)
        after = plan.state
        for rid in in_flight_aborts:
            after = abort(after, rid)
            mirror[rid].status = "aborted"
        sampled, stopped = [], []
        for row, (rid, samples) in enumerate(zip(plan.request_ids, plan.samples)):
            if samples:
                drafts = plan.row_spec_token_ids(row)
                if sampler is None:
                    tokens = ((step * 131 + row * 7) % 1000,)
                elif drafts:
                    tokens = verified(sampler, rid, plan.starts[row], drafts)
                else:
                    tokens = (sampler(rid, plan.starts[row] + plan.lengths[row]),)
                if mirror[rid].status == "live":
                    for j, token in enumerate(tokens):
                        mirror[rid].outputs.append(token)
                        if len(mirror[rid].outputs) == stop_after[rid]:
                            stopped.append(rid)
                            tokens = tokens[:j + 1]  # the engine drops tokens after a stop
                            break
                sampled.append(tokens if drafts else tokens[0])
        if purity:
            snapshot = copy.deepcopy((after, plan))
        state, finished = commit(after, plan, sampled, float(step), stopped)
        if purity:
            assert (after, plan) == snapshot, "commit mutated its input"
            # equal but not identical inputs (commit then matches rows by id) give equal results
            assert commit(copy.deepcopy(after), copy.deepcopy(plan), sampled, float(step),
                          stopped) == (state, finished)
        for record in finished:
            m = mirror[record.request_id]
            assert record.output_token_ids == tuple(m.outputs)
            if record.request_id in stopped:
                assert record.reason == "stop"
            else:
                assert record.reason == "length"
                assert len(m.outputs) == m.request.max_tokens
            m.status = "finished"
            trace.finished_at[record.request_id] = step
            trace.outputs[record.request_id] = record
        for rid, m in mirror.items():  # nobody runs past max_tokens or a stop
            if m.status == "live":
                assert len(m.outputs) < m.request.max_tokens and rid not in stopped
        check_state(state, config, mirror)
        ghost.check(state)
        step += 1
    assert all(m.status in ("finished", "aborted") for m in mirror.values())
    assert state.pool.num_free == config.num_blocks, "blocks not all free at the end"
    assert state.pool.num_in_use == 0
    if currently_in_test_context():  # shown by --hypothesis-show-statistics
        event(f"policy {config.policy}")
        event(f"prefix caching {config.enable_prefix_caching}")
        if any(plan.num_cached_tokens for _, plan in trace.steps):
            event("prefix cache hit")
        if any(p.num_cached[i] and p.samples[i] and p.lengths[i] == config.block_size
               and p.starts[i] % config.block_size == 0
               for _, p in trace.steps for i in range(p.num_seqs)):
            event("cache hit, then exactly one (last) block computed")
        for knob in sorted({k for _, plan in trace.steps for k in plan.engaged.active()}):
            event(f"engaged {knob}")
    return trace


@dataclasses.dataclass
class _Truth:
    """What the ghost cache needs of a request: its true token list and its adapter."""

    tokens_: tuple[int, ...]
    adapter: int | None = None

    def tokens(self) -> tuple[int, ...]:
        return self.tokens_


def _truth(request: Request) -> tuple[int, ...]:
    prompt = request.prompt_token_ids
    return prompt + tuple(fake_token(request.request_id, len(prompt) + j)
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
    truth = {rid: _Truth(_truth(r), r.adapter) for rid, r in requests.items()}
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
                out = (verified(fake_token, rid, start, drafts) if drafts
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
        adapters = {truth[rid].adapter for rid in plan.request_ids} - {None}
        assert len(adapters) <= config.max_loras, "a step with more adapters than max_loras"
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
        check_adapters(state, config)
        assert state.held == frozenset(state.request_ids())
        step += 1
    assert all(s in ("finished", "aborted") for s in status.values()), status
    assert state.pool.num_free == config.num_blocks and state.pool.num_in_use == 0
    assert state.unfilled is None and not state.in_flight
    ghost.check(state)
    return outputs
