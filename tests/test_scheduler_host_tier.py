"""The host-memory KV tier in the planner (scheduler/host_tier.py): evicted prefix blocks move
to host slots instead of vanishing, and prefix hits on them are loaded back while the
requests that need them wait one step.

The property tests drive random workloads with shared prefixes, tight device pools, small host
tiers, aborts and overlapped steps through `drive_groups` (tests/support/kv_group_drivers.py), whose
ghost moves block contents exactly as the runner does (a plan's stores before its step, its
loads after it): a block read before its load landed, a slot overwritten while a load of the
same plan reads it, a stored block that does not hold its key's tokens, or a block shared
wrongly fails there. Here: outputs with the tier equal outputs without it, and units for the
moves, the wait, pinning, LRU order and the configuration.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import ConfigError, Request, SchedulerConfig, SchedulerState
from scheduler import add_request, commit, forget_prefix_cache, schedule
from scheduler.host_tier import HostTier
from support.kv_group_drivers import GROUP_WINDOWS, drive_groups, group_workloads
from support.scheduler_workloads import HYPOTHESIS_SETTINGS, drafter, fake_token

ANY_GROUPS = GROUP_WINDOWS | st.just(())


@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(group_workloads(host=True, tight=True, shared=True, aborts=True, groups=ANY_GROUPS,
                       max_requests=12))
def test_random_evictions_loads_and_aborts_move_every_block_right(workload):
    drive_groups(workload)


@settings(max_examples=25, **HYPOTHESIS_SETTINGS)
@given(group_workloads(host=True, tight=True, shared=True, groups=ANY_GROUPS),
       st.lists(st.booleans(), min_size=1, max_size=4), st.data())
def test_host_tier_under_overlapped_steps_drafts_and_aborts(workload, overlap, data):
    points = data.draw(st.lists(st.tuples(
        st.integers(0, 40), st.integers(0, len(workload.requests) - 1), st.integers(0, 2)),
        max_size=3))
    seed = data.draw(st.integers(0, 99))
    propose = drafter(seed, fake_token) if data.draw(st.booleans()) else None
    drive_groups(workload, overlap=overlap, abort_points=points, propose=propose)


@settings(max_examples=20, **HYPOTHESIS_SETTINGS)
@given(group_workloads(host=True, tight=True, shared=True, groups=ANY_GROUPS))
def test_outputs_with_the_host_tier_equal_outputs_without_it(workload):
    without = dataclasses.replace(workload.config, num_host_blocks=0)
    assert drive_groups(workload).outputs == drive_groups(
        dataclasses.replace(workload, config=without)).outputs


# ---- units -------------------------------------------------------------------------------------

def _config(**kw) -> SchedulerConfig:
    values = dict(block_size=4, num_blocks=8, chunk_tile=4, max_num_batched_tokens=64,
                  num_host_blocks=16, max_num_partial_prefills=4)
    return SchedulerConfig(**(values | kw))


def _step(state, config, token=7):
    plan = schedule(state, config)
    state, done = commit(plan.state, plan, [token] * plan.num_sampled, 0.0)
    return plan, state, done


def _run(state, config):
    plans = []
    while state.has_work():
        plan, state, _ = _step(state, config)
        plans.append(plan)
    return plans, state


def test_an_evicted_prefix_comes_back_from_the_host_and_its_request_waits_one_step():
    config = _config()
    history = tuple(range(100, 113))  # 13 tokens: 3 full blocks
    state = add_request(SchedulerState.empty(config),
                        Request(request_id="turn1", prompt_token_ids=history, max_tokens=1))
    plans, state = _run(state, config)
    assert state.pool.num_cached_free == 3
    # another conversation needs every device block: the first one's blocks are evicted
    state = add_request(state, Request(request_id="other", prompt_token_ids=tuple(range(31)),
                                       max_tokens=1))
    plans, state = _run(state, config)
    stores = [s for p in plans for s in p.kv_stores]
    assert len(stores) == 3 and len({slot for _, slot in stores}) == 3
    assert state.pool.host.num_stored == 3 and state.pool.num_cached_free == 7
    # the conversation returns: its three blocks are loaded, it runs in the next step
    state = add_request(state, Request(request_id="turn2", prompt_token_ids=history + (5, 6),
                                       max_tokens=2))
    plan, state, _ = _step(state, config)
    assert plan.loading == ("turn2",) and plan.request_ids == () and plan.moves_only
    # evicted last block first (a released table joins the LRU queue tail first), loaded in
    # table order
    assert [slot for slot, _ in plan.kv_loads] == [slot for _, slot in reversed(stores)]
    assert not plan.is_empty and plan.state.in_flight
    loaded = tuple(block for _, block in plan.kv_loads)
    assert state.partial[0].table[:3] == loaded and state.partial[0].computed == 12
    plan, state, _ = _step(state, config)
    assert plan.request_ids == ("turn2",) and plan.starts == (12,) and plan.lengths == (3,)
    assert plan.num_cached == (12,) and plan.block_tables[0][:3] == loaded
    _, state = _run(state, config)
    assert state.pool.num_in_use == 0


def test_a_second_request_sharing_a_block_being_loaded_waits_with_it():
    config = _config()
    history = tuple(range(100, 109))  # 2 full blocks
    state = add_request(SchedulerState.empty(config),
                        Request(request_id="a", prompt_token_ids=history, max_tokens=1))
    _, state = _run(state, config)
    state = add_request(state, Request(request_id="x", prompt_token_ids=tuple(range(31)),
                                       max_tokens=1))
    _, state = _run(state, config)
    for rid in ("b", "c"):
        state = add_request(state, Request(request_id=rid, prompt_token_ids=history + (1,),
                                           max_tokens=1))
    plan, state, _ = _step(state, config)
    assert plan.loading == ("b", "c") and len(plan.kv_loads) == 2
    tables = {p.seq.request_id: p.table for p in state.partial}
    assert tables["b"] == tables["c"] == tuple(block for _, block in plan.kv_loads)
    assert all(plan.state.pool.ref_count(b) == 2 for b in tables["b"])
    plan, state, _ = _step(state, config)
    assert plan.request_ids == ("b", "c") and plan.starts == (8, 8)


def test_a_host_slot_being_loaded_is_never_the_target_of_a_store():
    tier = HostTier.empty(1)
    slot, tier = tier.stored(b"k1")
    assert slot == 0 and tier.lookup(b"k1") == 0
    pinned = tier.pinned([0])
    assert pinned.stored(b"k2") == (None, pinned)  # dropped: the only slot is being loaded
    slot, tier = pinned.unpinned([0]).stored(b"k2")
    assert slot == 0 and tier.lookup(b"k1") is None and tier.lookup(b"k2") == 0


def test_host_slots_are_reused_least_recently_used_first():
    tier = HostTier.empty(2)
    _, tier = tier.stored(b"k1")
    _, tier = tier.stored(b"k2")
    slot, tier = tier.stored(b"k1")  # already on the host: no copy, most recently used now
    assert slot is None
    slot, tier = tier.stored(b"k3")
    assert slot == 1 and tier.lookup(b"k2") is None and tier.lookup(b"k1") == 0
    slot, tier = tier.unpinned([]).pinned([0]).unpinned([0]).stored(b"k4")  # a load touches
    assert slot == 1 and tier.keys() == {0: b"k1", 1: b"k4"}


def test_forgetting_the_prefix_cache_forgets_the_host_tier():
    config = _config()
    state = add_request(SchedulerState.empty(config),
                        Request(request_id="a", prompt_token_ids=tuple(range(13)), max_tokens=1))
    _, state = _run(state, config)
    state = add_request(state, Request(request_id="b", prompt_token_ids=tuple(range(50, 81)),
                                       max_tokens=1))
    _, state = _run(state, config)
    assert state.pool.host.num_stored
    fresh = forget_prefix_cache(state)
    assert fresh.pool.host.num_stored == 0 and fresh.pool.host.num_slots == 16


def test_host_tier_config():
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(num_host_blocks=4, enable_prefix_caching=False)
    assert err.value.field == "num_host_blocks"
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(num_host_blocks=-1)
    assert err.value.field == "num_host_blocks"
    config = _config()
    with pytest.raises(ConfigError) as err:
        schedule(SchedulerState.empty(config), dataclasses.replace(config, num_host_blocks=8))
    assert err.value.field == "num_host_blocks"
    assert SchedulerState.empty(_config(num_host_blocks=0)).pool.host is None
