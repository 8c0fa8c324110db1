"""The layer loop (arcjax/model/layer_arrays.py): scanned over stacked weights, unrolled over
weights held one array per layer, or both in one engine ("auto" on the CPU: small buckets
unrolled) give transformers' greedy tokens under every schedule; the unrolled step copies no
weight slice; the trace summary names the loop; bad values are refused by name. And the CPU's
default KV cache cap (arcjax/engine/build.py)."""

import pytest

from arcjax.bench.step_profile import op_parts
from arcjax.engine.build import cpu_kv_cache_bytes
from arcjax.engine.engine_config import EngineConfig
from arcjax.errors import EngineConfigError
from arcjax.model.layer_arrays import AUTO_UNROLLED_TOKENS, LayerArrays, unrolled_max_tokens
from support.engines import GREEDY, SCHEDULES, engine_prompts, expected_greedy, tiny_llm


def _greedy(llm) -> list[list[int]]:
    outs = llm.generate(engine_prompts(), GREEDY, use_tqdm=False)
    llm.engine.check_trace()
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("layer_loop, schedule", [
    ("scan", SCHEDULES[0]), ("unrolled", SCHEDULES[3]), ("auto", SCHEDULES[3])])
def test_every_layer_loop_gives_transformers_greedy_under_every_schedule(layer_loop, schedule):
    llm = tiny_llm(layer_loop=layer_loop, **schedule)
    assert _greedy(llm) == expected_greedy()
    report = llm.trace_summary(1.0)["layer_loop"]
    assert report["configured"] == layer_loop
    if layer_loop == "auto":  # the CPU: decode buckets unrolled, large prefill buckets scan
        assert report["decode"] == ["unrolled"] and "scan" in report["prefill"]
        sizes = {b[0]: loop for b, loop in llm.engine.runner.layer_loops.items()}
        assert all((loop == "unrolled") == (t <= AUTO_UNROLLED_TOKENS)
                   for t, loop in sizes.items())
    else:
        assert report["decode"] == [layer_loop] and report["prefill"] == [layer_loop]
    held = llm.engine.runner.params["layers"]["wq"]
    assert isinstance(held, LayerArrays) == (layer_loop != "scan")


def test_a_mixture_of_experts_unrolled_keeps_its_experts_stacked():
    arch = "MixtralForCausalLM"
    llm = tiny_llm(arch, layer_loop="unrolled", **SCHEDULES[0])
    assert _greedy(llm) == expected_greedy(arch)
    layers = llm.engine.runner.params["layers"]
    assert isinstance(layers["wq"], LayerArrays) and not isinstance(layers["we_up"], LayerArrays)
    # "auto" keeps a mixture of experts on the scan
    auto = tiny_llm(arch, **SCHEDULES[0])
    assert auto.engine.runner.unrolled_max_tokens == 0
    assert not isinstance(auto.engine.runner.params["layers"]["wq"], LayerArrays)


def test_the_unrolled_step_copies_no_weight_slice():
    """The scan's decode step has the loop's own ops (slicing each layer's weights out of
    the stacks: `step_profile`'s "layer_loop" part); the unrolled one has none."""
    parts = {}
    for loop in ("scan", "unrolled"):
        llm = tiny_llm(layer_loop=loop, **SCHEDULES[0])
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        runner = llm.engine.runner
        decode = next(key for key in runner._compiled if key[0].max_q_len == 1)
        parts[loop] = list(op_parts(runner._compiled[decode].as_text()).values())
    assert parts["scan"].count("layer_loop") > 0
    assert parts["unrolled"].count("layer_loop") == 0 and "mlp" in parts["unrolled"]


def test_auto_unrolls_only_where_it_may():
    cpu = dict(platform="cpu", meshed=False, experts=False)
    assert unrolled_max_tokens("auto", **cpu) == AUTO_UNROLLED_TOKENS
    for other in (dict(platform="gpu"), dict(meshed=True), dict(experts=True)):
        assert unrolled_max_tokens("auto", **{**cpu, **other}) == 0
    assert unrolled_max_tokens("unrolled", **cpu) > 0
    assert unrolled_max_tokens("scan", **cpu) == 0


def test_bad_layer_loop_is_refused_by_name():
    with pytest.raises(EngineConfigError) as e:
        EngineConfig(layer_loop="unroll")
    assert e.value.field == "layer_loop"


def test_cpu_kv_cache_cap_is_a_sixteenth_of_the_host_as_a_power_of_two():
    assert cpu_kv_cache_bytes(24 << 30) == 1 << 30  # 1.5 GiB -> 1 GiB
    assert cpu_kv_cache_bytes(32 << 30) == 2 << 30
    assert cpu_kv_cache_bytes(2 << 30) == 256 << 20  # the lower bound
    assert cpu_kv_cache_bytes(1 << 40) == 4 << 30  # the upper bound
    assert cpu_kv_cache_bytes(0) == 256 << 20
    here = cpu_kv_cache_bytes()
    assert here & (here - 1) == 0 and (256 << 20) <= here <= (4 << 30)
