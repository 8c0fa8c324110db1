"""The LoRA slot constraint (scheduler/lora_slots.py) and adapter-keyed prefix caching.

Property tests drive random workloads whose requests use the base model or one of up to five
adapters, with 1 to 3 slots, serial and overlapped: every plan and state keeps every
invariant of tests/test_scheduler_properties.py (FCFS passes only sequences that wait for a
slot), running sequences never use more than `max_loras` adapters, no step holds more, every
request finishes within the liveness bound, and the ghost KV cache checks that every row reads
KV its own adapter computed (prompts share prefixes across adapters). Unit tests pin the
drain that keeps a slot-blocked request from starving, and the digests.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Request, RequestError, SchedulerConfig, SchedulerState
from scheduler import add_request, commit, schedule
from scheduler.lora_slots import SlotGate, adapter_counts
from scheduler.prefix import ROOT_DIGEST, chain_hashes, root_digest
from scheduler.request import Sequence
from support.scheduler_drivers import drive, drive_overlapped
from support.scheduler_workloads import HYPOTHESIS_SETTINGS, OVERLAP_MODES, workloads


def _bound(workload, preemptions: int) -> int:
    """tests/test_scheduler_properties.py's liveness bound: every step computes a token of
    some request while work exists (the slot constraint keeps its running sequences busy)."""
    return workload.last_arrival + 1 + workload.total_work + preemptions * workload.longest


@settings(max_examples=120, **HYPOTHESIS_SETTINGS)
@given(workloads(adapters=True, aborts=True))
def test_adapter_workloads_keep_every_invariant_and_the_slot_limit(workload):
    trace = drive(workload)
    if not workload.aborts:
        assert len(trace.steps) <= _bound(workload, trace.num_preempted)


@settings(max_examples=80, **HYPOTHESIS_SETTINGS)
@given(workloads(adapters=True, pressure=False, stops=False, max_requests=10, max_loras=1))
def test_one_slot_many_adapters_nobody_starves(workload):
    """One slot: adapters take turns; every request finishes within the liveness bound and
    no step mixes two adapters."""
    trace = drive(workload)
    assert trace.num_preempted == 0
    assert len(trace.steps) <= _bound(workload, 0)


@settings(max_examples=40, **HYPOTHESIS_SETTINGS)
@given(workloads(adapters=True, shared=True), OVERLAP_MODES)
def test_overlapped_adapter_workloads_equal_their_fake_model(workload, overlap):
    drive_overlapped(workload, overlap, [])


@settings(max_examples=25, **HYPOTHESIS_SETTINGS)
@given(workloads(adapters=True, max_requests=6))
def test_purity_with_adapters(workload):
    drive(workload, purity=True)


def _request(rid, adapter, n=20, max_tokens=4, arrival=0.0, prompt=None):
    return Request(request_id=rid, prompt_token_ids=prompt or tuple(range(3, 3 + n)),
                   max_tokens=max_tokens, arrival_time=arrival, adapter=adapter)


def _config(**over):
    return SchedulerConfig(**{**dict(policy="token_budget", chunk_tile=4,
                                     max_num_batched_tokens=64, max_num_seqs=8, block_size=4,
                                     num_blocks=200, max_loras=1), **over})


def _run(state, config, steps, arrivals=()):
    """Steps the scheduler `steps` times (fake tokens), adding `arrivals[i]` before step i.
    Returns the state and, per step, the request ids it ran."""
    ran = []
    for step in range(steps):
        for request in arrivals[step] if step < len(arrivals) else ():
            state = add_request(state, request)
        plan = schedule(state, config)
        ran.append(plan.request_ids)
        tokens = [7] * plan.num_sampled
        state, _ = commit(plan.state, plan, tokens, float(step))
    return state, ran


def test_a_slot_blocked_request_is_passed_then_served_by_a_drain():
    """max_loras=2, adapters 0 (two running) and 2 (one running) hold the slots: a request of
    adapter 1 waits for a slot while later requests of adapter 0 and of the base model are
    admitted past it; adapter 2 (fewest running) drains: its new requests are held back
    until its running one finishes, and adapter 1 then takes its slot although adapter 2's
    requests keep arriving every step."""
    config = _config(max_loras=2)
    state = SchedulerState.empty(config)
    for rid, adapter in (("a0", 0), ("a0b", 0), ("c0", 2)):
        state = add_request(state, _request(rid, adapter, max_tokens=6))
    state, _ = _run(state, config, 1)
    state = add_request(state, _request("b", 1, arrival=1.0))
    state = add_request(state, _request("a1", 0, arrival=1.0))
    state = add_request(state, _request("c1", 2, arrival=1.0))
    state = add_request(state, _request("base", None, arrival=1.0))
    plan = schedule(state, config)
    assert {"a1", "base"} <= set(plan.request_ids)
    assert not {"b", "c1"} & set(plan.request_ids)
    assert plan.engaged.lora_deferred == 2
    assert plan.state.lora_drain == 2
    assert [s.request_id for s in plan.state.waiting] == ["b", "c1"]
    state, _ = commit(plan.state, plan, [7] * plan.num_sampled, 1.0)
    arrivals = [[_request(f"late{i}", 2, arrival=2.0 + i)] for i in range(30)]
    state, ran = _run(state, config, 30, arrivals)
    first_b = next(i for i, ids in enumerate(ran) if "b" in ids)
    assert not any(rid.startswith("late") or rid == "c1" for ids in ran[:first_b]
                   for rid in ids), "the draining adapter was admitted before b"
    assert "c0" not in {rid for ids in ran[first_b:] for rid in ids}
    state, _ = _run(state, config, 60)
    assert not state.has_work(), "a request never finished"


def test_the_drain_ends_when_nobody_waits_for_a_slot():
    """A drain whose slot-blocked request is aborted ends at the next admission pass: the
    draining adapter's waiting requests are admitted again."""
    from scheduler import abort

    config = _config()
    state = add_request(SchedulerState.empty(config), _request("a0", 0, max_tokens=20))
    state, _ = _run(state, config, 1)
    state = add_request(state, _request("b", 1))
    state, _ = _run(state, config, 1)
    assert state.lora_drain == 0
    state = abort(add_request(state, _request("a1", 0, arrival=2.0)), "b")
    plan = schedule(state, config)
    assert "a1" in plan.request_ids and plan.state.lora_drain is None


