"""Worked examples of automatic prefix caching (the random workloads, with a ghost KV cache, are in
test_scheduler_properties.py)."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import (ConfigError, Request, SchedulerConfig, SchedulerState, abort, add_request,
                       commit, schedule)
from scheduler.prefix import ROOT_DIGEST, PagedArray, block_hash, chain_hashes

BS = 4


def make_config(**overrides) -> SchedulerConfig:
    values = dict(max_num_batched_tokens=64, chunk_tile=4, block_size=BS, num_blocks=32,
                  max_num_seqs=8, enable_prefix_caching=True)
    values.update(overrides)
    return SchedulerConfig(**values)


def request(rid, prompt, max_tokens=2) -> Request:
    return Request(request_id=rid, prompt_token_ids=tuple(prompt), max_tokens=max_tokens)


def step(state, config, stop=()):
    plan = schedule(state, config)
    state, finished = commit(plan.state, plan, [9] * plan.num_sampled, 1.0, stop)
    return plan, state, finished


def run_to_end(state, config):
    finished = []
    while state.has_work():
        _, state, done = step(state, config)
        finished += done
    return state, finished


def row(plan, rid):
    i = plan.request_ids.index(rid)
    return plan.starts[i], plan.lengths[i], plan.num_cached[i], plan.block_tables[i]


def test_digests_are_deterministic_and_chained():
    """blake2b over the parent digest and int64 ids: the same in every process (pinned value)."""
    first = block_hash(ROOT_DIGEST, (1, 2, 3, 4))
    assert first.hex() == block_hash(ROOT_DIGEST, [1, 2, 3, 4]).hex()
    assert first.hex() == "7077f7c78cbaa9547bb8ede0e304f4f3"  # not Python's per-process hash
    assert chain_hashes(tuple(range(1, 11)), BS) == (
        first, block_hash(first, (5, 6, 7, 8)))  # the partial tail block has no digest
    assert block_hash(ROOT_DIGEST, (5, 6, 7, 8)) != block_hash(first, (5, 6, 7, 8))


def test_second_identical_prompt_reuses_whole_blocks():
    config = make_config()
    prompt = range(100, 110)  # 10 tokens: 2 full blocks + 2
    state = add_request(SchedulerState.empty(config), request("a", prompt, max_tokens=5))
    plan, state, _ = step(state, config)
    assert row(plan, "a")[:3] == (0, 10, 0)
    state = add_request(state, request("b", prompt))
    plan, state, _ = step(state, config)
    start, length, cached, table = row(plan, "b")
    assert (start, length, cached) == (8, 2, 8)  # (10 - 1) // 4 whole blocks
    assert plan.num_cached_tokens == 8 and plan.chunks[-1].num_cached == 8
    a_table = state.owned_blocks()["a"]
    assert table[:2] == a_table[:2] and table[2] != a_table[2]  # shared prefix, own tail
    assert state.pool.ref_count(table[0]) == 2 and state.pool.ref_count(a_table[2]) is None
    assert state.num_cached("b") == 8 and state.num_cached("a") == 0
    state, finished = run_to_end(state, config)
    assert {f.request_id: f.num_cached_tokens for f in finished} == {"a": 0, "b": 8}
    assert state.pool.num_in_use == 0 and state.pool.num_free == config.num_blocks


def test_block_aligned_fully_cached_prompt_recomputes_its_last_block():
    config = make_config()
    prompt = range(200, 208)  # exactly 2 blocks
    state = add_request(SchedulerState.empty(config), request("a", prompt, max_tokens=1))
    _, state, _ = step(state, config)  # "a" finishes; both blocks cached, unreferenced
    cached_blocks = state.pool.cached_free_blocks()
    assert len(cached_blocks) == 2 and state.pool.num_in_use == 0
    state = add_request(state, request("b", prompt, max_tokens=3))
    plan = schedule(state, config)
    start, length, cached, table = row(plan, "b")
    assert (start, length, cached) == (4, 4, 4)  # at most len - 1 tokens: the last block runs
    first_block = state.pool.cache.lookup(chain_hashes(tuple(prompt), BS)[0])
    last_block = state.pool.cache.lookup(chain_hashes(tuple(prompt), BS)[1])
    assert table[0] == first_block
    assert table[1] != last_block, "a cached block is never written"
    assert plan.state.pool.ref_count(last_block) == 0  # still cached, still evictable


def test_lru_eviction_order_and_no_eviction_of_referenced_blocks():
    config = make_config(num_blocks=6, max_num_batched_tokens=32)
    state = SchedulerState.empty(config)
    # three one-block prompts finishing in order a, b, c: their blocks become evictable in order
    for rid, base in (("a", 10), ("b", 20), ("c", 30)):
        state = add_request(state, request(rid, range(base, base + 5), max_tokens=1))
        _, state, _ = step(state, config)
    blocks = {rid: state.pool.cache.lookup(chain_hashes(tuple(range(b, b + 4)), BS)[0])
              for rid, b in (("a", 10), ("b", 20), ("c", 30))}
    assert state.pool.cached_free_blocks() == (blocks["a"], blocks["b"], blocks["c"])
    # a hit on "a" takes it out of the queue; it comes back last when released
    state = add_request(state, request("a2", range(10, 15), max_tokens=1))
    plan, state, _ = step(state, config)
    assert row(plan, "a2")[2] == 4
    assert state.pool.cached_free_blocks() == (blocks["b"], blocks["c"], blocks["a"])
    # a prompt needing every block: the fresh and free ones first, then b, then c (LRU order)
    assert state.pool.num_free == 6
    state = add_request(state, request("big", range(500, 520), max_tokens=1))
    plan = schedule(state, config)
    table = row(plan, "big")[3]
    assert len(table) == 5 and table[-2:] == (blocks["b"], blocks["c"])
    assert plan.state.pool.cached_free_blocks() == (blocks["a"],)
    assert plan.state.pool.cache.lookup(chain_hashes(tuple(range(20, 24)), BS)[0]) is None


def test_eviction_never_takes_a_referenced_block():
    config = make_config(num_blocks=4, max_num_batched_tokens=16)
    state = add_request(SchedulerState.empty(config), request("a", range(10, 19), max_tokens=5))
    _, state, _ = step(state, config)  # "a" holds 3 blocks, 2 of them cached (full)
    held = state.owned_blocks()["a"]
    assert state.pool.num_free == 1 and state.pool.num_cached_free == 0
    state = add_request(state, request("b", range(50, 53), max_tokens=1))
    plan = schedule(state, config)
    assert not set(row(plan, "b")[3]) & set(held)


@pytest.mark.parametrize("how", ["abort", "preempt", "finish"])
def test_released_blocks_stay_cached(how):
    config = make_config(num_blocks=5, max_num_batched_tokens=16)
    prompt = tuple(range(40, 49))  # 2 full blocks + 1
    state = add_request(SchedulerState.empty(config), request("a", prompt, max_tokens=6))
    _, state, _ = step(state, config)
    if how == "abort":
        state = abort(state, "a")
    elif how == "finish":
        _, state, _ = step(state, config, stop=("a",))
    else:  # a better-ranked sequence opening a block when none is free preempts "a"
        state = add_request(state, Request(request_id="vip", prompt_token_ids=tuple(range(7)),
                                           max_tokens=8, priority=-1))
        preempted = ()
        while not preempted:
            plan, state, _ = step(state, config)
            preempted = plan.preempted
        assert preempted == ("a",) and any(s.request_id == "a" for s in state.waiting)
    assert state.pool.num_in_use == (len(state.owned_blocks().get("vip", ())))
    digests = chain_hashes(prompt, BS)
    assert all(state.pool.ref_count(state.pool.cache.lookup(d)) == 0 for d in digests)
    if how != "preempt":
        state = add_request(state, request("again", prompt))
        plan = schedule(state, config)
        assert row(plan, "again")[2] == 8


def test_preempted_sequence_reports_its_first_admission_and_hits_its_own_blocks():
    config = make_config(num_blocks=6, max_num_batched_tokens=16, block_size=2, chunk_tile=2)
    prompt = (5, 6, 7)
    state = SchedulerState.empty(config)
    for rid in (0, 1):
        state = add_request(state, request(rid, prompt, max_tokens=8))
    finished, readmitted = [], []
    while state.has_work():
        pre = state
        plan, state, done = step(state, config)
        finished += done
        readmitted += [plan.num_cached[i] for i, rid in enumerate(plan.request_ids)
                       if rid == 1 and any(s.request_id == 1 for s in pre.waiting)]
    assert len(readmitted) >= 2 and readmitted[0] == 0 and readmitted[-1] > 0
    assert {f.request_id: f.num_cached_tokens for f in finished} == {0: 0, 1: 0}


def test_caching_off_keeps_the_plans_and_has_no_cache():
    requests = [request(i, range(100, 110)) for i in range(3)]
    plans = {}
    for caching in (False, True):
        config = make_config(enable_prefix_caching=caching, max_num_batched_tokens=12)
        state = SchedulerState.empty(config)
        out = []
        for i, r in enumerate(requests):
            state = add_request(state, dataclasses.replace(r, arrival_time=float(i)))
            plan, state, _ = step(state, config)
            out.append(list(zip(plan.request_ids, plan.starts, plan.lengths)))
        plans[caching] = out
        assert (state.pool.cache is None) == (not caching)
    assert plans[False] != plans[True]  # the third request hits the first one's blocks
    assert all(start == 0 for step_rows in plans[False] for rid, start, _ in step_rows
               if rid == step_rows[-1][0])


def test_config_field_is_validated_and_fixed():
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(enable_prefix_caching="yes")
    assert err.value.field == "enable_prefix_caching"
    config = make_config()
    state = SchedulerState.empty(config)
    with pytest.raises(ConfigError) as err:
        schedule(state, dataclasses.replace(config, enable_prefix_caching=False))
    assert err.value.field == "enable_prefix_caching"


def test_paged_array_updates_copy_only_touched_nodes():
    for length in (1, 63, 64, 65, 1000, 5000, 300_000):
        array = PagedArray.filled(length, 0)
        changes = [(0, 1), (length - 1, 2), (length // 2, 3)]
        updated = array.updated(changes)
        expected = {i: v for i, v in changes}
        for i in {0, length - 1, length // 2, length // 3, max(0, length - 2)}:
            assert updated[i] == expected.get(i, 0) and array[i] == 0
    assert array.updated([(5, 1), (5, 7)])[5] == 7
    shared = [a is b for a, b in zip(array.root, array.updated([(3, 1), (5, 2)]).root)]
    assert shared.count(False) == 1 and repr(array) == "PagedArray(length=300000)"


_PLAN_DIGEST = """
import hashlib, sys
from scheduler import Request, SchedulerConfig, SchedulerState, add_request, commit, schedule
config = SchedulerConfig(max_num_batched_tokens=32, chunk_tile=8, block_size=4, num_blocks=40)
state, digest = SchedulerState.empty(config), hashlib.sha256()
for i in range(12):
    prompt = tuple(range(100, 100 + 4 * (i % 3) + 5)) + (i,) * (i % 4)
    state = add_request(state, Request(request_id=f"r{i}", prompt_token_ids=prompt,
                                       max_tokens=3 + i % 5, arrival_time=float(i // 3)))
while state.has_work():
    plan = schedule(state, config)
    digest.update(repr((plan.request_ids, plan.starts, plan.lengths, plan.block_tables,
                        plan.num_cached, plan.preempted)).encode())
    state, _ = commit(plan.state, plan, [len(plan.request_ids)] * plan.num_sampled, 0.0)
print(digest.hexdigest())
"""


def test_plans_are_identical_across_processes():
    """Hosts running the same scheduler compare plan hashes: no per-process hash randomization
    may leak into a plan (string ids, digests, dict orders)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(root))
        out = subprocess.run([sys.executable, "-c", _PLAN_DIGEST], env=env, capture_output=True,
                             text=True, timeout=60, cwd=root)
        assert out.returncode == 0, out.stderr
        outs.add(out.stdout.strip())
    assert len(outs) == 1
