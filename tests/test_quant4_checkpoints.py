"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints (issue 37), kept packed.

Checkpoints are written from the tiny models by arcjax/bench/packed_checkpoints.py (a numpy
reference of each published layout; its checkpoints dequantize exactly as AutoAWQ's
`dequantize_gemm`, AutoGPTQ's `QuantLinear` and compressed-tensors' decompressor do, see
RESULTS.md), and by compressed-tensors' own compressor. The reference is transformers on
the same weights dequantized in float32: greedy tokens must be identical. Refused formats
and options are typed errors naming the field, raised before any weight is read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arcjax
from arcjax.bench.packed_checkpoints import packed_checkpoint
from arcjax.errors import EngineConfigError, QuantizationConfigError
from arcjax.model.formats.hf_checkpoint import load_hf
from arcjax.model.formats.hub import resolve_model
from arcjax.model.formats.loader import load_model
from arcjax.model.formats.packed_layouts import read_pack_quantized
from arcjax.model.packed import PackedWeight
from arcjax.model.quant import weight_dtype
from support.checkpoint_cases import PROMPTS, dense_greedy
from support.hf_models import hf_greedy, tiny_model_dir

LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_DEQUANTIZE = jax.jit(lambda w: w.dequantize(jnp.float32))
# id -> packed_checkpoint options: every method, 2 / 4 / 8 bits, groups of 32 and per
# channel, symmetric and zero points, act-order (g_idx), GPTQ's v1 and v2 zero points.
CASES = {
    "awq-g32": dict(method="awq"),
    "gptq-g32": dict(method="gptq"),
    "gptq-act_order-sym-8bit": dict(method="gptq", desc_act=True, symmetric=True, bits=8),
    "gptq_v2-2bit-channel": dict(method="gptq", gptq_v1=False, bits=2, group=None),
    "ct-g32-sym": dict(method="pack-quantized", symmetric=True),
    "ct-channel": dict(method="pack-quantized", group=None),
    "ct-g_idx": dict(method="pack-quantized", desc_act=True),
}
GREEDY_CASES = ("awq-g32", "gptq-act_order-sym-8bit", "ct-g32-sym")


@pytest.mark.parametrize("case", list(CASES))
def test_packed_checkpoints_load_packed_and_exact(case):
    """Every linear weight stays packed and dequantizes to exactly the reference's
    float32 weights; three formats also run greedy against transformers."""
    src = tiny_model_dir("LlamaForCausalLM")
    qdir, fdir = packed_checkpoint(src, **CASES[case])
    model = load_model(resolve_model(qdir), dtype=jnp.float32)
    _, ref = load_hf(fdir)
    method = CASES[case]["method"]
    for key in LINEAR:
        w = model.params["layers"][key]
        assert isinstance(w, PackedWeight) and w.dtype == method, key
        assert (w.g_idx is not None) == CASES[case].get("desc_act", False)
        np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(w)),
                                      np.asarray(ref["layers"][key]), err_msg=key)
    assert weight_dtype(model.params) == method
    if case in GREEDY_CASES:
        ids = PROMPTS[1]
        assert dense_greedy(model.cfg, model.params, ids, 10) == hf_greedy(fdir, ids, 10)


def test_moe_experts_packed_equal_transformers():
    """Mixtral's experts (w1 / w3 / w2) in compressed-tensors W4A16 stay packed, stacked
    [L, E, in, out], read by (layer, expert) inside the grouped GEMM."""
    qdir, fdir = packed_checkpoint(tiny_model_dir("MixtralForCausalLM"), "pack-quantized")
    model = load_model(resolve_model(qdir), dtype=jnp.float32)
    cfg = model.cfg
    for key in ("we_gate", "we_up", "we_down"):
        w = model.params["layers"][key]
        assert isinstance(w, PackedWeight) and w.shape[:2] == (cfg.num_layers,
                                                               cfg.num_experts), key
    ids = PROMPTS[1]  # 11 + 10 tokens: inside the tiny Mixtral's window of 24
    assert dense_greedy(cfg, model.params, ids, 10) == hf_greedy(fdir, ids, 10)


