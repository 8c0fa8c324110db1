"""What every scheduler plan and committed state must satisfy, checked independently of the
planner's code: budgets, row order, cursors, chunk tiles, sampling rows, token ids, block
slots, admissions (cap, FCFS), preemptions, stall-freedom (token_budget); blocks partitioned
into free, cached and held; sliding windows; LoRA adapter slots; and a ghost KV cache that
writes every row's tokens (and the adapter that computed them) through its block table and
checks what each row reads."""

from __future__ import annotations

import dataclasses

from hypothesis import event
from hypothesis.control import currently_in_test_context

from scheduler import SchedulerConfig, SchedulerState
from scheduler import blocks_for, schedule
from scheduler.lora_slots import adapter_counts
from scheduler.prefix import chain_hashes, root_digest
from scheduler.window import first_needed


def running_sequences(state: SchedulerState) -> list:
    """The running sequences: mid-prefill, decoding, verifying."""
    return [*(p.seq for p in state.partial), *state.decoding.seqs,
            *(row.seq for row in state.verifying)]


def check_adapters(state: SchedulerState, config: SchedulerConfig) -> None:
    """Running sequences use at most max_loras adapters; a drain names a running one."""
    counts = adapter_counts(running_sequences(state))
    assert len(counts) <= config.max_loras, f"{len(counts)} adapters > max_loras"
    assert state.running_adapters() == set(counts), "running_adapters() misses an adapter"
    if counts and currently_in_test_context():
        event(f"{len(counts)} adapters running (max_loras {config.max_loras})")


def _waits_for_slot(state: SchedulerState, config: SchedulerConfig, seq) -> bool:
    """Whether a waiting sequence may be passed over for want of an adapter slot: its
    adapter holds none and every slot is taken, or its adapter drains."""
    adapter = seq.request.adapter
    if adapter is None:
        return False
    counts = adapter_counts(running_sequences(state))
    return adapter == state.lora_drain or (adapter not in counts
                                           and len(counts) >= config.max_loras)

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
    # (block, offset) -> (token, adapter that computed it)
    slots: dict = dataclasses.field(default_factory=dict)
    digests: dict = dataclasses.field(default_factory=dict)  # block -> expected digest

    def run(self, plan, state: SchedulerState, mirror: dict) -> None:
        """Writes every row's tokens through its block table and checks what each row reads."""
        bs = self.block_size
        tables = {rid: t for rid, t in state.owned_blocks().items()}
        for i, rid in enumerate(plan.request_ids):
            start, length, table = plan.starts[i], plan.lengths[i], plan.block_tables[i]
            tokens = mirror[rid].tokens()
            adapter = mirror[rid].adapter
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
                self.slots[block, p % bs] = tokens[p], adapter
                if p % bs == bs - 1:
                    self.digests[block] = chain_hashes(tokens[:p + 1], bs,
                                                       root_digest(adapter))[-1]
                else:
                    self.digests.pop(block, None)
            kv_len = start + length
            # the keys this chunk's first query sees (all of them without a window)
            first = 0 if self.window is None else max(0, start - self.window + 1)
            read = [self.slots.get((table[p // bs], p % bs)) for p in range(first, kv_len)]
            assert read == [(t, adapter) for t in tokens[first:kv_len]], \
                "a row attends over the wrong KV (tokens, or another adapter's)"

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
    # one preempted in this very step, unless that one waits for a LoRA adapter slot
    for rid in admitted:
        key = waiting_before[rid].key
        assert not any(s.key[0] == key[0] and s.key < key
                       and not _waits_for_slot(plan.state, config, s)
                       for s in plan.state.waiting), "overtaken"
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
    check_adapters(plan.state, config)
    rows = {mirror[rid].adapter for rid in plan.request_ids} - {None}
    assert len(rows) <= config.max_loras, "a step with more adapters than max_loras"


def check_state(state: SchedulerState, config: SchedulerConfig, mirror: dict) -> None:
    check_blocks(state, config, exact=True)
    check_window(state, config, planned=False)
    check_adapters(state, config)
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
