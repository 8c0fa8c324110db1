"""KV cache groups in the planner (scheduler/kv_groups.py): one block table per attention type
over one pool, sliding groups releasing what fell out of their window, vLLM's prefix-hit rule.

The harness (`drive_groups`, tests/support/kv_group_drivers.py) runs random workloads (the
factories of tests/support/scheduler_workloads.py, given random group windows) serially or
with random overlapped steps, aborts and draft tokens, and checks after every call,
independently of the planner:

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
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import ConfigError, Request, RequestTooLargeError, SchedulerConfig, SchedulerState
from scheduler import add_request, blocks_for, commit, schedule
from scheduler.kv_groups import find_hits, group_tables, slid_groups
from scheduler.prefix import chain_hashes, group_key
from scheduler.scheduler_config import peak_blocks
from scheduler.window import first_needed
from support.kv_group_drivers import drive_groups, group_workloads
from support.scheduler_workloads import HYPOTHESIS_SETTINGS, drafter, fake_token

_OVERLAP = st.lists(st.booleans(), min_size=1, max_size=4)


# ---- properties -------------------------------------------------------------------------------

@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(group_workloads(aborts=True))
def test_hybrid_groups_keep_every_invariant(workload):
    drive_groups(workload)


@settings(max_examples=25, **HYPOTHESIS_SETTINGS)
@given(group_workloads(shared=True), _OVERLAP, st.data())
def test_hybrid_groups_overlapped_with_drafts_and_aborts(workload, overlap, data):
    points = data.draw(st.lists(st.tuples(
        st.integers(0, 40), st.integers(0, len(workload.requests) - 1), st.integers(0, 2)),
        max_size=3))
    seed = data.draw(st.integers(0, 99))
    propose = drafter(seed, fake_token) if data.draw(st.booleans()) else None
    drive_groups(workload, overlap=overlap, abort_points=points, propose=propose)


@settings(max_examples=25, **HYPOTHESIS_SETTINGS)
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


@settings(max_examples=20, **HYPOTHESIS_SETTINGS)
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
