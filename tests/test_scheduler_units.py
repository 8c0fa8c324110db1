"""Unit tests of the scheduler's entry points: config, errors, abort, commit, and worked examples."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import sys

import pytest

from scheduler import (CommitError, ConfigError, DuplicateRequestError, Request, RequestError,
                       RequestTooLargeError, SchedulerConfig, SchedulerState, StepOrderError,
                       UnknownRequestError, abort, add_request, commit, schedule)
from scheduler.blocks import BlockPool


def make_config(**overrides) -> SchedulerConfig:
    """The worked examples' config. Their requests share prompts (make_request), so prefix
    caching is off here: these examples pin the policies (and, so, the plans without caching);
    the prefix-cache tests turn it on."""
    values = dict(max_num_batched_tokens=64, chunk_tile=16, block_size=4, num_blocks=64,
                  max_num_seqs=8, enable_prefix_caching=False)
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(rid, prompt_len=10, max_tokens=4, arrival=0.0, priority=0) -> Request:
    return Request(request_id=rid, prompt_token_ids=tuple(range(1, prompt_len + 1)),
                   max_tokens=max_tokens, arrival_time=arrival, priority=priority)


def make_state(config, *requests) -> SchedulerState:
    state = SchedulerState.empty(config)
    for request in requests:
        state = add_request(state, request)
    return state


def step(state, config, token=7, stop=()):
    """One schedule + commit; returns (plan, state, finished)."""
    plan = schedule(state, config)
    new_state, finished = commit(plan.state, plan, [token] * plan.num_sampled, 1.0, stop)
    return plan, new_state, finished


def rows(plan):
    return list(zip(plan.request_ids, plan.starts, plan.lengths, plan.samples))


# ---- config ----------------------------------------------------------------------------------

def test_config_defaults():
    config = SchedulerConfig()
    assert config.policy == "token_budget"
    assert config.max_num_batched_tokens == 2048 and config.chunk_tile == 128
    assert config.prefill_max_seqs == 0 and config.prefill_floor_steps == 0


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        SchedulerConfig("token_budget")  # noqa
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().policy = "alternate"


@pytest.mark.parametrize("field,value", [
    ("policy", "round_robin"), ("max_num_batched_tokens", 0), ("max_num_seqs", 0),
    ("prefill_max_seqs", -1), ("prefill_floor_steps", -2), ("chunk_tile", 0),
    ("long_prefill_token_threshold", -1), ("max_num_partial_prefills", 0), ("block_size", 0),
    ("num_blocks", 0), ("watermark_blocks", -1), ("max_num_seqs", True), ("block_size", 2.0),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**{field: value})
    assert err.value.field == field and field in str(err.value)
    assert isinstance(err.value, ValueError)


def test_config_cross_field_rules():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=100, chunk_tile=128)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=64, chunk_tile=128)
    with pytest.raises(ConfigError, match="watermark_blocks"):
        SchedulerConfig(num_blocks=4, watermark_blocks=4)


def test_from_env_reads_both_variables(monkeypatch):
    monkeypatch.setenv("ARC_PREFILL_MAX_SEQS", "4")
    monkeypatch.setenv("ARC_PREFILL_FLOOR_STEPS", " 2 ")
    config = SchedulerConfig.from_env(policy="prefill_first")
    assert (config.policy, config.prefill_max_seqs, config.prefill_floor_steps) == (
        "prefill_first", 4, 2)


def test_from_env_unset_or_empty_keeps_defaults(monkeypatch):
    monkeypatch.delenv("ARC_PREFILL_MAX_SEQS", raising=False)
    monkeypatch.setenv("ARC_PREFILL_FLOOR_STEPS", "")
    assert SchedulerConfig.from_env() == SchedulerConfig()


def test_from_env_explicit_overrides_win(monkeypatch):
    monkeypatch.setenv("ARC_PREFILL_MAX_SEQS", "4")
    assert SchedulerConfig.from_env(prefill_max_seqs=0).prefill_max_seqs == 0


@pytest.mark.parametrize("name,value,field", [
    ("ARC_PREFILL_MAX_SEQS", "four", "prefill_max_seqs"),
    ("ARC_PREFILL_FLOOR_STEPS", "1.5", "prefill_floor_steps"),
    ("ARC_PREFILL_MAX_SEQS", "-3", "prefill_max_seqs"),
])
def test_from_env_rejects_bad_values(monkeypatch, name, value, field):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        SchedulerConfig.from_env()
    assert err.value.field == field


# ---- add_request -----------------------------------------------------------------------------

@pytest.mark.parametrize("request_,field", [
    (Request(request_id=1, prompt_token_ids=(), max_tokens=3), "prompt_token_ids"),
    (Request(request_id=1, prompt_token_ids=(1, 2), max_tokens=0), "max_tokens"),
    (Request(request_id=1, prompt_token_ids=(1, -2), max_tokens=3), "prompt_token_ids"),
    (Request(request_id=1, prompt_token_ids=(1, 2), max_tokens=3, priority=0.5), "priority"),
    (Request(request_id=[1], prompt_token_ids=(1, 2), max_tokens=3), "request_id"),
])
def test_add_request_rejects_bad_requests(request_, field):
    state = make_state(make_config(), make_request("other"))
    with pytest.raises(RequestError) as err:
        add_request(state, request_)
    assert err.value.field == field and isinstance(err.value, ValueError)


def test_add_request_refuses_what_can_never_fit():
    config = make_config(block_size=4, num_blocks=10, watermark_blocks=2)
    limit = config.max_request_tokens  # (10 - 2) * 4 + 1 = 33
    assert limit == 33
    state = SchedulerState.empty(config)
    fits = add_request(state, make_request("a", prompt_len=20, max_tokens=limit - 20))
    assert len(fits.waiting) == 1
    with pytest.raises(RequestTooLargeError) as err:
        add_request(state, make_request("b", prompt_len=20, max_tokens=limit - 19))
    assert err.value.field == "max_tokens" and err.value.limit == limit
    assert str(limit) in str(err.value)


def test_add_request_refuses_duplicates_waiting_or_running():
    config = make_config()
    state = make_state(config, make_request("a"))
    with pytest.raises(DuplicateRequestError):
        add_request(state, make_request("a"))
    _, state, _ = step(state, config)  # "a" is running now
    assert not state.waiting
    with pytest.raises(DuplicateRequestError):
        add_request(state, make_request("a"))


def test_failed_add_leaves_state_untouched():
    state = make_state(make_config(), make_request("a"))
    before = state
    with pytest.raises(RequestError):
        add_request(state, make_request("a"))
    assert state == before


def test_add_request_orders_by_priority_then_arrival():
    state = make_state(make_config(), make_request("late", arrival=2.0),
                       make_request("early", arrival=1.0), make_request("urgent", arrival=3.0,
                                                                        priority=-1))
    assert [s.request_id for s in state.waiting] == ["urgent", "early", "late"]


# ---- abort -----------------------------------------------------------------------------------

def test_abort_waiting_partial_and_decoding_free_blocks():
    config = make_config(max_num_batched_tokens=32, chunk_tile=16, num_blocks=40)
    state = make_state(config, make_request("dec", prompt_len=8), make_request("mid", prompt_len=40),
                       make_request("wait", prompt_len=40))
    _, state, _ = step(state, config)  # dec prefilled whole; mid gets a 16-token chunk; wait
    # stays out (a second partial prefill is over max_num_partial_prefills)
    assert state.decoding.ids == ("dec",) and [p.seq.request_id for p in state.partial] == ["mid"]
    assert [s.request_id for s in state.waiting] == ["wait"]
    for rid in ("wait", "mid", "dec"):
        state = abort(state, rid)
    assert not state.has_work() and state.pool.num_free == config.num_blocks


def test_abort_unknown_id_raises_key_error():
    state = make_state(make_config(), make_request("a"))
    with pytest.raises(UnknownRequestError) as err:
        abort(state, "nope")
    assert isinstance(err.value, KeyError) and "nope" in str(err.value)


def test_abort_between_schedule_and_commit_skips_the_rows():
    config = make_config()
    state = make_state(config, make_request("a"), make_request("b"))
    plan = schedule(state, config)
    after = abort(plan.state, "a")
    state, finished = commit(after, plan, [5] * plan.num_sampled, 1.0)
    assert state.decoding.ids == ("b",) and not finished
    check = state.pool.num_free + sum(len(t) for t in state.decoding.tables)
    assert check == config.num_blocks


# ---- commit ----------------------------------------------------------------------------------

def test_commit_finishes_on_length_and_on_stop():
    config = make_config()
    state = make_state(config, make_request("long", max_tokens=3), make_request("stopper"))
    plan, state, finished = step(state, config, token=11)
    assert not finished
    plan, state, finished = step(state, config, token=12, stop=("stopper",))
    assert [(f.request_id, f.output_token_ids, f.reason) for f in finished] == [
        ("stopper", (11, 12), "stop")]
    plan, state, finished = step(state, config, token=13)
    assert [(f.request_id, f.output_token_ids, f.reason) for f in finished] == [
        ("long", (11, 12, 13), "length")]
    assert finished[0].finish_time == 1.0
    assert state.pool.num_free == config.num_blocks


def test_max_tokens_one_finishes_on_the_final_prefill_chunk():
    config = make_config()
    state = make_state(config, make_request("a", max_tokens=1))
    plan, state, finished = step(state, config, token=9)
    assert [(f.request_id, f.output_token_ids) for f in finished] == [("a", (9,))]
    assert not state.has_work()


def test_commit_rejects_wrong_token_count_and_strangers():
    config = make_config()
    state = make_state(config, make_request("a", prompt_len=100), make_request("b"))
    plan = schedule(state, config)
    with pytest.raises(CommitError, match="sampled_token_ids"):
        commit(plan.state, plan, [1] * (plan.num_sampled + 1), 0.0)
    non_sampling = [rid for rid, s in zip(plan.request_ids, plan.samples) if not s]
    assert non_sampling == ["a"]
    with pytest.raises(CommitError, match="finished_ids"):
        commit(plan.state, plan, [1] * plan.num_sampled, 0.0, finished_ids=["a"])


def test_schedule_and_commit_out_of_order():
    config = make_config()
    state = make_state(config, make_request("a"))
    plan = schedule(state, config)
    with pytest.raises(StepOrderError):
        schedule(plan.state, config)  # the plan in flight was never committed
    committed, _ = commit(plan.state, plan, [1] * plan.num_sampled, 0.0)
    with pytest.raises(StepOrderError):
        commit(committed, plan, [1] * plan.num_sampled, 0.0)  # committed twice


def test_empty_plan_leaves_nothing_in_flight():
    config = make_config()
    plan = schedule(SchedulerState.empty(config), config)
    assert plan.is_empty and not plan.state.in_flight and plan.kind == "idle"
    schedule(plan.state, config)
    state, finished = commit(plan.state, plan, [], 0.0)
    assert state is plan.state and finished == ()


def test_schedule_refuses_another_cache():
    config = make_config()
    state = make_state(config, make_request("a"))
    with pytest.raises(ConfigError):
        schedule(state, dataclasses.replace(config, num_blocks=128))
    schedule(state, dataclasses.replace(config, policy="alternate"))  # knobs may change


# ---- the policies on worked examples ---------------------------------------------------------

def test_prefill_first_admits_whole_prompts_then_decodes():
    config = make_config(policy="prefill_first", max_num_batched_tokens=32)
    state = make_state(config, *(make_request(i, prompt_len=10) for i in range(4)))
    plan, state, _ = step(state, config)
    assert rows(plan) == [(0, 0, 10, True), (1, 0, 10, True), (2, 0, 10, True)]
    assert plan.kind == "prompt" and plan.engaged.budget_full_at == 30
    plan, state, _ = step(state, config)
    assert rows(plan) == [(3, 0, 10, True)] and plan.kind == "prompt"
    plan, state, _ = step(state, config)
    assert plan.kind == "decode" and plan.request_ids == (0, 1, 2, 3)


def test_prefill_first_lone_prompt_longer_than_budget_runs_alone():
    config = make_config(policy="prefill_first", max_num_batched_tokens=16, chunk_tile=16)
    state = make_state(config, make_request("big", prompt_len=50), make_request("small", 5))
    plan, state, _ = step(state, config)
    assert rows(plan) == [("big", 0, 50, True)] and plan.engaged.oversize_prompt
    plan, state, _ = step(state, config)
    assert rows(plan) == [("small", 0, 5, True)] and not plan.engaged.oversize_prompt


def test_token_budget_mixes_decodes_and_tile_aligned_chunks():
    config = make_config(max_num_batched_tokens=64, chunk_tile=16, num_blocks=128)
    state = make_state(config, make_request("a", prompt_len=5))
    _, state, _ = step(state, config)  # "a" decodes from now on
    state = add_request(state, make_request("b", prompt_len=150, arrival=1.0))
    plan, state, _ = step(state, config)
    # 1 decode + a 63-token hole: the chunk is cut to 48, a tile multiple, never 63
    assert rows(plan) == [("a", 5, 1, True), ("b", 0, 48, False)]
    assert plan.kind == "mixed" and plan.engaged.tile_trimmed == 1
    assert plan.token_ids == (7,) + tuple(range(1, 49))
    plan, state, _ = step(state, config)
    assert rows(plan) == [("a", 6, 1, True), ("b", 48, 48, False)]
    plan, state, _ = step(state, config)
    assert rows(plan) == [("a", 7, 1, True), ("b", 96, 54, True)]  # final chunk: any length


def test_long_prefill_threshold_and_partial_limit():
    config = make_config(max_num_batched_tokens=64, chunk_tile=16, long_prefill_token_threshold=32,
                         max_num_partial_prefills=1, num_blocks=128)
    state = make_state(config, make_request("a", prompt_len=100), make_request("b", prompt_len=100))
    plan, state, _ = step(state, config)
    assert rows(plan) == [("a", 0, 32, False)]
    assert plan.engaged.long_prefill_capped == 1 and plan.engaged.partial_limit


def test_cap_and_floor_engage_and_are_reported():
    config = make_config(prefill_max_seqs=1, prefill_floor_steps=2)
    state = make_state(config, make_request("a", 5), make_request("b", 5), make_request("c", 5))
    plan, state, _ = step(state, config)
    assert plan.request_ids == ("a",) and plan.engaged.cap_deferred == 2
    plan, state, _ = step(state, config)
    assert plan.request_ids == ("a",) and plan.engaged.floor_held
    plan, state, _ = step(state, config)
    assert plan.request_ids == ("a",) and plan.engaged.floor_held
    plan, state, _ = step(state, config)
    assert plan.request_ids == ("a", "b") and plan.engaged.cap_deferred == 1
    assert set(plan.engaged.active()) == {"cap_deferred"}
    json.dumps(plan.engaged.as_dict())


def test_alternate_alternates():
    config = make_config(policy="alternate", max_num_batched_tokens=16, chunk_tile=16)
    state = make_state(config, make_request("a", 10), make_request("b", 40))
    kinds = []
    for _ in range(6):
        plan, state, _ = step(state, config)
        kinds.append(plan.kind)
    assert kinds == ["prompt", "decode", "prompt", "decode", "prompt", "decode"]


def test_watermark_keeps_blocks_free_for_admissions():
    config = make_config(block_size=4, num_blocks=10, watermark_blocks=3, max_num_batched_tokens=64)
    state = make_state(config, make_request("a", prompt_len=16, max_tokens=2),
                       make_request("b", prompt_len=16, max_tokens=2))
    plan, state, _ = step(state, config)
    assert plan.request_ids == ("a",) and plan.engaged.block_limited  # b would leave 2 < 3 free


def test_preemption_prefers_the_lowest_priority():
    config = make_config(max_num_batched_tokens=64, block_size=2, num_blocks=8, chunk_tile=16)
    state = make_state(config, make_request("vip", prompt_len=4, max_tokens=10, priority=0),
                       make_request("low", prompt_len=4, max_tokens=10, priority=5, arrival=-1.0))
    preempted = []
    for _ in range(8):
        plan, state, _ = step(state, config)
        preempted += plan.preempted
    assert preempted and set(preempted) == {"low"}


def test_block_pool_take_give():
    pool = BlockPool.full(6)
    first, pool = pool.take(2)
    assert first == (0, 1) and pool.num_free == 4
    pool = pool.give(first)
    again, pool = pool.take(3)
    assert again == (0, 1, 2) and pool.free_blocks() == (3, 4, 5)


def test_scheduler_imports_only_the_standard_library_and_no_clock_or_randomness():
    allowed = set(sys.stdlib_module_names) - {"time", "random", "secrets", "datetime", "socket",
                                              "threading", "asyncio", "uuid"}
    package = pathlib.Path(__file__).resolve().parents[1] / "scheduler"
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                assert top in allowed | {"scheduler", "__future__"}, f"{path.name} imports {module}"
        if path.name != "scheduler_config.py":  # from_env is the one reader of the environment
            assert "os.environ" not in path.read_text() and "getenv" not in path.read_text()


def test_decode_only_and_kind():
    config = make_config()
    state = make_state(config, make_request("a", prompt_len=5))
    plan, state, _ = step(state, config)
    assert plan.kind == "prompt" and not plan.decode_only
    plan, state, _ = step(state, config)
    assert plan.kind == "decode" and plan.decode_only
    assert not schedule(SchedulerState.empty(config), config).decode_only  # empty


def _long_run(num_generated: int):
    """A state whose one sequence generated `num_generated` tokens, after 3,000 short requests
    each freed their blocks; returns (state, plan of the next step)."""
    config = SchedulerConfig(max_num_batched_tokens=256, chunk_tile=16, block_size=16,
                             num_blocks=2048, max_num_seqs=256)
    state = SchedulerState.empty(config)
    for i in range(3000):
        state = add_request(state, make_request(f"short{i}", prompt_len=1 + i % 40, max_tokens=2))
    state = add_request(state, make_request("long", prompt_len=5, max_tokens=num_generated + 5))
    while len(state.decoding) != 1 or state.waiting:
        _, state, _ = step(state, config)
    for i in range(num_generated - 1):
        plan = schedule(state, config)
        state, _ = commit(plan.state, plan, (i % 1000,), 1.0)
    return state, schedule(state, config)


def test_long_sequences_pickle_print_compare_and_deepcopy():
    """No cons lists: 20,000 generated tokens and thousands of freed tables stay shallow."""
    import copy
    import pickle

    state, plan = _long_run(20_000)
    assert len(state.decoding.generated(0)) > 20_000
    assert state.decoding.outputs(0)[-3:] == (996, 997, 998)
    for value in (state, plan):
        assert pickle.loads(pickle.dumps(value)) == value
        assert copy.deepcopy(value) == value
        assert repr(value)
    again, again_plan = _long_run(20_000)
    assert again == state and again is not state and again_plan == plan
    assert plan.token_ids == (998,)


def test_block_pool_stays_shallow_after_many_gives():
    import copy
    import pickle

    pool = BlockPool.full(20_000)
    tables = []
    for _ in range(10_000):
        table, pool = pool.take(2)
        tables.append(table)
    for table in tables:
        pool = pool.give(table)
    assert pool.num_free == 20_000 and len(pool.freed) <= 64
    assert pickle.loads(pickle.dumps(pool)) == pool and copy.deepcopy(pool) == pool
    # pop order is unchanged by merging: newest table first
    first, pool = pool.take(3)
    assert first == tables[-1] + tables[-2][:1]
