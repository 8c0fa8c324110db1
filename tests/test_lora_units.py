"""arcjax/lora/ without the engine: the per-token delta against a numpy reference, PEFT
adapters read against PEFT's own modules, every refusal typed (adapter and field named),
the host LRU and the device slot table."""

from __future__ import annotations

import functools
import json
import os
import threading

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arcjax.errors import LoRAAdapterError, RequestError
from arcjax.lora.adapter_cache import AdapterCache
from arcjax.model.lora_delta import IMPLS, lora_delta, resolve_impl
from arcjax.lora.lora_request import LoRARequest
from arcjax.lora.peft_adapter import load_peft_adapter
from arcjax.lora.slot_table import SlotTable, token_slots
from arcjax.model.model_config import ModelConfig
from support.hf_models import tiny_model_dir
from support.lora_adapters import edited_adapter, peft_adapter_dir
from support.scratch import scratch_dir

ARCH = "LlamaForCausalLM"


def _cfg(arch: str = ARCH) -> ModelConfig:
    with open(os.path.join(tiny_model_dir(arch), "config.json")) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def _load(path, name="ad", lora_id=1, arch=ARCH, max_rank=16, **kw):
    return load_peft_adapter(LoRARequest(name, lora_id, path), _cfg(arch), max_rank=max_rank,
                             **kw)


# ---- the delta --------------------------------------------------------------------------

def _reference(x, a, b, slots):
    """Token by token, float64."""
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    return np.stack([x[t] @ a[s] @ b[s] for t, s in enumerate(np.asarray(slots))])


@functools.partial(jax.jit, static_argnames="impl")
def _delta(x, a, b, slots, *, impl):
    return lora_delta(x, a, b, slots, impl=impl)


# Few distinct shapes (each is one compile per implementation); the slots vary freely.
@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 7, 33]), st.sampled_from([1, 4]), st.sampled_from([1, 16]),
       st.sampled_from([(8, 40), (24, 8)]), st.integers(0, 2), st.data())
def test_every_impl_equals_the_token_by_token_reference(tokens, slots, rank, dims, layout,
                                                        data):
    """Random slots per token (or all base, or all one adapter); slot 0 is zeros."""
    d_in, d_out = dims
    rng = np.random.default_rng(tokens * 7 + slots)
    x = rng.normal(size=(tokens, d_in)).astype(np.float32)
    a = rng.normal(size=(slots + 1, d_in, rank)).astype(np.float32)
    b = rng.normal(size=(slots + 1, rank, d_out)).astype(np.float32)
    a[0], b[0] = 0, 0
    if layout == 0:
        idx = np.array(data.draw(st.lists(st.integers(0, slots), min_size=tokens,
                                          max_size=tokens)), np.int32)
    else:
        idx = np.full(tokens, 0 if layout == 1 else slots, np.int32)
    want = _reference(x, a, b, idx)
    for impl in IMPLS:
        got = np.asarray(_delta(x, a, b, idx, impl=impl))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4, err_msg=impl)
        if layout == 1:
            assert not got.any(), f"{impl}: base-model tokens got a delta"


def test_bfloat16_delta_is_close():
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    x = rng.normal(size=(17, 32)).astype(np.float32)
    a = rng.normal(size=(4, 32, 8)).astype(np.float32) * 0.2
    b = rng.normal(size=(4, 8, 24)).astype(np.float32) * 0.2
    a[0], b[0] = 0, 0
    idx = rng.integers(0, 4, 17).astype(np.int32)
    want = _reference(x, a, b, idx)
    for impl in IMPLS:
        got = _delta(jnp.asarray(x, jnp.bfloat16), jnp.asarray(a, jnp.bfloat16),
                     jnp.asarray(b, jnp.bfloat16), jnp.asarray(idx), impl=impl)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.1)


