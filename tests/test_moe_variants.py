"""The router variants and expert MLPs of gpt-oss and DeepSeek-V2/V3 against transformers'
own modules (GptOssMLP, DeepseekV2Moe, DeepseekV3MoE) on random tiny configs, through every
grouped GEMM ("tiled", "ragged_dot", "dense"); and the routing rules on hand-made logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.model.expert_ffn import ExpertAct, glu
from arcjax.model.moe import moe_mlp
from arcjax.model.routing import RouterConfig, select

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

T, H = 12, 16
IMPLS = ("tiled", "ragged_dot", "dense")


def _perturb(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.copy_(torch.randn_like(p) * 0.5)


def _np(x):
    return x.detach().numpy().astype(np.float32)


def _stack(x, layer=1, layers=2):
    """x as layer `layer` of a [layers, ...] stack (other layers: garbage)."""
    out = np.full((layers,) + x.shape, np.nan, np.float32)
    out[layer] = x
    return jnp.asarray(out)


def _run(h, lp, experts, cfg_kw, impl):
    return jax.jit(lambda h: moe_mlp(h, lp, experts, jnp.int32(1), valid=jnp.ones(T, bool),
                                     impl=impl, **cfg_kw)[0])(h)


@pytest.mark.parametrize("impl", IMPLS)
def test_gpt_oss_mlp_matches_transformers(impl):
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=8, num_local_experts=4,
                                    num_experts_per_tok=2, swiglu_limit=0.8)
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(cfg).eval()
    _perturb(mlp, 0)
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _np(mlp(x)[0][0])
    ex, r = mlp.experts, mlp.router
    gate_up, gate_up_b = _np(ex.gate_up_proj), _np(ex.gate_up_proj_bias)
    # the checkpoint's interleaved gate/up columns, split as the loader splits them
    experts = {"we_gate": _stack(gate_up[..., ::2]), "we_up": _stack(gate_up[..., 1::2]),
               "we_down": _stack(_np(ex.down_proj)), "be_gate": _stack(gate_up_b[..., ::2]),
               "be_up": _stack(gate_up_b[..., 1::2]), "be_down": _stack(_np(ex.down_proj_bias))}
    lp = {"router": jnp.asarray(_np(r.weight).T), "router_bias": jnp.asarray(_np(r.bias))}
    got = _run(jnp.asarray(_np(x[0])), lp, experts, dict(
        num_experts=4, top_k=2, renormalize=False, act=ExpertAct("swiglu_oai", 1.702, 0.8),
        router=RouterConfig(scoring="topk_softmax", bias=True)), impl)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    # the clamp bites on these inputs: without it the output differs
    loose = _run(jnp.asarray(_np(x[0])), lp, experts, dict(
        num_experts=4, top_k=2, renormalize=False, act=ExpertAct("swiglu_oai", 1.702, 100.0),
        router=RouterConfig(scoring="topk_softmax", bias=True)), "dense")
    assert np.abs(np.asarray(loose) - want).max() > 1e-3


def _deepseek(version, **extra):
    cls = getattr(transformers, f"Deepseek{version}Config")
    kw = dict(hidden_size=H, num_attention_heads=4, intermediate_size=24,
              moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=4,
              topk_group=2, routed_scaling_factor=2.5)
    cfg = cls(**(kw | extra))
    module = getattr(transformers.models, f"deepseek_{version.lower()}")
    moe_cls = getattr(getattr(module, f"modeling_deepseek_{version.lower()}"),
                      f"Deepseek{version}Moe" if version == "V2" else "DeepseekV3MoE")
    return cfg, moe_cls(cfg).eval()


def _deepseek_params(moe, i):
    gate_up = _np(moe.experts.gate_up_proj)  # [E, 2I, H]: gate rows, then up rows
    experts = {"we_gate": _stack(gate_up[:, :i].transpose(0, 2, 1)),
               "we_up": _stack(gate_up[:, i:].transpose(0, 2, 1)),
               "we_down": _stack(_np(moe.experts.down_proj).transpose(0, 2, 1))}
    sh = moe.shared_experts
    lp = {"router": jnp.asarray(_np(moe.gate.weight).T),
          "ws_gate": jnp.asarray(_np(sh.gate_proj.weight).T),
          "ws_up": jnp.asarray(_np(sh.up_proj.weight).T),
          "ws_down": jnp.asarray(_np(sh.down_proj.weight).T)}
    if hasattr(moe.gate, "e_score_correction_bias"):
        lp["router_correction"] = jnp.asarray(_np(moe.gate.e_score_correction_bias))
    return lp, experts


@pytest.mark.parametrize("impl", IMPLS)
def test_deepseek_v3_moe_matches_transformers(impl):
    cfg, moe = _deepseek("V3")
    _perturb(moe, 2)
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _np(moe(x)[0])
    lp, experts = _deepseek_params(moe, 8)
    router = RouterConfig(scoring="sigmoid", correction_bias=True, n_group=4, topk_group=2,
                          group_score="top2_sum", routed_scaling_factor=2.5,
                          renormalize_eps=1e-20)
    got = _run(jnp.asarray(_np(x[0])), lp, experts, dict(
        num_experts=8, top_k=3, renormalize=True, act="silu", router=router), impl)
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_moe_matches_transformers(method):
    cfg, moe = _deepseek("V2", topk_method=method)
    _perturb(moe, 4)
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = _np(moe(x)[0])
    lp, experts = _deepseek_params(moe, 8)
    grouped = method != "greedy"
    router = RouterConfig(scoring="softmax", n_group=4 if grouped else 1,
                          topk_group=2 if grouped else 1, routed_scaling_factor=2.5)
    got = _run(jnp.asarray(_np(x[0])), lp, experts, dict(
        num_experts=8, top_k=3, renormalize=False, act="silu", router=router), "tiled")
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-5, rtol=3e-5)


def test_group_limit_and_correction_move_the_choice_not_the_weights():
    # 8 experts in 4 groups of 2; logits favour expert 0, but its group loses to groups
    # 2 and 3 (their best two sum higher); the correction bias then lifts expert 7.
    logits = jnp.array([[3.0, -4.0, 1.0, 0.9, 2.0, 2.0, 1.5, 1.4]])
    cfg = RouterConfig(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum")
    _, experts = select(logits, 2, False, cfg)
    assert set(np.asarray(experts[0]).tolist()) == {4, 5}
    correction = jnp.array([0, 0, 0, 0, 0, 0, 0, 1.0])
    w, experts = select(logits, 2, False, cfg, correction=correction)
    assert np.asarray(experts[0]).tolist()[0] == 7
    # the weights are the uncorrected sigmoid scores of the chosen experts
    np.testing.assert_allclose(np.asarray(w[0]), np.asarray(jax.nn.sigmoid(logits[0, experts[0]])),
                               rtol=1e-6)
    # "max" group score (V2): expert 0's group wins with its single best expert
    _, experts = select(logits, 2, False, RouterConfig(n_group=4, topk_group=1))
    assert np.asarray(experts[0]).tolist() == [0, 1]


def test_topk_softmax_and_scaling():
    logits = jnp.array([[1.0, 3.0, 2.0, -1.0]])
    w, e = select(logits, 2, False, RouterConfig(scoring="topk_softmax",
                                                 routed_scaling_factor=2.0),
                  bias=jnp.array([0.0, 0.0, 2.0, 0.0]))
    assert np.asarray(e[0]).tolist() == [2, 1]  # the bias lifted expert 2 over expert 1
    np.testing.assert_allclose(np.asarray(w[0]), 2.0 * np.array([np.exp(1) / (np.exp(1) + 1),
                                                                 1 / (np.exp(1) + 1)]), rtol=1e-6)


def test_clamped_swiglu_as_transformers_writes_it():
    gate = jnp.array([-9.0, -1.0, 0.5, 3.0, 9.0])
    up = jnp.array([-9.0, 0.5, -0.2, 8.0, 2.0])
    got = glu(gate, up, ExpertAct("swiglu_oai", 1.702, 7.0))
    g, u = np.minimum(np.asarray(gate), 7.0), np.clip(np.asarray(up), -7.0, 7.0)
    np.testing.assert_allclose(np.asarray(got), (u + 1) * g / (1 + np.exp(-1.702 * g)), rtol=1e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(scoring="relu"), "scoring"), (dict(group_score="mean"), "group_score"),
    (dict(n_group=2, topk_group=3), "topk_group")])
def test_router_config_refuses_unknown_variants(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kw)
