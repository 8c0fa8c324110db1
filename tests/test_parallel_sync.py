"""Multi-host step sync (arcjax.parallel.multihost) with an in-memory transport: inbox
broadcast from the leader, plan digests, divergence, follower stop; and the
tensor-parallel checks and shardings that need no second device."""

from __future__ import annotations

import threading

import pytest

from arcjax.errors import EngineConfigError, EngineDeadError
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import cache_specs, param_specs
from arcjax.parallel import (FollowerStop, LocalTransport, PlanDivergenceError, StepSync,
                             TensorParallel, check_tensor_parallel, follow, kv_repeat,
                             logical_rules, sharded_config, stop_followers)


def _cfg(**kw):
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=8, num_kv_heads=2, head_dim=16)
    return ModelConfig(**{**base, **kw})


def test_check_tensor_parallel():
    cfg = _cfg()
    for tp in (1, 2, 4, 8):
        check_tensor_parallel(cfg, tp)
    for tp in (3, 16, 0):
        with pytest.raises(EngineConfigError) as e:
            check_tensor_parallel(cfg, tp)
        assert e.value.field == "tensor_parallel_size"
    with pytest.raises(EngineConfigError):  # 3 KV heads: 2 neither divides nor is a multiple
        check_tensor_parallel(_cfg(num_heads=6, num_kv_heads=3, intermediate_size=120), 2)
    with pytest.raises(EngineConfigError):
        check_tensor_parallel(_cfg(intermediate_size=100), 8)


def test_kv_heads_repeated_when_tp_exceeds_them():
    cfg = _cfg()
    assert kv_repeat(cfg, 2) == 1 and sharded_config(cfg, 2) is cfg
    assert kv_repeat(cfg, 8) == 4 and sharded_config(cfg, 8).num_kv_heads == 8
    # query head h reads repeated head h // (Hq / tp), i.e. original head h // (Hq / Hkv)
    s = sharded_config(cfg, 8)
    assert all((h // s.q_per_kv) // 4 == h // cfg.q_per_kv for h in range(cfg.num_heads))


def test_shardings_derived_from_specs():
    # a vocabulary tp does not divide is replicated, never padded
    assert dict(logical_rules(_cfg(vocab_size=385), 2)) == {"heads": "tp", "kv_heads": "tp",
                                                            "mlp": "tp"}
    assert dict(logical_rules(_cfg(), 2))["vocab"] == "tp"
    cfg = _cfg(vocab_size=385)
    tp = TensorParallel(TensorParallel.create(cfg, 1).mesh, logical_rules(cfg, 2))
    sh = tp.param_shardings(cfg)
    assert tuple(sh["layers"]["wq"].spec) == (None, None, "tp")
    assert tuple(sh["layers"]["wo"].spec) == (None, "tp", None)
    assert tuple(sh["layers"]["w_down"].spec) == (None, "tp", None)
    assert tuple(sh["embed"].spec) == (None, None)
    specs = param_specs(cfg)
    assert set(sh) == set(specs) and set(sh["layers"]) == set(specs["layers"])
    cache = tp.shardings(cache_specs(cfg, 4, 8))
    assert tuple(cache["k"].spec) == (None, None, "tp", None)
    tp_v = TensorParallel.create(_cfg(), 1)
    assert tuple(tp_v.param_shardings(_cfg())["embed"].spec) == ("tp", None)


def _deepseek_v3(**kw):
    """A DeepSeek-V3 config (latent attention, a dense first layer, shared experts)."""
    d = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=384, hidden_size=64,
             intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=512, kv_lora_rank=32,
             q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
             norm_topk_prob=True)
    return ModelConfig.from_hf_dict({**d, **kw})


def test_latent_attention_splits_by_head_over_whole_latent_pages():
    """Latent attention under tp = 2 (docs/decisions/0025-latent-attention-replicated.md):
    the query, key/value up-projections and output split by head, the latent projection and
    its norm replicated, the latent pages whole on every device (no KV head to repeat),
    the dense layer and shared experts split like dense MLPs, the experts by "ep"."""
    cfg = _deepseek_v3()
    check_tensor_parallel(cfg, 2, 2)
    assert kv_repeat(cfg, 4) == 1 and sharded_config(cfg, 4) is cfg
    mesh = TensorParallel.create(cfg, 1).mesh
    tp = TensorParallel(mesh, logical_rules(cfg, 2))
    sh = tp.param_shardings(cfg)
    layers, dense = sh["layers"], sh["dense_layers"]
    for stack in (layers, dense):
        assert tuple(stack["wq_b"].spec) == (None, None, "tp")
        assert tuple(stack["wkv_b"].spec) == (None, None, "tp")
        assert tuple(stack["wo"].spec) == (None, "tp", None)
        assert all(a is None for a in stack["wkv_a"].spec)
        assert all(a is None for a in stack["wq_a"].spec)
        assert all(a is None for a in stack["kv_a_norm"].spec)
    assert tuple(dense["w_gate"].spec) == (None, None, "tp")
    assert tuple(layers["ws_down"].spec) == (None, "tp", None)
    assert tuple(layers["we_gate"].spec) == (None, None, None, "tp")  # each expert's width
    cache = tp.shardings(cache_specs(cfg, 4, 8))
    assert all(a is None for a in cache["k"].spec) and all(a is None for a in cache["v"].spec)
    ep, specs = TensorParallel(mesh, logical_rules(cfg, 2, 2)), param_specs(cfg)
    assert tuple(ep.pspec(specs["layers"]["we_gate"].axes)) == (None, "ep", None, "tp")
    assert tuple(ep.pspec(specs["layers"]["wkv_b"].axes)) == (None, None, ("ep", "tp"))
    # tp must divide the dense layer's width too (a mixture of experts with dense layers)
    with pytest.raises(EngineConfigError, match="intermediate_size 126") as e:
        check_tensor_parallel(_deepseek_v3(intermediate_size=126), 4)
    assert e.value.field == "tensor_parallel_size"


def _pair(**kw):
    t = LocalTransport()
    return t, StepSync(t, 0, 2, **kw), StepSync(t, 1, 2, **kw)


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, box


def test_inbox_broadcast_and_plan_check():
    t, leader, follower = _pair(timeout_s=5, idle_poll_s=0.05)
    for step in range(5):
        items = [("add", f"r{step}", None, (1, 2, 3)), ("abort", f"r{step - 1}")]
        th, box = _in_thread(lambda: (follower.exchange_inbox([]),
                                      follower.check_plan(b"digest%d" % step)))
        assert leader.exchange_inbox(items) == items
        leader.check_plan(b"digest%d" % step)
        th.join(5)
        assert "error" not in box and box["value"][0] == items
    assert leader.step == follower.step == 5
    assert len(t) <= 4  # old keys are dropped: the store does not grow with the steps


def test_divergent_plans_fail_on_every_process():
    _, leader, follower = _pair(timeout_s=5, idle_poll_s=0.05)
    th, box = _in_thread(lambda: (follower.exchange_inbox([]), follower.check_plan(b"B")))
    leader.exchange_inbox([])
    with pytest.raises(PlanDivergenceError, match="diverged"):
        leader.check_plan(b"A")
    th.join(5)
    assert isinstance(box["error"], PlanDivergenceError)


def test_silent_process_times_out():
    _, leader, _ = _pair(timeout_s=0.2)
    leader.exchange_inbox([])
    with pytest.raises(PlanDivergenceError, match="no plan digest"):
        leader.check_plan(b"A")


def test_follower_stops_and_refuses_requests():
    _, leader, follower = _pair(timeout_s=5, idle_poll_s=0.05)
    with pytest.raises(RuntimeError, match="only process 0"):
        follower.exchange_inbox([("abort", "x")])
    th, box = _in_thread(lambda: follower.exchange_inbox([]))
    leader.stop_followers()
    th.join(5)
    assert isinstance(box["error"], FollowerStop) and follower.stopped


def _engines(**follower_options):
    from support.hf_models import tiny_model_dir

    from arcjax.engine.build import build_engine
    from arcjax.engine.engine_config import EngineConfig

    geometry = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=4,
                    attention_impl="auto", chunk_tile=16, max_num_batched_tokens=32,
                    async_scheduling=False)  # multi-host runs the serial step
    model = tiny_model_dir("LlamaForCausalLM")
    leader = build_engine(EngineConfig.from_options(model, **geometry))
    follower = build_engine(EngineConfig.from_options(model, **{**geometry,
                                                                 **follower_options}))
    transport = LocalTransport()
    leader.sync = StepSync(transport, 0, 2, timeout_s=10, idle_poll_s=0.05)
    follower.sync = StepSync(transport, 1, 2, timeout_s=10, idle_poll_s=0.05)
    return leader, follower


