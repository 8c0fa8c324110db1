"""Property-based tests of the step planner: random workloads driven through schedule/commit.

The harness (`drive`) keeps its own mirror of every request (prompt + outputs it was told about)
and checks each plan and each committed state against it, independently of the planner's code:

  1. plan: budgets, row order, cursors, chunk tiles, sampling rows, token ids, block slots,
     admissions (cap, FCFS), preemptions, stall-freedom (token_budget);
  2. state after commit: every block free or owned by exactly one sequence, tables sized to the
     cursors, queues ordered, the partial-prefill limit;
  3. trace: the decode floor, liveness (see `test_liveness_*`), finished outputs.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from scheduler import POLICIES, Request, SchedulerConfig, SchedulerState
from scheduler import abort, add_request, blocks_for, commit, schedule
from scheduler.prefix import chain_hashes
from scheduler.window import first_needed

_SETTINGS = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """Requests arrive at step `arrival_time`; `stop_after[i]` outputs make the engine stop
    request i; `aborts` are (step, request index, in_flight) events."""

    config: SchedulerConfig
    requests: tuple[Request, ...]
    stop_after: tuple[int | None, ...]
    aborts: tuple[tuple[int, int, bool], ...] = ()

    @property
    def last_arrival(self) -> int:
        return max(int(r.arrival_time) for r in self.requests)

    @property
    def total_work(self) -> int:
        return sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in self.requests)

    @property
    def longest(self) -> int:
        return max(len(r.prompt_token_ids) + r.max_tokens - 1 for r in self.requests)


@st.composite
def workloads(draw, *, policy=None, pressure=True, aborts=False, stops=True, priorities=True,
              max_requests=10, shared=None, windows=False, **fixed):
    """Random workloads. With `shared` (drawn when None) prompts start with one of a few common
    prefixes of random lengths (block-aligned or not; a prompt may be all prefix, so a later
    identical prompt is entirely cached). With `windows`, a sliding window of 1 to 20 keys."""
    tile = draw(st.sampled_from([1, 2, 4, 8, 16]))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    watermark = draw(st.integers(0, 2))
    n = draw(st.integers(1, max_requests))
    use_priority = priorities and draw(st.booleans())
    if shared is None:
        shared = draw(st.booleans())
    prefixes = [()]
    if shared:
        for p in range(draw(st.integers(1, 3))):
            length = draw(st.sampled_from([block_size, 2 * block_size, 3 * block_size + 1])
                          | st.integers(1, 40))
            prefixes.append(tuple(7000 + 50 * p + j for j in range(length)))
    requests = []
    for i in range(n):
        prefix = draw(st.sampled_from(prefixes))
        suffix_len = draw(st.integers(0 if prefix else 1, 48 - min(len(prefix), 47)))
        requests.append(Request(
            request_id=i,
            prompt_token_ids=prefix + tuple((i * 97 + j) % 5000 for j in range(suffix_len)),
            max_tokens=draw(st.integers(1, 12)),
            arrival_time=float(draw(st.integers(0, 8))),
            priority=draw(st.integers(0, 2)) if use_priority else 0))
    requests.sort(key=lambda r: r.arrival_time)  # added in arrival order
    needs = [blocks_for(len(r.prompt_token_ids) + r.max_tokens - 1, block_size) for r in requests]
    if pressure:
        num_blocks = max(needs) + watermark + draw(st.integers(0, 6))
    else:
        num_blocks = sum(needs) + watermark + 1
    values = dict(
        policy=policy or draw(st.sampled_from(POLICIES)),
        chunk_tile=tile,
        max_num_batched_tokens=tile * draw(st.integers(1, 6)) + draw(st.integers(0, tile - 1)),
        max_num_seqs=draw(st.integers(1, 6)),
        prefill_max_seqs=draw(st.sampled_from([0, 0, 1, 2, 3])),
        prefill_floor_steps=draw(st.sampled_from([0, 0, 1, 2, 3])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, tile, 2 * tile + 1])),
        max_num_partial_prefills=draw(st.integers(1, 3)),
        block_size=block_size, num_blocks=num_blocks, watermark_blocks=watermark,
        enable_prefix_caching=draw(st.booleans()))
    if windows:
        values["sliding_window"] = draw(st.sampled_from([1, 2, 3, 5, 8, 13, 20]))
    values.update(fixed)
    stop_after = tuple(draw(st.sampled_from([None, None, 1, 2, 5])) if stops else None
                       for _ in requests)
    events = ()
    if aborts:
        events = tuple(draw(st.lists(
            st.tuples(st.integers(0, 30), st.integers(0, n - 1), st.booleans()), max_size=3)))
    return Workload(config=SchedulerConfig(**values), requests=tuple(requests),
                    stop_after=stop_after, aborts=events)


@dataclasses.dataclass(kw_only=True)
class Mirror:
    """What the test knows about one request, independently of the scheduler."""

    request: Request
    outputs: list[int] = dataclasses.field(default_factory=list)
    status: str = "pending"  # pending, live, finished, aborted

    def tokens(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids + tuple(self.outputs)


@dataclasses.dataclass(kw_only=True)
class Trace:
    steps: list[tuple[SchedulerState, object]]  # (state before schedule, plan)
    finished_at: dict
    num_preempted: int
    outputs: dict = dataclasses.field(default_factory=dict)  # request id -> Finished


def _all_keys(state: SchedulerState) -> dict:
    keys = {s.request_id: s.key for s in state.waiting}
    keys.update((p.seq.request_id, p.seq.key) for p in state.partial)
    keys.update(zip(state.decoding.ids, state.decoding.keys))
    return keys


def check_blocks(state: SchedulerState, config: SchedulerConfig, *, exact: bool) -> None:
    """Free, cached-unreferenced and referenced blocks partition the cache; a block is in two live
    tables only if it is a cached full block whose reference count says how many; outside a step,
    tables fit the cursors."""
    pool = state.pool
    free, idle = pool.free_blocks(), pool.cached_free_blocks()
    assert len(free) + len(idle) == pool.num_free and len(idle) == pool.num_cached_free
    holders: dict[int, int] = {}
    window = config.sliding_window
    for table in state.owned_blocks().values():
        held = [b for b in table if b is not None]
        assert len(set(held)) == len(held), "a block twice in one table"
        assert window is not None or len(held) == len(table), "a released entry without window"
        for b in held:
            holders[b] = holders.get(b, 0) + 1
    everything = sorted([*free, *idle, *holders])
    assert everything == list(range(config.num_blocks)), "a block leaked or is in two places"
    assert pool.num_in_use == len(holders)
    for b in range(config.num_blocks):
        refs = pool.ref_count(b)
        if refs is None:  # not cached: free, or held by exactly one sequence
            assert holders.get(b, 0) <= 1, "an uncached block is shared"
        else:
            assert refs == holders.get(b, 0), "reference count != live holders"
    if not config.enable_prefix_caching:
        assert pool.cache is None and not idle
    if exact:
        for part in state.partial:
            assert len(part.table) == blocks_for(part.computed, config.block_size)
        for computed, table in zip(state.decoding.computed, state.decoding.tables):
            assert len(table) == blocks_for(computed, config.block_size)


def _cursors(state: SchedulerState) -> list[tuple[int, tuple]]:
    """(cursor, table) of every running sequence."""
    return ([(p.computed, p.table) for p in state.partial]
            + list(zip(state.decoding.computed, state.decoding.tables)))


def check_window(state: SchedulerState, config: SchedulerConfig, *, planned: bool) -> None:
    """Sliding window: released entries are exactly a prefix of each table. Just planned, that
    prefix is every block wholly behind the sequence's window (its cursor's next query): all
    of them went back to the pool, and nothing the window still reads did."""
    if config.sliding_window is None:
        return
    for cursor, table in _cursors(state):
        released = sum(b is None for b in table)
        assert all(b is None for b in table[:released]), "released entries not a prefix"
        needed = first_needed(cursor, config.sliding_window, config.block_size)
        if planned:
            assert released == needed, f"released {released} blocks, window allows {needed}"
            if released and currently_in_test_context():
                event("a window released blocks")
        else:
            assert released <= needed, "released a block the window still reads"


@dataclasses.dataclass(kw_only=True)
class GhostCache:
    """The test's own model of the KV cache: which token each slot holds, and the digest each
    full block must have, recomputed from the token list of the sequence that filled it."""

    block_size: int
    window: int | None = None  # the sliding window: rows read only the keys inside it
    slots: dict = dataclasses.field(default_factory=dict)  # (block, offset) -> token
    digests: dict = dataclasses.field(default_factory=dict)  # block -> expected digest

    def run(self, plan, state: SchedulerState, mirror: dict) -> None:
        """Writes every row's tokens through its block table and checks what each row reads."""
        bs = self.block_size
        tables = {rid: t for rid, t in state.owned_blocks().items()}
        for i, rid in enumerate(plan.request_ids):
            start, length, table = plan.starts[i], plan.lengths[i], plan.block_tables[i]
            tokens = mirror[rid].tokens()
            drafts = plan.row_spec_token_ids(i)
            if drafts:  # the row feeds its newest token, then the drafts
                tokens = tokens[:start + 1] + drafts
            for p in range(start, start + length):
                block = table[p // bs]
                assert block is not None, "wrote into a released entry"
                # never write a cached (shared, immutable) block or one another sequence holds
                assert state.pool.ref_count(block) is None, "wrote into a cached block"
                assert not any(block in t for other, t in tables.items() if other != rid), \
                    "wrote into a block another sequence holds"
                self.slots[block, p % bs] = tokens[p]
                if p % bs == bs - 1:
                    self.digests[block] = chain_hashes(tokens[:p + 1], bs)[-1]
                else:
                    self.digests.pop(block, None)
            kv_len = start + length
            # the keys this chunk's first query sees (all of them without a window)
            first = 0 if self.window is None else max(0, start - self.window + 1)
            read = [self.slots.get((table[p // bs], p % bs)) for p in range(first, kv_len)]
            assert read == list(tokens[first:kv_len]), "a row attends over the wrong KV"

    def check(self, state: SchedulerState) -> None:
        """Every cached block's digest is the one its content and its prefix give."""
        cache = state.pool.cache
        if cache is None:
            return
        for b in range(state.pool.num_blocks):
            record = cache.records[b]
            if record is not None:
                assert record.digest == self.digests.get(b), "cached digest != its tokens"
                assert cache.lookup(record.digest) == b


def check_plan(pre: SchedulerState, plan, config: SchedulerConfig, mirror: dict) -> None:
    k = plan.num_decode_rows
    # budgets
    assert plan.num_tokens == sum(plan.lengths)
    if plan.num_tokens > config.max_num_batched_tokens:  # the documented legacy exception
        assert config.policy == "prefill_first" and plan.num_seqs == 1 and k == 0
        assert plan.engaged.oversize_prompt
    assert plan.num_seqs <= config.max_num_seqs, "more rows than max_num_seqs"
    assert len(set(plan.request_ids)) == plan.num_seqs
    waiting_before = {s.request_id: s for s in pre.waiting}
    admitted = [rid for rid in plan.request_ids if rid in waiting_before]
    if pre.num_running <= config.max_num_seqs:
        assert plan.state.num_running <= config.max_num_seqs
    else:  # max_num_seqs shrank below the running set: nobody new joins it
        assert not admitted
    if config.prefill_max_seqs:
        assert len(admitted) <= config.prefill_max_seqs
    if config.policy != "token_budget":
        assert plan.kind in ("prompt", "decode", "idle"), "legacy/alternate steps are one kind"
    # rows: cursors, chunks, sampling, tokens, slots
    cu = plan.cu_seqlens
    chunks = plan.chunks
    assert tuple(c.token_ids for c in chunks) == tuple(
        plan.token_ids[cu[i]:cu[i + 1]] for i in range(plan.num_seqs))
    assert [(c.request_id, c.start, c.length, c.samples, c.block_table) for c in chunks] == list(
        zip(plan.request_ids, plan.starts, plan.lengths, plan.samples, plan.block_tables))
    assert plan.num_sampled == sum(plan.samples) and plan.num_tokens == len(plan.token_ids)
    for i, rid in enumerate(plan.request_ids):
        start, length, table = plan.starts[i], plan.lengths[i], plan.block_tables[i]
        full = mirror[rid].tokens()
        drafts = plan.row_spec_token_ids(i)
        if drafts:  # decode row + drafts: never past max_tokens
            assert i < k and length == 1 + len(drafts)
            request = mirror[rid].request
            assert len(full) + len(drafts) <= len(request.prompt_token_ids) + request.max_tokens
            full = full + drafts
        cached = plan.num_cached[i]
        if rid in waiting_before:  # admitted: starts after its cached whole blocks
            assert start == cached and cached % config.block_size == 0
            assert cached <= len(full) - 1, "a cache hit left no token to compute"
            if not config.enable_prefix_caching:
                assert cached == 0
        else:
            assert start == pre.num_computed(rid) and cached == 0, "cursor jumped"
        assert 1 <= length and start + length <= len(full), "chunk passes the known tokens"
        assert plan.token_ids[cu[i]:cu[i + 1]] == full[start:start + length]
        final = start + length == len(full)
        assert plan.sample_counts[i] == (1 + len(drafts) if final else 0)
        assert plan.samples[i] == final, "only final chunks and decodes sample"
        if i < k:
            assert length == 1 + len(drafts) and rid in pre.decoding.ids
        else:
            assert rid not in pre.decoding.ids
            if not final:
                assert length % config.chunk_tile == 0, "non-final chunk not a tile multiple"
                if config.long_prefill_token_threshold:
                    assert length <= config.long_prefill_token_threshold
        assert len(table) >= blocks_for(start + length, config.block_size), "token without slot"
    # preemption: running before, waiting now with its cursor back at 0
    for rid in plan.preempted:
        assert rid not in waiting_before and rid not in plan.request_ids
        assert plan.state.num_computed(rid) == 0
        assert any(s.request_id == rid for s in plan.state.waiting)
    keys = _all_keys(pre)
    if keys:  # liveness lemma: the best-ranked request is never preempted
        assert min(keys, key=keys.get) not in plan.preempted
    if plan.preempted:  # victims are the lowest-ranked: no idle survivor ranks below one
        idle = [key for rid, key in _all_keys(plan.state).items()
                if rid not in plan.request_ids and rid not in waiting_before
                and rid not in plan.preempted and not any(
                    s.request_id == rid for s in plan.state.waiting)]
        assert all(key < keys[v] for v in plan.preempted for key in idle), "wrong victim"
    # FCFS: no admission overtakes an earlier waiting request of the same priority, including
    # one preempted in this very step
    for rid in admitted:
        key = waiting_before[rid].key
        assert not any(s.key[0] == key[0] and s.key < key for s in plan.state.waiting), "overtaken"
    # an admitted prompt that gets no chunk holds newcomers back (no starvation by later arrivals)
    if admitted:
        assert all(p.seq.request_id in plan.request_ids for p in pre.partial)
    # progress: a plan with work to do is never empty unless it preempted
    if pre.has_work():
        assert plan.num_seqs or plan.preempted
    # stall-freedom: decodes that fit the budget and their blocks all run, every step
    if config.policy == "token_budget":
        dec = pre.decoding
        need = sum(blocks_for(c + 1, config.block_size) > len(t)
                   for c, t in zip(dec.computed, dec.tables))
        if (len(dec) <= min(config.max_num_batched_tokens, config.max_num_seqs)
                and need <= pre.pool.num_free):
            assert plan.request_ids[:k] == dec.ids, "a decode stalled"
        if len(dec) <= min(config.max_num_batched_tokens, config.max_num_seqs):
            # under KV pressure too: a decode-ready sequence decodes or is preempted, never idles
            assert set(plan.request_ids[:k]) | set(plan.preempted) >= set(dec.ids)
    check_blocks(plan.state, config, exact=False)
    check_window(plan.state, config, planned=True)


def check_state(state: SchedulerState, config: SchedulerConfig, mirror: dict) -> None:
    check_blocks(state, config, exact=True)
    check_window(state, config, planned=False)
    ids = state.request_ids()
    assert len(ids) == len(set(ids))
    assert state.held == frozenset(ids)
    assert all(mirror[rid].status == "live" for rid in ids)
    assert list(state.waiting) == sorted(state.waiting, key=lambda s: s.key)
    assert list(state.decoding.keys) == sorted(state.decoding.keys)
    assert len(state.partial) <= (0 if config.policy == "prefill_first"
                                  else config.max_num_partial_prefills)
    for part in state.partial:
        assert 0 < part.computed < len(part.seq.tokens)
        assert part.seq.tokens == mirror[part.seq.request_id].tokens()
    for row, rid in enumerate(state.decoding.ids):
        assert state.decoding.computed[row] == len(mirror[rid].tokens()) - 1
        assert state.decoding.outputs(row) == tuple(mirror[rid].outputs)


def verified(sampler, rid, start: int, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """What a decode row at cursor `start` verifying `drafts` yields when `sampler` is the
    model: the drafts it agrees with, then its own token at the first disagreement (or after
    the last draft)."""
    out = []
    for j in range(len(drafts) + 1):
        out.append(sampler(rid, start + 1 + j))
        if j == len(drafts) or drafts[j] != out[-1]:
            return tuple(out)


def drafter(seed: int, sampler, max_k: int = 5):
    """A proposer for `drive`: per decode-ready row, 0 .. max_k drafts, each the model's true
    token with a per-row probability (0, 0.5, 0.9 or 1), else garbage: random acceptance."""
    rng = random.Random(seed)

    def propose(state: SchedulerState) -> dict:
        drafts = {}
        for rid, c in zip(state.decoding.ids, state.decoding.computed):
            if rng.random() < 0.2:
                continue
            p = rng.choice([0.0, 0.5, 0.9, 1.0])
            drafts[rid] = tuple(sampler(rid, c + 1 + j) if rng.random() < p else 99_000 + j
                                for j in range(rng.randint(1, max_k)))
        return drafts

    return propose


def check_drafts_use_leftovers(pre: SchedulerState, config: SchedulerConfig, plan) -> None:
    """Drafts change nothing but the decode rows' lengths and tables: the plan without them has
    the same rows, chunks, admissions and preemptions."""
    plain = schedule(pre, config)
    k = plan.num_decode_rows
    assert (plain.request_ids, plain.starts, plain.samples, plain.preempted, plain.num_cached,
            plain.lengths[k:], plain.block_tables[k:]) == (
        plan.request_ids, plan.starts, plan.samples, plan.preempted, plan.num_cached,
        plan.lengths[k:], plan.block_tables[k:]), "drafts took a prefill's budget or blocks"
    assert plan.num_tokens == plain.num_tokens + plan.num_spec_tokens
    assert all(t[:len(p)] == p for t, p in zip(plan.block_tables, plain.block_tables))
    knobs = lambda e: {n: bool(v) for n, v in e.as_dict().items() if n != "drafts_trimmed"}  # noqa: E731
    assert knobs(plan.engaged) == knobs(plain.engaged)


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


# ---- budgets, chunks, blocks, FCFS, stall-freedom: checked on every step of random workloads ----

@settings(max_examples=150, **_SETTINGS)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    drive(workload)


@settings(max_examples=60, **_SETTINGS)
@given(workloads(aborts=True))
def test_aborts_free_everything(workload):
    drive(workload)


@settings(max_examples=25, **_SETTINGS)
@given(workloads(max_requests=6))
def test_purity_inputs_unchanged_and_plans_repeatable(workload):
    drive(workload, purity=True)


@settings(max_examples=60, **_SETTINGS)
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

def _sampler(rid, position):
    """A fake model: the token at `position` depends only on the request and the position."""
    return (rid * 7919 + position * 104729) % 1000


@settings(max_examples=40, **_SETTINGS)
@given(workloads(shared=True, aborts=True))
def test_prefix_caching_changes_no_output(workload):
    """Shared prefixes (ending inside a block, block-aligned, whole prompts): with caching on or
    off every request generates the same tokens (and `drive` checks, every step, that each row
    reads exactly its own tokens' KV, that cached digests match a recomputation from the token
    lists, that no cached block is written, and that blocks in use return to 0)."""
    outputs = {}
    for caching in (False, True):
        config = dataclasses.replace(workload.config, enable_prefix_caching=caching)
        trace = drive(dataclasses.replace(workload, config=config), sampler=_sampler)
        outputs[caching] = {rid: f.output_token_ids for rid, f in trace.outputs.items()}
        saved = sum(plan.num_cached_tokens for _, plan in trace.steps)
        assert saved == 0 or caching
    assert outputs[False] == outputs[True]


# ---- sliding windows --------------------------------------------------------------------------

@settings(max_examples=80, **_SETTINGS)
@given(workloads(windows=True, aborts=True))
def test_sliding_window_releases_exactly_the_blocks_behind_each_window(workload):
    """Every layer slides: after each plan every running sequence holds exactly the blocks its
    window still reads, from its cursor on (check_window), the rest being back in the pool;
    every row reads the right token in every slot of its window (GhostCache); `drive`'s other
    checks (partition of the blocks, liveness guard, outputs) hold as without a window."""
    drive(workload)


@settings(max_examples=40, **_SETTINGS)
@given(workloads(windows=True, shared=True, aborts=True))
def test_sliding_window_prefix_caching_changes_no_output(workload):
    """With a window, a waiting sequence reuses a cached prefix as far as its window needs it
    (the blocks before may be gone): outputs are those without caching, and every row still
    reads exactly its own tokens inside its window."""
    outputs = {}
    for caching in (False, True):
        config = dataclasses.replace(workload.config, enable_prefix_caching=caching)
        trace = drive(dataclasses.replace(workload, config=config), sampler=_sampler)
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


@settings(max_examples=60, **_SETTINGS)
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

@settings(max_examples=80, **_SETTINGS)
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


@settings(max_examples=100, **_SETTINGS)
@given(workloads(pressure=False))
def test_liveness_without_kv_pressure(workload):
    """Without KV pressure nothing is preempted and, once every request has arrived, every step
    computes at least one token of some request (check_plan: no empty plan while work exists).
    A request computes at most prompt + max_tokens - 1 tokens, so all requests finish within
    last_arrival + 1 + sum(prompt + max_tokens - 1) steps."""
    trace = drive(workload)
    assert trace.num_preempted == 0
    assert len(trace.steps) <= _liveness_bound(workload, 0)


@settings(max_examples=150, **_SETTINGS)
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


@settings(max_examples=40, **_SETTINGS)
@given(workloads(), st.data())
def test_knobs_may_change_between_steps(workload, data):
    """The state is policy-agnostic: switching policy and knobs each step keeps every invariant."""
    configs = [dataclasses.replace(workload.config, policy=p, prefill_floor_steps=f)
               for p in POLICIES for f in (0, 1)]
    choices = data.draw(st.lists(st.integers(0, len(configs) - 1), min_size=1, max_size=50))
    pick = lambda step: configs[choices[step % len(choices)]]  # noqa: E731
    drive(dataclasses.replace(workload, config=dataclasses.replace(
        workload.config, policy="token_budget")), config_for_step=pick)


@settings(max_examples=40, **_SETTINGS)
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
