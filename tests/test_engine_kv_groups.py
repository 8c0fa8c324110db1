"""KV cache groups and the host tier through the engine, against transformers.

Gemma 3 (two sliding layers, one global) and Gemma 2 with random weights, prompts past the
window: greedy tokens equal transformers' with one KV cache group per attention type
(the default) and with one table (`disable_hybrid_kv_cache_manager`), overlapped on and off,
under preemption with prefix caching, and the hybrid cache holds fewer layer-pages. The host
tier (`kv_offloading_size`): conversations whose histories exceed the device cache give the
tokens of the same engine without the tier (the last turn's equal transformers', a model with
no cache limit), prefix hits come back from the host, and
`Engine.stats` and /metrics count what moved. The greedy tokens of every policy, of
speculative decoding and of tensor parallelism with hybrid groups are checked by
tests/test_engine_families.py (those models get groups by default).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from prometheus_client import generate_latest

from arcjax import LLM, SamplingParams
from arcjax.entrypoints.openai.server_metrics import HOST_TIER_COUNTERS, ServerMetrics
from arcjax.errors import EngineConfigError
from support.hf_models import WINDOW, hf_greedy, tiny_model_dir

GEOMETRY = dict(block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                attention_impl="auto", chunk_tile=32, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts(n=3, seed=21):
    rs = np.random.RandomState(seed)
    return [rs.randint(3, 384, k).tolist() for k in (50, 9, 30, 41, 17, 60)[:n]]


@functools.lru_cache(maxsize=None)
def _expected(arch: str, prompt: tuple, n: int = 8) -> list[int]:
    return hf_greedy(tiny_model_dir(arch), list(prompt), n)


@functools.lru_cache(maxsize=None)
def _llm(arch: str, **options) -> LLM:
    return LLM(tiny_model_dir(arch), **{**GEOMETRY, **options})


def test_gemma3_groups_equal_transformers_and_hold_fewer_layer_pages():
    """Gemma 3's layers (sliding, global, sliding) form three groups of one layer each; the
    tokens equal transformers' with groups (overlapped) and with one table (serial); a long
    generation holds fewer layer-pages at its peak with groups."""
    arch = "Gemma3ForCausalLM"
    hybrid, single = _llm(arch), _llm(arch, disable_hybrid_kv_cache_manager=True,
                                      async_scheduling=False)
    assert hybrid.engine.sched_config.kv_cache_groups == (WINDOW, WINDOW, None)
    assert hybrid.engine.runner.kv.num_slots == 1 and single.engine.runner.kv.num_slots == 3
    assert single.engine.sched_config.kv_cache_groups == ()
    want = [_expected(arch, tuple(p)) for p in _prompts()]
    for llm in (hybrid, single):
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == want
        assert llm.engine.blocks_in_use() == 0
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine = hybrid.engine
    engine.add_request(_prompts()[0], long)
    held, outs = [], []
    while engine.has_unfinished():
        outs += engine.step()
        held.append(engine.blocks_in_use())
    assert list(outs[-1].token_ids) == _expected(arch, tuple(_prompts()[0]), 60)
    # 110 positions: one table holds 14 blocks of 3 layers' pages at the end; the groups'
    # blocks hold one layer's: 14 full + 2 x (24 / 8 + 1, + 1 while a block fills)
    assert max(held) * engine.runner.kv.num_slots <= 14 + 2 * 5 < 14 * 3


def _conversations(llm, arch: str, turns: int, users: int, seed: int) -> tuple[list, int]:
    """`users` conversations of `turns` turns, each resending its whole history plus 12 new
    tokens; the last turn's tokens are checked against transformers'. Returns every turn's
    tokens and the prompt tokens the prefix cache served."""
    rs = np.random.RandomState(seed)
    histories = [rs.randint(3, 384, 20).tolist() for _ in range(users)]
    got, cached = [], 0
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for _ in range(turns):
        outs = llm.generate(histories, params, use_tqdm=False)
        got.append([list(o.token_ids) for o in outs])
        cached += sum(o.num_cached_tokens for o in outs)
        last = histories
        histories = [h + list(o.token_ids) + rs.randint(3, 384, 12).tolist()
                     for h, o in zip(histories, outs)]
    assert got[-1] == [_expected(arch, tuple(h), 12) for h in last]
    return got, cached


@pytest.mark.parametrize("arch, num_kv_blocks, async_scheduling", [
    ("Gemma3ForCausalLM", 40, True), ("Gemma2ForCausalLM", 24, False)])
def test_host_tier_serves_evicted_histories_with_transformers_tokens(arch, num_kv_blocks,
                                                                     async_scheduling):
    """Four conversations of three turns on a device cache their histories need about three
    times (sequences are preempted and recomputed, full blocks served by the prefix cache):
    without and with a host tier every turn's tokens are equal, the last
    turn's equal transformers'; with the tier later turns reuse prefixes loaded back from
    the host (more cached tokens), and the stats count the blocks and bytes moved each way."""
    options = dict(num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling)
    plain = _llm(arch, **options)
    want, cached_plain = _conversations(plain, arch, 3, 4, seed=5)
    assert any(r.engaged.get("preempted") for r in plain.engine.trace)
    tiered = _llm(arch, kv_offloading_size=0.01, **options)
    got, cached_tiered = _conversations(tiered, arch, 3, 4, seed=5)
    assert got == want and cached_tiered > cached_plain
    stats = tiered.engine.stats()
    assert stats["kv_host_hit_blocks"] > 0 and stats["kv_host_stored_blocks"] > 0
    block = tiered.engine.runner.host_pool.block_bytes
    assert stats["kv_bytes_to_device"] == stats["kv_host_hit_blocks"] * block
    assert stats["kv_bytes_to_host"] == stats["kv_host_stored_blocks"] * block
    assert stats["kv_loads_timed"] > 0 and stats["kv_load_seconds_sum"] >= 0
    assert tiered.engine.blocks_in_use() == 0
    tiered.engine.check_trace()
    text = generate_latest(ServerMetrics(tiered.engine, "m").registry).decode()
    for name, key, _ in HOST_TIER_COUNTERS:  # /metrics shows the same counters
        assert f"{name}_total {float(stats[key])}" in text
    assert f"arcjax_kv_host_blocks_total {float(stats['kv_host_blocks_total'])}" in text
    assert "arcjax_kv_host" not in generate_latest(ServerMetrics(plain.engine, "m")
                                                   .registry).decode()


def test_host_tier_options_are_typed_errors():
    path = tiny_model_dir("Gemma2ForCausalLM")
    for options, match in ((dict(kv_offloading_size=-1), "must be a number"),
                           (dict(kv_offloading_size="1"), "must be a number"),
                           (dict(kv_offloading_size=1, enable_prefix_caching=False),
                            "needs enable_prefix_caching"),
                           (dict(kv_offloading_size=1e-9), "holds no KV block"),
                           (dict(disable_hybrid_kv_cache_manager="yes"), "must be a bool")):
        with pytest.raises(EngineConfigError, match=match) as e:
            LLM(path, **{**GEOMETRY, **options})
        assert e.value.field in ("kv_offloading_size", "disable_hybrid_kv_cache_manager")
    with pytest.raises(EngineConfigError) as e:
        LLM(path, **{**GEOMETRY, "kv_cache_groups": (None,)})
    assert e.value.field == "kv_cache_groups"  # derived from the model, not an option


def test_serve_flags_for_the_host_tier_and_the_groups():
    from arcjax.entrypoints.cli import parse_serve

    options = parse_serve(["serve", "--kv-offloading-size", "1.5",
                           "--disable-hybrid-kv-cache-manager", "true"]).engine_options
    assert options == {"kv_offloading_size": 1.5, "disable_hybrid_kv_cache_manager": True}
    with pytest.raises(SystemExit):  # derived from the model, not a flag
        parse_serve(["serve", "--kv-cache-groups", "8"])
