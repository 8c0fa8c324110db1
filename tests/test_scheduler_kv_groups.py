"""KV cache groups in the planner (scheduler/kv_groups.py): one block table per attention type
over one pool, sliding groups releasing what fell out of their window, vLLM's prefix-hit rule.

The harness (`drive_groups`) runs random workloads (the factories of
test_scheduler_properties.py, given random group windows) serially or with random overlapped
steps, aborts and draft tokens, and checks after every call, independently of the planner:

  1. blocks: free, cached-unreferenced and held blocks partition the pool; a block sits in one
     group's column only (no sharing across groups); an uncached block is held once, a cached
     one by exactly `refs` tables; outside a step each table has G entries per block index;
  2. windows, per group: a full group releases nothing; a sliding group's released entries are
     a prefix, just planned exactly the blocks wholly behind its window;
  3. KV content (`GroupGhost`): every row writes its true tokens through each group's table
     and reads exactly its own tokens inside each group's window; every cached block's key is
     the one its content gives; host-tier stores and loads move contents in device order
     (stores before the step, loads after it), so a row reading a block before its load
     landed reads the wrong KV and fails;
  4. outputs: every finished request's tokens are the fake model's (a function of request and
     position), hence equal to a single-table run's.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from scheduler import ConfigError, Request, RequestTooLargeError, SchedulerConfig, SchedulerState
from scheduler import abort, add_request, advance, blocks_for, commit, schedule
from scheduler.kv_groups import find_hits, group_tables, slid_groups
from scheduler.prefix import chain_hashes, group_key
from scheduler.scheduler_config import peak_blocks
from scheduler.window import first_needed
from test_scheduler_overlap import _expected, _truth
from test_scheduler_properties import _SETTINGS, _sampler, drafter, verified, workloads

GROUP_WINDOWS = st.sampled_from([(None, 4), (6, None, 6), (None, 3, 13), (2, 5), (None, None, 7),
                                 (None, 9, 9, 9, 9, 9)])


@st.composite
def group_workloads(draw, *, host=False, tight=None, groups=GROUP_WINDOWS, **kw):
    """`workloads(...)` under random KV cache groups (`groups`; () keeps one table, with the
    workload's window); the pool holds the largest request's peak (`peak_blocks`) plus 0 .. 3
    blocks (`tight`, drawn when None), or G times what a single table needs; `host`: prefix
    caching on and a host tier of 1 .. 24 slots."""
    workload = draw(workloads(**kw))
    groups = draw(groups)
    config = dataclasses.replace(workload.config, kv_cache_groups=groups,
                                 num_blocks=10**6, watermark_blocks=0)
    if host:
        config = dataclasses.replace(config, enable_prefix_caching=True,
                                     num_host_blocks=draw(st.integers(1, 24)))
    watermark = workload.config.watermark_blocks
    peak = max(peak_blocks(config, len(r.prompt_token_ids) + r.max_tokens - 1)
               for r in workload.requests)
    if tight is None:
        tight = draw(st.sampled_from([True, True, False]))
    extra = draw(st.integers(0, 3))
    spare = workload.config.num_blocks - watermark  # what the single-table pool holds
    num_blocks = peak + extra if tight else len(groups) * spare
    config = dataclasses.replace(config, num_blocks=num_blocks + watermark,
                                 watermark_blocks=watermark)
    return dataclasses.replace(workload, config=config)


@dataclasses.dataclass
class GroupGhost:
    """The test's model of the device and host KV: what each slot holds ((group, token)), the
    key each full block's content gives, and the host slots' copies."""

    config: SchedulerConfig
    slots: dict = dataclasses.field(default_factory=dict)  # (block, offset) -> (group, token)
    keys: dict = dataclasses.field(default_factory=dict)  # block -> key of its content
    host: dict = dataclasses.field(default_factory=dict)  # slot -> (contents, key)
    moved: list = dataclasses.field(default_factory=lambda: [0, 0])  # stores, loads

    def run(self, plan, truth: dict) -> None:
        """One plan in device order: its stores, its rows (writes, then reads), its loads."""
        config, pool = self.config, plan.state.pool
        bs, windows, G = config.block_size, config.group_windows, config.num_kv_groups
        for block, slot in plan.kv_stores:  # before the step: it may overwrite them
            key = self.keys.get(block)
            assert key is not None, "stored a block that holds no full, known block"
            self.host[slot] = ({o: self.slots.get((block, o)) for o in range(bs)}, key)
            self.moved[0] += 1
        if plan.kv_stores:
            stored = pool.host.keys()
            for _, slot in plan.kv_stores:
                assert stored[slot] == self.host[slot][1], "host slot keyed by other tokens"
        tables = plan.state.owned_blocks()
        assert not set(plan.loading) & set(plan.request_ids), "ran before its loads landed"
        for i, rid in enumerate(plan.request_ids):
            start, length, table = plan.starts[i], plan.lengths[i], plan.block_tables[i]
            tokens = truth[rid].tokens()
            drafts = plan.row_spec_token_ids(i)
            if drafts:
                tokens = tokens[:start + 1] + drafts
            assert len(table) == G * blocks_for(start + length, bs), "table != G per index"
            for g, (window, column) in enumerate(zip(windows, group_tables(table, G))):
                for p in range(start, start + length):
                    block = column[p // bs]
                    assert block is not None, "wrote into a released entry"
                    assert pool.ref_count(block) is None, "wrote into a cached block"
                    assert not any(block in t for other, t in tables.items() if other != rid), \
                        "wrote into a block another sequence holds"
                    self.slots[block, p % bs] = (g, tokens[p])
                    if p % bs == bs - 1:
                        self.keys[block] = group_key(chain_hashes(tokens[:p + 1], bs)[-1], g)
                    else:
                        self.keys.pop(block, None)
                first = 0 if window is None else max(0, start - window + 1)
                read = [self.slots.get((column[p // bs], p % bs))
                        for p in range(first, start + length)]
                assert read == [(g, t) for t in tokens[first:start + length]], \
                    f"row {rid} reads the wrong KV in group {g}"
        for slot, block in plan.kv_loads:  # after the step, before the next one
            contents, key = self.host[slot]
            assert pool.cache.records[block].digest == key, "loaded into a block of another key"
            for offset, value in contents.items():
                self.slots[block, offset] = value
            self.keys[block] = key
            self.moved[1] += 1

    def check(self, state: SchedulerState) -> None:
        """Every cached block's key is its content's; every host slot's key its copy's."""
        cache = state.pool.cache
        if cache is None:
            return
        for b in range(state.pool.num_blocks):
            record = cache.records[b]
            if record is not None:
                assert record.digest == self.keys.get(b), "cached key != its content"
                assert cache.lookup(record.digest) == b
        if state.pool.host is not None:
            for slot, key in state.pool.host.keys().items():
                assert self.host[slot][1] == key and state.pool.host.lookup(key) == slot


def _cursors(state: SchedulerState):
    return ([(p.computed, p.table) for p in state.partial]
            + list(zip(state.decoding.computed, state.decoding.tables)))


def check_group_blocks(state: SchedulerState, *, exact: bool, planned: bool) -> None:
    """Checks 1 and 2 of the module docstring."""
    config, pool = state.config, state.pool
    windows, G, bs = config.group_windows, config.num_kv_groups, config.block_size
    free, idle = pool.free_blocks(), pool.cached_free_blocks()
    assert len(free) + len(idle) == pool.num_free and len(idle) == pool.num_cached_free
    holders: dict[int, int] = {}
    column: dict[int, int] = {}
    for table in state.owned_blocks().values():
        assert len(table) % G == 0, "a table without one entry per group and index"
        held = [b for b in table if b is not None]
        assert len(set(held)) == len(held), "a block twice in one table"
        for position, b in enumerate(table):
            if b is None:
                assert windows[position % G] is not None, "a full-attention group released"
                continue
            holders[b] = holders.get(b, 0) + 1
            assert column.setdefault(b, position % G) == position % G, "a block in two groups"
    assert sorted([*free, *idle, *holders]) == list(range(config.num_blocks)), \
        "a block leaked or is in two places"
    assert pool.num_in_use == len(holders)
    for b in range(config.num_blocks):
        refs = pool.ref_count(b)
        if refs is None:
            assert holders.get(b, 0) <= 1, "an uncached block is shared"
        else:
            assert refs == holders.get(b, 0), "reference count != live holders"
    for cursor, table in _cursors(state):
        if exact:
            assert len(table) == G * blocks_for(cursor, bs)
        for window, col in zip(windows, group_tables(table, G)):
            released = sum(b is None for b in col)
            assert all(b is None for b in col[:released]), "released entries not a prefix"
            if window is None:
                continue
            needed = first_needed(cursor, window, bs)
            if planned:
                assert released == needed, f"released {released}, the window allows {needed}"
                if released and currently_in_test_context():
                    event("a sliding group released blocks")
            else:
                assert released <= needed, "released a block the window still reads"


@dataclasses.dataclass
class GroupRun:
    outputs: dict  # request id -> output token ids
    plans: list  # every plan made, in order
    ghost: GroupGhost


def drive_groups(workload, *, overlap=(False,), abort_points=(), propose=None) -> GroupRun:
    """Runs the workload to completion under every check above. `overlap[i % len]`: iteration
    i advances the plan in flight and plans the next before committing it; `abort_points`:
    (iteration, request index, where: 0 before planning, 1 between plan and fill, 2 after);
    `propose(state)`: draft tokens by request id."""
    config = workload.config
    requests = {r.request_id: r for r in workload.requests}
    stop_after = {r.request_id: s for r, s in zip(workload.requests, workload.stop_after)}
    truth = {rid: _Truth(_truth(r)) for rid, r in requests.items()}
    ghost = GroupGhost(config)
    pending, status, outputs, plans = list(workload.requests), {}, {}, []
    state, in_flight = SchedulerState.empty(config), None
    limit = 30 + 4 * (workload.last_arrival + 1 + workload.total_work * (len(requests) + 2))

    def sample(plan):
        tokens, stopped = [], []
        for r, (rid, start, n, s) in enumerate(zip(plan.request_ids, plan.starts, plan.lengths,
                                                   plan.samples)):
            if s:
                drafts = plan.row_spec_token_ids(r)
                first = start + n - len(drafts)
                out = (verified(_sampler, rid, start, drafts) if drafts
                       else (truth[rid].tokens()[first],))
                made = first - len(requests[rid].prompt_token_ids) + 1
                stop = stop_after[rid]
                if status[rid] == "live" and stop is not None and made <= stop < made + len(out):
                    out = out[:stop - made + 1]
                    stopped.append(rid)
                tokens.append(out if drafts else out[0])
        return tokens, stopped

    def finish(records):
        for f in records:
            assert status[f.request_id] == "live"
            assert (f.output_token_ids, f.reason) == _expected(requests[f.request_id],
                                                               stop_after[f.request_id])
            status[f.request_id] = "finished"
            outputs[f.request_id] = f.output_token_ids

    def aborts(step, where, state):
        for when, index, at in abort_points:
            rid = workload.requests[index].request_id
            if when == step and at == where and status.get(rid) == "live":
                state = abort(state, rid)
                status[rid] = "aborted"
                check_group_blocks(state, exact=False, planned=False)
        return state

    def launch(plan):
        plans.append(plan)
        assert plan.num_seqs <= config.max_num_seqs
        ghost.run(plan, truth)
        check_group_blocks(plan.state, exact=False, planned=True)

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
            check_group_blocks(ahead, exact=False, planned=False)
            plan = schedule(ahead, config, propose(ahead) if propose else None)
            state = plan.state
            in_flight = None if plan.is_empty else plan
            if in_flight is not None:
                launch(plan)
            state = aborts(step, 1, state)
            tokens, stopped = sample(prev)
            state, records = commit(state, prev, tokens, float(step), stopped)
            finish(records)
        else:
            if in_flight is not None:
                tokens, stopped = sample(in_flight)
                state, records = commit(state, in_flight, tokens, float(step), stopped)
                finish(records)
                in_flight = None
                check_group_blocks(state, exact=True, planned=False)
                ghost.check(state)
            plan = schedule(state, config, propose(state) if propose else None)
            state = plan.state
            if not plan.is_empty:
                launch(plan)
                in_flight = plan
            elif state.has_work():
                assert plan.preempted, "an empty plan while work exists"
        state = aborts(step, 2, state)
        check_group_blocks(state, exact=False, planned=False)
        step += 1
    assert all(s in ("finished", "aborted") for s in status.values()), status
    assert state.pool.num_free == config.num_blocks and state.pool.num_in_use == 0
    ghost.check(state)
    if currently_in_test_context():
        if any(p.kv_loads for p in plans):
            event("host blocks loaded back")
        if any(p.loading for p in plans):
            event("a request waited for its loads")
        if any(p.preempted for p in plans):
            event("preempted")
        if any(p.num_cached_tokens for p in plans):
            event("prefix hit")
    return GroupRun(outputs=outputs, plans=plans, ghost=ghost)


@dataclasses.dataclass
class _Truth:
    tokens_: tuple[int, ...]

    def tokens(self) -> tuple[int, ...]:
        return self.tokens_


_OVERLAP = st.lists(st.booleans(), min_size=1, max_size=4)


# ---- properties -------------------------------------------------------------------------------

@settings(max_examples=40, **_SETTINGS)
@given(group_workloads(aborts=True))
def test_hybrid_groups_keep_every_invariant(workload):
    drive_groups(workload)


@settings(max_examples=25, **_SETTINGS)
@given(group_workloads(shared=True), _OVERLAP, st.data())
def test_hybrid_groups_overlapped_with_drafts_and_aborts(workload, overlap, data):
    points = data.draw(st.lists(st.tuples(
        st.integers(0, 40), st.integers(0, len(workload.requests) - 1), st.integers(0, 2)),
        max_size=3))
    propose = drafter(data.draw(st.integers(0, 99)), _sampler) if data.draw(st.booleans()) else None
    drive_groups(workload, overlap=overlap, abort_points=points, propose=propose)


@settings(max_examples=25, **_SETTINGS)
@given(group_workloads(pressure=False, tight=False, shared=True, stops=False))
def test_hybrid_plans_equal_single_table_plans_without_pressure(workload):
    """With blocks to spare, the hybrid planner runs exactly the single-table planner's rows
    (ids, cursors, chunk lengths, sampling, cache hits), and the outputs are equal."""
    config = workload.config  # no block is ever allocated twice: nothing is evicted
    num_blocks = config.num_kv_groups * sum(
        blocks_for(len(r.prompt_token_ids) + r.max_tokens, config.block_size)
        for r in workload.requests) + config.watermark_blocks + 1
    workload = dataclasses.replace(workload, config=dataclasses.replace(
        config, num_blocks=num_blocks))
    single = dataclasses.replace(workload.config, kv_cache_groups=())
    hybrid_run = drive_groups(workload)
    single_run = drive_groups(dataclasses.replace(workload, config=single))
    rows = lambda p: (p.request_ids, p.starts, p.lengths, p.samples, p.num_cached)  # noqa: E731
    assert [rows(p) for p in hybrid_run.plans] == [rows(p) for p in single_run.plans]
    assert hybrid_run.outputs == single_run.outputs


@settings(max_examples=20, **_SETTINGS)
@given(group_workloads(tight=True, shared=True))
def test_hybrid_outputs_equal_single_table_outputs_under_pressure(workload):
    single = dataclasses.replace(workload.config, kv_cache_groups=())
    single = dataclasses.replace(single, num_blocks=single.num_blocks * single.num_kv_groups)
    assert drive_groups(workload).outputs == drive_groups(
        dataclasses.replace(workload, config=single)).outputs


# ---- units -------------------------------------------------------------------------------------

def _gemma3(**kw) -> SchedulerConfig:
    """Gemma 3's shape at small scale: five sliding groups (window 16) beside a full one."""
    values = dict(kv_cache_groups=(16, 16, 16, 16, 16, None), block_size=4, num_blocks=400,
                  chunk_tile=8, max_num_batched_tokens=16)
    return SchedulerConfig(**(values | kw))


def _run_alone(config, request):
    state = add_request(SchedulerState.empty(config), request)
    held = []
    while state.has_work():
        plan = schedule(state, config)
        held.append(plan.state.pool.num_in_use)
        state, _ = commit(plan.state, plan, [1] * plan.num_sampled, 0.0)
    return held


def test_sliding_groups_hold_their_window_and_the_peak_bound_is_tight():
    """One 300-position request: the full group holds every block, each sliding group at most
    its window plus a chunk; the most held at once is `peak_blocks`, and far below G tables."""
    config = _gemma3()
    request = Request(request_id=0, prompt_token_ids=tuple(range(1, 200)), max_tokens=102)
    held = _run_alone(config, request)
    positions = 199 + 102 - 1
    full = blocks_for(positions, 4)
    assert max(held) <= peak_blocks(config, positions)
    assert max(held) >= full + 5 * (16 // 4)  # the full group plus every window
    assert held[-1] <= full + 5 * (blocks_for(16, 4) + 1)
    assert peak_blocks(config, positions) < 0.3 * 6 * full


@pytest.mark.parametrize("window,chunk,bs", [(1, 1, 1), (5, 8, 4), (16, 8, 4), (13, 16, 8),
                                             (3, 2, 16)])
def test_peak_of_a_sliding_group_is_the_worst_cursor(window, chunk, bs):
    """blocks_for(W + q + bs - 2) equals the most blocks a sliding group holds while a chunk
    of q runs from any cursor c (brute force over c)."""
    config = SchedulerConfig(kv_cache_groups=(window,), block_size=bs, chunk_tile=chunk,
                             max_num_batched_tokens=chunk)
    brute = max(blocks_for(c + chunk, bs) - first_needed(c, window, bs) for c in range(400))
    assert peak_blocks(config, 10**6) == brute


def test_request_limit_counts_what_a_hybrid_request_holds():
    """The length limit follows the peak: a hybrid pool of 100 blocks serves requests a
    100-block pool of six single tables would need 6x the blocks for; an all-sliding pool has
    no length limit; "prefill_first" (whole prompts) counts every block."""
    config = _gemma3(num_blocks=100)
    limit = config.max_request_tokens
    assert peak_blocks(config, limit - 1) <= 100 < peak_blocks(config, limit - 1 + 4)
    assert limit == 65 * 4 + 1  # 65 full blocks + 5 windows of 7; six single tables: 16 * 4 + 1
    add_request(SchedulerState.empty(config),
                Request(request_id=0, prompt_token_ids=(1,) * (limit - 5), max_tokens=5))
    with pytest.raises(RequestTooLargeError) as err:
        add_request(SchedulerState.empty(config),
                    Request(request_id=0, prompt_token_ids=(1,) * limit, max_tokens=5))
    assert err.value.field == "max_tokens" and err.value.limit == limit
    assert SchedulerConfig(kv_cache_groups=(16, 16), num_blocks=100, block_size=4,
                           chunk_tile=8).max_request_tokens is None
    whole = _gemma3(num_blocks=100, policy="prefill_first")
    assert whole.max_request_tokens == 100 // 6 * 4 + 1


def test_prefix_hit_is_the_full_hit_cut_to_where_every_window_is_cached():
    """vLLM's rule: the full group's leading run, shortened until every sliding group holds
    its last window of blocks; a shorter prefix may need other window blocks (fixed point)."""
    from scheduler.blocks import BlockPool

    bs, windows = 4, (None, 5)  # the first query, at n * 4, reads keys n*4 - 4 ..: block n - 1
    hashes = chain_hashes(tuple(range(40)), bs)  # 10 blocks
    pool = BlockPool.full(64, prefix_caching=True)
    pairs = [(b, group_key(hashes[b], 0)) for b in range(10)]  # full group: all 10 cached
    pairs += [(20 + b, group_key(hashes[b], 1)) for b in (0, 1, 2, 3, 5, 8)]  # sliding: gaps
    pool = pool.register(pairs)
    hits = find_hits(pool, hashes, windows, bs)
    # ending at 10 needs sliding block 9 (missing); at 9 needs 8 (ok): prefix of 9 blocks
    assert hits.num_blocks == 9 and hits.loads == ()
    table = group_tables(hits.table, 2)
    assert table[0] == tuple(range(9))
    assert table[1] == (None,) * 8 + (28,)
    # without sliding block 8 the fixed point walks back: 8 needs 7 (missing), 7 needs 6 ...
    pool = BlockPool.full(64, prefix_caching=True).register(
        [p for p in pairs if p[0] != 28])
    hits = find_hits(pool, hashes, windows, bs)
    assert hits.num_blocks == 6 and group_tables(hits.table, 2)[1] == (None,) * 5 + (25,)
    # a full group missing block 3 caps everything at 3
    pool = BlockPool.full(64, prefix_caching=True).register([p for p in pairs if p[0] != 3])
    assert find_hits(pool, hashes, windows, bs).num_blocks == 3


def test_slid_groups_releases_only_sliding_columns():
    table = tuple(range(12))  # 4 block indices x 3 groups
    slid, freed = slid_groups(table, cursor=13, windows=(None, 4, 9), block_size=4)
    # cursor 13: window 4 needs keys 10.. (blocks 2, 3); window 9 needs keys 5.. (blocks 1..)
    assert group_tables(slid, 3) == ((0, 3, 6, 9), (None, None, 7, 10), (None, 5, 8, 11))
    assert freed == (1, 2, 4)
    assert slid_groups(slid, 13, (None, 4, 9), 4) == (slid, ())


def test_group_config_is_validated_and_part_of_the_cache_geometry():
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(kv_cache_groups=(None, 0))
    assert err.value.field == "kv_cache_groups"
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(kv_cache_groups=[None, 4])
    assert err.value.field == "kv_cache_groups"
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(kv_cache_groups=(None, 4), sliding_window=4)
    assert err.value.field == "sliding_window"
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(kv_cache_groups=(None,) * 256)
    assert err.value.field == "kv_cache_groups" and err.value.limit == 255
    config = SchedulerConfig(kv_cache_groups=(None, 4))
    state = SchedulerState.empty(config)
    with pytest.raises(ConfigError) as err:
        schedule(state, dataclasses.replace(config, kv_cache_groups=(None, 8)))
    assert err.value.field == "kv_cache_groups"
    assert config.group_windows == (None, 4) and config.num_kv_groups == 2
    assert SchedulerConfig(sliding_window=7).group_windows == (7,)
