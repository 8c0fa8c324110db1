"""The KV-cache-group harness the planner's group and host-tier property tests drive
(tests/test_scheduler_kv_groups.py, test_scheduler_host_tier.py): random workloads under random
KV cache groups (`group_workloads`), a ghost of the device and host KV that moves block
contents in device order (`GroupGhost`), the per-group block and window invariants
(`check_group_blocks`) and a driver that runs a workload to completion under every check,
serially or with overlapped steps, aborts and drafts (`drive_groups`)."""

from __future__ import annotations

import dataclasses

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from scheduler import SchedulerConfig, SchedulerState
from scheduler import abort, advance, add_request, blocks_for, commit, schedule
from scheduler.kv_groups import group_tables
from scheduler.prefix import chain_hashes, group_key
from scheduler.scheduler_config import peak_blocks
from scheduler.window import first_needed
from support.scheduler_drivers import _expected, _truth, _Truth
from support.scheduler_workloads import fake_token, verified, workloads

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
                out = (verified(fake_token, rid, start, drafts) if drafts
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