def test_auto_is_named_per_platform():
    assert resolve_impl("auto", "cpu") == "masked"
    assert resolve_impl("auto", "gpu") == "ragged_dot"
    assert resolve_impl("gather", "cpu") == "gather"
    with pytest.raises(ValueError):
        resolve_impl("punica", "cpu")


# ---- PEFT adapters read -------------------------------------------------------------------

def _peft_modules(adapter_dir: str, arch: str = ARCH):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch),
                                                             dtype="float32")
    return peft.PeftModel.from_pretrained(base, adapter_dir).base_model.model.model.layers


def _peft_delta(module, x):
    """What PEFT adds to a projection's output for input x (numpy in, numpy out)."""
    import torch

    with torch.no_grad():
        t = torch.tensor(x)
        return (module.lora_B["default"](module.lora_A["default"](t))
                * module.scaling["default"]).numpy()


@pytest.mark.parametrize("rank, rslora", [(4, False), (16, True)])
def test_weights_equal_what_peft_adds(rank, rslora):
    """Every projection of every layer: x @ A @ B (scale folded in) equals PEFT's
    lora_B(lora_A(x)) * scaling, rsLoRA included."""
    path = peft_adapter_dir(ARCH, rank=rank, seed=1, rslora=rslora)
    adapter = _load(path)
    assert adapter.rank == rank and sorted(adapter.weights) == sorted(
        ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"])
    layers = _peft_modules(path)
    rng = np.random.default_rng(0)
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for key, (a, b) in adapter.weights.items():
        for layer in range(a.shape[0]):
            module = layers[layer].get_submodule(names[key])
            x = rng.normal(size=(3, a.shape[1])).astype(np.float32)
            np.testing.assert_allclose(x @ a[layer] @ b[layer], _peft_delta(module, x),
                                       rtol=1e-5, atol=1e-5, err_msg=f"{key} layer {layer}")


@pytest.mark.parametrize("targets, layers", [
    (r".*\.1\.self_attn\.q_proj|.*\.1\.mlp\.down_proj", None),  # a regex (PEFT: no layers)
    (["q_proj", "down_proj"], [1]),
])
def test_regex_targets_layers_and_patterns_follow_peft(targets, layers):
    """target_modules as a regex or names with layers_to_transform, rank_pattern and
    alpha_pattern: the layers and projections PEFT adapts, its per-module ranks and
    scales."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(ARCH),
                                                             dtype="float32")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                             layers_to_transform=layers, rank_pattern={"down_proj": 2},
                             alpha_pattern={"q_proj": 4}, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    path = scratch_dir("arcjax-lora-regex-")
    model.save_pretrained(path)
    adapter = _load(path)
    assert sorted(adapter.weights) == ["w_down", "wq"] and adapter.rank == 8
    a, b = adapter.weights["wq"]
    assert not a[0].any() and not b[0].any(), "layer 0 is not transformed"
    modules = model.base_model.model.model.layers
    rng = np.random.default_rng(1)
    for key, name in (("wq", "self_attn.q_proj"), ("w_down", "mlp.down_proj")):
        a, b = adapter.weights[key]
        x = rng.normal(size=(2, a.shape[1])).astype(np.float32)
        np.testing.assert_allclose(x @ a[1] @ b[1], _peft_delta(modules[1].get_submodule(name), x),
                                   rtol=1e-5, atol=1e-6)
    assert not adapter.weights["w_down"][0][1][:, 2:].any()  # rank 2, padded to 8


def test_pytorch_bin_adapter_reads_like_safetensors():
    import torch
    from safetensors.numpy import load_file

    src = peft_adapter_dir(ARCH, rank=4, seed=2)
    path = edited_adapter(src, drop=("adapter_model.safetensors",))
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    torch.save({k: torch.tensor(v) for k, v in tensors.items()},
               os.path.join(path, "adapter_model.bin"))
    a = _load(src)
    b = _load(path)
    for key in a.weights:
        np.testing.assert_array_equal(a.weights[key][0], b.weights[key][0])
        np.testing.assert_array_equal(a.weights[key][1], b.weights[key][1])


# ---- refusals: adapter and field named ---------------------------------------------------

def _refused(path, field, *, arch=ARCH, match=None, **kw):
    with pytest.raises(LoRAAdapterError) as e:
        _load(path, name="bad", arch=arch, **kw)
    assert e.value.adapter == "bad" and e.value.field == field, e.value
    assert isinstance(e.value, RequestError) and "'bad'" in str(e.value)
    if match:
        assert match in str(e.value)
    return e.value


def test_refusals_name_the_adapter_and_the_field():
    good = peft_adapter_dir(ARCH, rank=4, seed=0)
    weights = "adapter_model.safetensors"
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _refused(edited_adapter(good, drop=("adapter_config.json",)), "adapter_config.json")
    _refused(edited_adapter(good, drop=(weights,)), weights, match="missing")
    _refused(good, "adapter_config.json:r", max_rank=2, match="max_lora_rank 2")
    _refused(edited_adapter(good, config={"target_modules": ["c_attn"]}),
             "adapter_config.json:target_modules", match="c_attn")
    _refused(edited_adapter(good, config={"use_dora": True}), "adapter_config.json:use_dora")
    _refused(edited_adapter(good, config={"bias": "all"}), "adapter_config.json:bias")
    _refused(edited_adapter(good, config={"modules_to_save": ["lm_head"]}),
             "adapter_config.json:modules_to_save")
    _refused(edited_adapter(good, config={"peft_type": "IA3"}), "adapter_config.json:peft_type")
    _refused(edited_adapter(good, config={"auto_mapping": {"base_model_class": "GPT2LMHeadModel"}}),
             "adapter_config.json:auto_mapping.base_model_class")
    _refused(edited_adapter(good, config={"base_model_name_or_path":
                                          tiny_model_dir("Qwen3ForCausalLM")}),
             "adapter_config.json:base_model_name_or_path", match="head_dim")
    _refused(edited_adapter(good, tensors={q_a: np.zeros((4, 63), np.float32)}),
             f"{weights}:{q_a}", match="expected (4, 64)")
    _refused(edited_adapter(good, tensors={q_a: None}), f"{weights}:{q_a}", match="missing")
    lm_head = "base_model.model.lm_head.lora_A.weight"
    _refused(edited_adapter(good, tensors={lm_head: np.zeros((4, 64), np.float32)}),
             f"{weights}:{lm_head}")
    deep = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    _refused(edited_adapter(good, tensors={deep: np.zeros((4, 64), np.float32)}),
             f"{weights}:{deep}", match="2 layers")
    extra = edited_adapter(good, config={"target_modules": ["q_proj"]})
    _refused(extra, weights, match="does not name")
    _refused(edited_adapter(good, config={"layers_to_transform": [5]}),
             "adapter_config.json:layers_to_transform")
    broken = edited_adapter(good)
    with open(os.path.join(broken, weights), "wb") as f:
        f.write(b"\x00" * 20)
    _refused(broken, weights, match="cannot be read")


def test_experts_and_missing_paths_are_refused():
    moe = "Qwen2MoeForCausalLM"
    good = peft_adapter_dir(moe, rank=4, targets=("q_proj", "v_proj"))
    assert sorted(_load(good, arch=moe).weights) == ["wq", "wv"]
    _refused(edited_adapter(good, config={"target_modules": ["q_proj", "gate_proj"]}),
             "adapter_config.json:target_modules", arch=moe, match="mixture of experts")
    _refused(os.path.join(good, "nope"), "lora_request.lora_path")
    _refused(os.path.join(good, "adapter_config.json"), "lora_request.lora_path",
             match="is a file")


def test_hub_adapter_offline_not_cached_is_a_typed_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    err = _refused("someone/some-adapter", "lora_request.lora_path")
    assert "someone/some-adapter" in str(err)


@pytest.mark.parametrize("kwargs, field", [
    (dict(lora_name="", lora_int_id=1, lora_path="x"), "lora_request.lora_name"),
    (dict(lora_name="a", lora_int_id=0, lora_path="x"), "lora_request.lora_int_id"),
    (dict(lora_name="a", lora_int_id=True, lora_path="x"), "lora_request.lora_int_id"),
    (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_request.lora_path"),
    (dict(lora_name="a", lora_int_id=1, lora_path=3), "lora_request.lora_path"),
])
def test_lora_request_fields_are_checked(kwargs, field):
    with pytest.raises(LoRAAdapterError) as e:
        LoRARequest(**kwargs)
    assert e.value.field == field


def test_lora_adapter_error_pickles():
    import pickle

    e = LoRAAdapterError("x", "adapter_config.json:r", "too big", limit=8)
    back = pickle.loads(pickle.dumps(e))
    assert (back.adapter, back.field, back.limit, str(back)) == ("x", e.field, 8, str(e))


# ---- the host LRU -------------------------------------------------------------------------

class _Loader:
    def __init__(self):
        self.calls = []

    def __call__(self, request):
        self.calls.append(request.lora_int_id)
        if request.lora_path == "broken":
            raise LoRAAdapterError(request.lora_name, "adapter_config.json", "missing")
        from arcjax.lora.peft_adapter import PeftAdapter

        return PeftAdapter(name=request.lora_name, lora_int_id=request.lora_int_id,
                           path=request.lora_path, rank=1, weights={})


def _req(i, path=None):
    return LoRARequest(f"a{i}", i, path or f"/adapters/{i}")


def test_lru_keeps_capacity_and_never_drops_a_pinned_adapter():
    load = _Loader()
    cache = AdapterCache(load, capacity=2)
    refs = [cache.acquire(_req(i)) for i in (1, 2, 3)]  # all pinned: over capacity
    assert [r.lora_int_id for r in cache.loaded()] == [1, 2, 3]
    assert len({r.key for r in refs}) == 3
    cache.release(refs[0])  # 1 unpinned, least recent: dropped
    assert [r.lora_int_id for r in cache.loaded()] == [2, 3]
    cache.check(_req(4))  # loaded, checked, then dropped: 2 and 3 are pinned
    assert [r.lora_int_id for r in cache.loaded()] == [2, 3]
    cache.release(refs[1])
    cache.release(refs[2])
    cache.check(_req(2))  # a hit: 2 is most recent
    cache.check(_req(5))  # 3 is the least recent unpinned: dropped
    assert [r.lora_int_id for r in cache.loaded()] == [2, 5]
    again = cache.acquire(_req(1))  # reloaded: a new key (its old KV is never reused)
    assert again.key not in {r.key for r in refs}
    assert load.calls == [1, 2, 3, 4, 5, 1]
    assert cache.weights(again.key).lora_int_id == 1
    with pytest.raises(KeyError):
        cache.weights(refs[2].key)


def test_one_id_one_adapter_and_failed_loads_leave_nothing():
    cache = AdapterCache(_Loader(), capacity=4)
    cache.acquire(_req(1))
    with pytest.raises(LoRAAdapterError) as e:
        cache.acquire(LoRARequest("other", 1, "/adapters/other"))
    assert e.value.field == "lora_request.lora_int_id" and e.value.adapter == "other"
    with pytest.raises(LoRAAdapterError):
        cache.acquire(LoRARequest("b", 9, "broken"))
    assert [r.lora_int_id for r in cache.loaded()] == [1]
    with pytest.raises(LoRAAdapterError) as e:
        cache.check("not a request")
    assert e.value.field == "lora_request"


def test_forget_drops_once_released_and_concurrent_acquires_load_once():
    load = _Loader()
    cache = AdapterCache(load, capacity=4)
    ref = cache.acquire(_req(1))
    assert cache.forget(1) and not cache.forget(1)
    assert cache.loaded() == [] and cache.pinned() == 1
    assert cache.weights(ref.key).lora_int_id == 1  # still readable while pinned
    new = cache.acquire(_req(1))  # loaded afresh: another key
    assert new.key != ref.key
    cache.release(ref)
    assert cache.pinned() == 1
    with pytest.raises(KeyError):
        cache.weights(ref.key)
    refs = []
    threads = [threading.Thread(target=lambda: refs.append(cache.acquire(_req(7))))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.key for r in refs}) == 1 and cache.pinned() == 2


# ---- the device slot table ----------------------------------------------------------------

def test_slot_table_assigns_evicts_and_writes_padded_weights():
    cfg = _cfg()
    adapters = {k: _load(peft_adapter_dir(ARCH, rank=4, seed=k), lora_id=k) for k in (1, 2, 3)}
    table = SlotTable(cfg, max_loras=2, rank=8, dtype="float32")
    assert table.assign([1], (), adapters.get) == {1: 1}
    assert table.assign([2, 1], (), adapters.get) == {2: 2, 1: 1}
    assert table.swaps == 2
    # 1 is least recently used but a running sequence keeps it: 2 goes
    assert table.assign([3], keep={1}, weights=adapters.get) == {3: 2}
    with pytest.raises(RuntimeError):
        table.assign([2], keep={1, 3}, weights=adapters.get)
    a = np.asarray(table.buffers["wq"]["a"])  # [L, S, in, r]
    b = np.asarray(table.buffers["wq"]["b"])
    assert not a[:, 0].any() and not b[:, 0].any(), "slot 0 must stay zero"
    wa, wb = adapters[3].weights["wq"]
    np.testing.assert_array_equal(a[:, 2, :, :4], wa)
    assert not a[:, 2, :, 4:].any() and not b[:, 2, 4:].any()
    np.testing.assert_array_equal(b[:, 2, :4], wb)
    np.testing.assert_array_equal(np.asarray(table.buffers["w_down"]["b"])[:, 1, :4],
                                  adapters[1].weights["w_down"][1])
    assert table.swaps == 3
    assert token_slots([2, 0, 1], [3, 1, 2], 8).tolist() == [2, 2, 2, 0, 1, 1, 0, 0]


def test_slot_table_repeats_kv_heads_and_zeroes_untargeted_projections():
    cfg = _cfg()  # 2 KV heads; stored twice each, as tensor parallelism 4 would
    adapter = _load(peft_adapter_dir(ARCH, rank=4, seed=5, targets=("k_proj",)))
    full = _load(peft_adapter_dir(ARCH, rank=4, seed=6), lora_id=2)
    table = SlotTable(cfg.with_kv_repeat(2), max_loras=1, rank=4, dtype="float32")
    table.assign([2], (), {2: full}.get)
    table.assign([1], (), {1: adapter}.get)  # replaces the full adapter in slot 1
    b = np.asarray(table.buffers["wk"]["b"])[:, 1]  # [L, r, 2 * Hkv * D]
    wb = adapter.weights["wk"][1].reshape(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    np.testing.assert_array_equal(b.reshape(cfg.num_layers, 4, cfg.num_kv_heads, 2,
                                            cfg.head_dim), np.repeat(wb[:, :, :, None], 2, 3))
    assert not np.asarray(table.buffers["wq"]["b"])[:, 1].any(), "a stale projection kept"


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=True), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=3), "max_cpu_loras"), (dict(lora_impl="punica"), "lora_impl"),
])
def test_lora_config_names_the_bad_option(kwargs, field):
    from arcjax.errors import EngineConfigError
    from arcjax.lora.lora_config import LoRAConfig

    with pytest.raises(EngineConfigError) as e:
        LoRAConfig(**kwargs)
    assert e.value.field == field
    assert LoRAConfig(max_loras=3).cpu_capacity == 3
    assert LoRAConfig(max_loras=3, max_cpu_loras=8).cpu_capacity == 8
