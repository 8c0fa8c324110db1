"""The W4A16 Pallas kernel (pallas_kernels/w4a16.py): interpret mode against its oracle over
shapes, group sizes, zero-point kinds, K splits and dtypes; against the packed weights the
formats load (GGUF Q4_1, AWQ); and its real Triton lowering for CUDA, checked on the CPU
over decode shapes (one kernel launch, tensor-core dots)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.bench.packed_checkpoints import packed_checkpoint
from arcjax.model.formats.hub import resolve_model
from arcjax.model.formats.loader import load_model
from arcjax.model.packed import w4a16_operands
from arcjax.model.quant import dense
from support.gguf_files import tiny_gguf_model_dir, write_gguf
from support.hf_models import tiny_model_dir
from pallas_kernels import lowering
from pallas_kernels.kernel_errors import KernelArgumentError
from pallas_kernels.w4a16 import W4A16Plan, plan_w4a16, w4a16_matmul, w4a16_reference

# (M, K, N, group, zero kind, dtype, splits)
CASES = [(1, 256, 64, 32, "zero", jnp.bfloat16, None),
         (5, 192, 48 * 4, 64, "offset", jnp.float32, 3),
         (16, 512, 128, 128, "shift", jnp.bfloat16, 2),
         (3, 128, 32, 16, "zero", jnp.float16, 1)]


def _operands(k: int, n: int, group: int, kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    qweight = rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint64).astype(np.uint32)
    g = k // group
    return dict(qweight=jnp.asarray(qweight),
                scale=jnp.asarray(rng.normal(size=(g, n)) * 0.02, jnp.float16),
                zero=jnp.asarray(rng.integers(0, 16, (g, n)), jnp.uint8) if kind == "zero"
                else None,
                offset=jnp.asarray(rng.normal(size=(g, n)) * 0.02, jnp.float16)
                if kind == "offset" else None,
                group=group, shift=8 if kind == "shift" else 0)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if jnp.dtype(dtype) == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same products summed in another order: an ulp of the output dtype
        ulp = 2.0 ** -7 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -10
        np.testing.assert_allclose(got, want, rtol=2 * ulp, atol=2 * ulp * np.abs(want).max())


@pytest.mark.parametrize("m, k, n, group, kind, dtype, splits", CASES)
def test_interpret_matches_the_oracle(m, k, n, group, kind, dtype, splits):
    ops = _operands(k, n, group, kind)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(m, k)), dtype)
    plan = plan_w4a16(m, k, n, group, splits=splits)
    got = w4a16_matmul(x, **ops, plan=plan, interpret=True)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, w4a16_reference(x, **ops), dtype)


@pytest.mark.parametrize("source", ["gguf-q4_1", "awq"])
def test_kernel_on_loaded_packed_weights(source):
    """The kernel's operands come straight from a loaded packed weight (Q4_1's mins as
    offsets, AWQ's zero points): x @ the weight as the XLA path computes it."""
    if source == "awq":
        path, _ = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "awq")
    else:
        path = write_gguf(tiny_gguf_model_dir("LlamaForCausalLM"), "Q4_1")
    layers = load_model(resolve_model(path), dtype=jnp.float32).params["layers"]
    w = layers["w_up"].map_arrays(lambda a: a[0])  # [in, out]
    ops = w4a16_operands(w)
    assert ops is not None
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, w.shape[0])), jnp.float32)
    got = w4a16_matmul(x, **ops, interpret=True)
    want = jnp.dot(x, dense(w, jnp.float32), precision=jax.lax.Precision.HIGHEST)
    _close(got, want, jnp.float32)


def test_operands_only_for_one_group_ordered_4_bit_plane():
    eight, _ = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "gptq", bits=8)
    act, _ = packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "gptq", desc_act=True)
    for path in (eight, act):
        w = load_model(resolve_model(path), dtype=jnp.float32).params["layers"]["wq"]
        assert w4a16_operands(w.map_arrays(lambda a: a[0])) is None


def test_bad_shapes_are_typed_errors():
    with pytest.raises(KernelArgumentError) as err:
        plan_w4a16(1, 256, 24, 32)
    assert err.value.argument == "qweight"
    with pytest.raises(KernelArgumentError) as err:
        plan_w4a16(1, 256, 64, 48)
    assert err.value.argument == "scale"
    ops = _operands(256, 64, 32, "zero")
    with pytest.raises(KernelArgumentError) as err:
        w4a16_matmul(jnp.ones((2, 128), jnp.bfloat16), **ops, interpret=True)
    assert err.value.argument == "qweight"


_UNAVAILABLE = lowering.cuda_lowering_unavailable()
# decode shapes: SmolLM2-135M's projections (576 / 1536 wide) and an 8B model's 4096
DECODE_SHAPES = [(1, 576, 576), (8, 576, 1536), (16, 1536, 576), (1, 4096, 4096)]


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")
@pytest.mark.parametrize("kind", ["zero", "offset", "shift"])
@pytest.mark.parametrize("m, k, n", DECODE_SHAPES)
def test_lowers_for_cuda(m, k, n, kind):
    group = 32 if kind == "offset" else 128 if k % 128 == 0 else 64
    ops = _operands(k, n, group, kind)
    args = [jax.ShapeDtypeStruct(ops[name].shape, ops[name].dtype)
            for name in ("qweight", "scale", "zero", "offset") if ops[name] is not None]
    names = [name for name in ("qweight", "scale", "zero", "offset") if ops[name] is not None]
    plan = plan_w4a16(m, k, n, group)
    assert isinstance(plan, W4A16Plan) and plan.block_m == 16

    def call(x, *arrays):
        return w4a16_matmul(x, **dict(zip(names, arrays)), group=group, shift=ops["shift"])

    with lowering.capture_triton_ir() as modules:
        text = lowering.lower_for_cuda(call, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                       *args)
    assert lowering.triton_kernel_calls(text) == 1
    if modules:  # (this jax's hook may hide the IR: tests/test_gpu_lowering.py says so)
        assert any("tt.dot " in line for line in modules[0].ir.splitlines())