def test_slot_gate_unit():
    """The gate's rules one by one: resident and base pass, a free slot is taken, a full
    set blocks and picks the adapter with the fewest running sequences to drain."""
    def seq(adapter, rid=0):
        return Sequence(request=_request(rid, adapter), key=(0, 0.0, rid), tokens=(1,))

    running = [seq(5), seq(5), seq(6)]
    assert adapter_counts(running) == {5: 2, 6: 1}
    gate = SlotGate(2, running, (), None)
    assert gate.admits(seq(None)) and gate.admits(seq(5)) and gate.admits(seq(6))
    assert not gate.admits(seq(7)) and gate.drain == 6 and gate.deferred == 1
    assert not gate.admits(seq(6)) and gate.deferred == 2  # draining: held back
    assert gate.admits(seq(5))
    gate = SlotGate(3, running, (), None)
    assert gate.admits(seq(7))
    gate.admitted(seq(7))
    assert not gate.admits(seq(8)) and gate.drain in (6, 7)
    # a stale drain (its adapter no longer runs, or nobody is blocked) is dropped
    assert SlotGate(2, running, (seq(9),), 4).drain is None
    assert SlotGate(2, running, (seq(5),), 6).drain is None
    assert SlotGate(2, running, (seq(9),), 6).drain == 6


def test_two_adapters_never_share_prefix_blocks():
    """The same prompt under adapter 1, adapter 2 and the base model: no hit across them;
    the same adapter again hits its own blocks."""
    config = _config(max_loras=3)
    prompt = tuple(range(10, 30))  # 5 full blocks of 4
    state = SchedulerState.empty(config)
    cached = {}
    for i, adapter in enumerate([1, 2, None, 1]):
        state = add_request(state, _request(f"r{i}", adapter, prompt=prompt, arrival=float(i)))
        plan = schedule(state, config)
        cached[i] = plan.num_cached_tokens
        state, _ = commit(plan.state, plan, [7] * plan.num_sampled, float(i))
        for _ in range(5):
            plan = schedule(state, config)
            if plan.is_empty:
                break
            state, _ = commit(plan.state, plan, [7] * plan.num_sampled, float(i))
    assert cached == {0: 0, 1: 0, 2: 0, 3: 16}
    roots = {root_digest(a) for a in (None, 1, 2)}
    assert len(roots) == 3 and root_digest(None) == ROOT_DIGEST
    assert chain_hashes(prompt, 4, root_digest(1)) != chain_hashes(prompt, 4)


@pytest.mark.parametrize("adapter", [-1, True, 1.5, "a"])
def test_bad_adapter_is_a_typed_error(adapter):
    with pytest.raises(RequestError) as e:
        add_request(SchedulerState.empty(_config()), _request("x", adapter))
    assert e.value.field == "adapter"


def test_max_loras_is_part_of_the_geometry():
    config = _config(max_loras=2)
    state = SchedulerState.empty(config)
    with pytest.raises(Exception) as e:
        schedule(state, dataclasses.replace(config, max_loras=3))
    assert e.value.field == "max_loras"
    with pytest.raises(Exception) as e:
        _config(max_loras=0)
    assert e.value.field == "max_loras"


@settings(max_examples=30, **HYPOTHESIS_SETTINGS)
@given(st.integers(1, 3), st.integers(2, 6), st.integers(8, 30))
def test_many_adapters_few_slots_all_finish_with_their_own_adapter(max_loras, adapters, count):
    """More adapters than slots, requests round-robin over them, all at once: each finishes,
    and no step runs more adapters than slots (drive checks every step)."""
    from support.scheduler_workloads import Workload

    config = _config(max_loras=max_loras, max_num_seqs=6)
    requests = tuple(_request(i, i % adapters, n=5 + i % 7, max_tokens=1 + i % 5)
                     for i in range(count))
    workload = Workload(config=config, requests=requests, stop_after=(None,) * count)
    trace = drive(workload)
    assert len(trace.outputs) == count
    assert len(trace.steps) <= _bound(workload, trace.num_preempted)