@pytest.mark.parametrize("symmetric, group", [(True, 32), (False, 32), (False, None)])
def test_compressed_tensors_own_compressor(symmetric, group):
    """compressed-tensors' PackedQuantizationCompressor packs a weight (its quantize, its
    int32 packing); arcjax's reader of its tensors dequantizes to exactly what the
    compressor's own decompress gives."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05  # [out, in]
    cols = w.reshape(48, -1, group or 128)
    scale, zero = calculate_qparams(cols.amin(-1), cols.amax(-1), args)  # [out, G]
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    want = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]

    def get(name):
        key = name.split(".", 1)[1]
        return compressed[key].numpy() if key in compressed else None

    packed = read_pack_quantized(get, "layer", 128, 4, symmetric, "test")
    assert (packed.zero is None) == symmetric
    np.testing.assert_array_equal(np.asarray(_DEQUANTIZE(packed)).T,
                                  want.to(torch.float32).numpy())


def _with_config(qdir: str, edit) -> str:
    """A copy of `qdir` whose quantization_config `edit` changed, its weights unreadable
    (so an error raised before any weight is read is the config's)."""
    out = tempfile.mkdtemp(prefix="arcjax-qcfg-")
    shutil.copy(os.path.join(qdir, "config.json"), out)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg["quantization_config"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def _weights(q):
    return q["config_groups"]["group_0"]["weights"]


REFUSED = [  # (method, edit, field)
    ("awq", lambda q: q.update(version="gemv"), "quantization_config.version"),
    ("awq", lambda q: q.update(bits=3), "quantization_config.bits"),
    ("awq", lambda q: q.update(zero_point=False), "quantization_config.zero_point"),
    ("gptq", lambda q: q.update(bits=3), "quantization_config.bits"),
    ("gptq", lambda q: q.update(checkpoint_format="marlin"),
     "quantization_config.checkpoint_format"),
    ("gptq", lambda q: q.update(dynamic={"-:.*down_proj": {}}), "quantization_config.dynamic"),
    ("gptq", lambda q: q.update(group_size=0), "quantization_config.group_size"),
    ("pack-quantized", lambda q: _weights(q).update(num_bits=3),
     "quantization_config.config_groups.weights.num_bits"),
    ("pack-quantized", lambda q: _weights(q).update(strategy="block"),
     "quantization_config.config_groups.weights.strategy"),
    ("pack-quantized", lambda q: _weights(q).update(type="float"),
     "quantization_config.config_groups.weights.type"),
    ("pack-quantized", lambda q: q["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "quantization_config.config_groups.group_0.input_activations"),
    ("pack-quantized", lambda q: q["config_groups"].update(group_1={
        "targets": ["re:.*down_proj"], "weights": {**_weights(q), "num_bits": 8}}),
     "quantization_config.config_groups"),
    ("pack-quantized", lambda q: q.update(format="marlin-24"), "quantization_config.format"),
]


@pytest.mark.parametrize("method, edit, field", REFUSED,
                         ids=[f"{m}-{f.rsplit('.', 1)[-1]}" for m, _, f in REFUSED])
def test_refused_options_are_typed_errors_before_weights_load(method, edit, field):
    qdir, _ = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), method)
    with pytest.raises(QuantizationConfigError) as err:
        arcjax.LLM(_with_config(qdir, edit))
    assert err.value.field == field
    assert isinstance(err.value, ValueError) and field in str(err.value)


def test_quantization_option_against_a_packed_checkpoint():
    """quantization="fp8" cannot apply to an AWQ checkpoint (typed, naming the option);
    "dequantize" stores its weights in float32, exactly the packed ones."""
    qdir, fdir = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "awq")
    with pytest.raises(EngineConfigError, match="checkpoint is awq") as err:
        load_model(resolve_model(qdir), dtype=jnp.float32, quantization="fp8")
    assert err.value.field == "quantization"
    plain = load_model(resolve_model(qdir), dtype=jnp.float32, quantization="dequantize")
    _, ref = load_hf(fdir)
    for key in LINEAR:
        np.testing.assert_array_equal(np.asarray(plain.params["layers"][key]),
                                      np.asarray(ref["layers"][key]), err_msg=key)