def test_engine_inbox_reaches_followers_in_order():
    from arcjax import SamplingParams

    leader, follower = _engines()
    rid = leader.add_request(list(range(3, 20)), SamplingParams(max_tokens=4))
    leader.abort(rid)  # multi-host: applied at the next step, on every process alike
    assert leader.has_unfinished()
    th, box = _in_thread(follower.step)
    leader.step()  # add then abort: an empty plan, nothing compiles
    th.join(10)
    assert "error" not in box
    assert not leader.has_unfinished() and not follower.has_unfinished()
    assert leader.sync.step == follower.sync.step == 1
    th, box = _in_thread(lambda: follow(follower))
    stop_followers(leader)
    th.join(10)
    assert box["value"] == 0


def test_engines_with_different_configs_fail_loudly():
    from arcjax import SamplingParams

    leader, follower = _engines(max_num_batched_tokens=16)  # plans chunk differently
    leader.add_request(list(range(3, 43)), SamplingParams(max_tokens=4))
    th, box = _in_thread(follower.step)
    with pytest.raises(EngineDeadError, match="diverged") as err:
        leader.step()  # raised before the device call: nothing compiles
    th.join(10)
    # both engines are dead with the same reason (the first process to fail gives it)
    assert isinstance(box.get("error"), EngineDeadError)
    assert box["error"].reason == err.value.reason and "PlanDivergenceError" in err.value.reason
    assert not leader.has_unfinished() and not follower.has_unfinished()
    with pytest.raises(EngineDeadError):
        leader.add_request([5, 6], SamplingParams(max_tokens=2))


def test_async_scheduling_is_refused_in_a_multi_process_run(monkeypatch):
    """Checked when the config is built, before anything loads (multi-host runs the serial
    step; a process that joined a run reports how many processes it has)."""
    import arcjax.engine.engine_config as config

    monkeypatch.setattr(config, "_joined_processes", lambda: 2)
    with pytest.raises(EngineConfigError) as err:
        config.EngineConfig.from_options(None, async_scheduling=True)
    assert err.value.field == "async_scheduling"
    assert config.EngineConfig.from_options(None).async_scheduling is None  # auto: serial
    monkeypatch.setattr(config, "_joined_processes", lambda: 1)
    assert config.EngineConfig.from_options(None, async_scheduling=True).async_scheduling
