"""Every variant of the Pallas GPU kernel lowers for CUDA, checked on the CPU.

Interpret mode (tests/test_kernels_pallas_gpu.py) runs the kernel's jaxpr, not
its Triton lowering; this module runs the real lowering with abstract inputs
(`jax.ShapeDtypeStruct`, nothing allocated), so a kernel that only a GPU would
reject fails here. Compiling the Triton IR to PTX is
`scripts/gpu_compile_report.py` (optional `triton` package).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import AttentionInputs, api, gpu_plan, lowering, pallas_gpu
from pallas_kernels import ragged_paged_attention

_UNAVAILABLE = lowering.cuda_lowering_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")

# (group, D, block_size): GQA 1/4/8, D 64/128 and pages of 16/32 each appear.
LAYOUTS = [(1, 64, 16), (4, 128, 32), (8, 128, 16), (8, 64, 32), (4, 64, 16), (1, 128, 32)]
NUM_KV_HEADS, NUM_TOKENS, NUM_SEQS, MAX_BLOCKS = 2, 256, 16, 64


def _abstract_args(group, head_dim, block_size, dtype):
    hq, i32 = NUM_KV_HEADS * group, jnp.int32
    pages = (NUM_SEQS * MAX_BLOCKS, block_size, NUM_KV_HEADS, head_dim)
    return (jax.ShapeDtypeStruct((NUM_TOKENS, hq, head_dim), dtype),
            jax.ShapeDtypeStruct(pages, dtype), jax.ShapeDtypeStruct(pages, dtype),
            jax.ShapeDtypeStruct((NUM_SEQS, MAX_BLOCKS), i32),
            jax.ShapeDtypeStruct((NUM_SEQS,), i32),
            jax.ShapeDtypeStruct((NUM_SEQS + 1,), i32),
            jax.ShapeDtypeStruct((), i32))


ARRAYS = ("q", "k_pages", "v_pages", "block_tables", "kv_lens", "cu_seqlens_q", "num_seqs")


def _inputs(args, **settings) -> AttentionInputs:
    """The abstract arguments (in `ragged_paged_attention`'s order) as one call's inputs."""
    return AttentionInputs.create(**dict(zip(ARRAYS, args, strict=True)), **settings)


def _plan(group, head_dim, block_size, *, max_q_len, **tuning):
    return gpu_plan.make_gpu_plan(
        num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, num_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, page_size=block_size,
        max_blocks=MAX_BLOCKS, max_q_len=max_q_len, **tuning)


def _lower(plan, args, head_dim) -> str | None:
    """Lowers one kernel variant; returns its Triton IR, or None if this jax hides it."""
    with lowering.capture_triton_ir() as modules:
        text = lowering.lower_for_cuda(pallas_gpu.ragged_paged_attention_pallas_gpu,
                                       _inputs(args, sm_scale=head_dim**-0.5), plan=plan)
    assert lowering.triton_kernel_calls(text) == 1  # one Triton kernel, no XLA fallback
    assert len(modules) <= 1
    return modules[0].ir if modules else None


# NOTE: the Triton IR comes through a jax-internal hook (capture_triton_ir). Should a
# newer jax move it, the lowering checks still run and only the IR checks skip, saying so.
IR_HIDDEN = "this jax's Pallas Triton lowering hook moved: update lowering.capture_triton_ir"


# Each kind names the plan it must produce, so a heuristic change cannot silently drop one.
KINDS = {
    "mixed": dict(max_q_len=NUM_TOKENS, num_splits=1),
    "mixed_split": dict(max_q_len=NUM_TOKENS, num_splits=4),
    "decode_split": dict(max_q_len=1),
    "decode_nosplit": dict(max_q_len=1, num_splits=1),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"g{g}-d{d}-bs{b}" for g, d, b in LAYOUTS])
def test_kernel_variant_lowers_for_cuda(layout, kind, dtype):
    group, head_dim, block_size = layout
    plan = _plan(group, head_dim, block_size, itemsize=jnp.dtype(dtype).itemsize, **KINDS[kind])
    assert (plan.num_splits > 1) == kind.endswith("_split"), plan
    ir = _lower(plan, _abstract_args(group, head_dim, block_size, dtype), head_dim)
    if ir is None:
        pytest.skip(IR_HIDDEN)
    dots = [line for line in ir.splitlines() if "tt.dot " in line]
    assert dots, "no tt.dot in the kernel"
    if dtype == jnp.float32:  # the precision rule: f32 inputs take 3xTF32, never TF32
        assert all("inputPrecision = tf32x3" in line for line in dots), dots


@pytest.mark.parametrize("block_m, block_k", [(64, 64), (128, 32), (128, 64)])
def test_prefill_tilings_lower(block_m, block_k):
    plan = _plan(4, 128, 16, max_q_len=NUM_TOKENS, block_m=block_m, block_k=block_k)
    assert plan.rows == block_m and plan.tiles.block_k == block_k
    _lower(plan, _abstract_args(4, 128, 16, jnp.bfloat16), 128)


@pytest.mark.parametrize("max_q_len", [None, 1], ids=["auto-mixed", "auto-decode"])
def test_public_entry_point_lowers(max_q_len):
    # Through validation and dispatch, as the engine calls it.
    args = _abstract_args(4, 128, 16, jnp.bfloat16)
    text = lowering.lower_for_cuda(ragged_paged_attention, *args, impl="pallas_gpu",
                                   max_q_len=max_q_len)
    assert lowering.triton_kernel_calls(text) == 1
    # The xla path (what "auto" picks without a GPU) lowers for CUDA too, without Triton.
    text = lowering.lower_for_cuda(ragged_paged_attention, *args, impl="xla",
                                   max_q_len=max_q_len)
    assert lowering.triton_kernel_calls(text) == 0


def test_lowering_a_broken_kernel_fails():
    # The check can fail: Triton tiles must be powers of two, and the lowering says so.
    plan = _plan(1, 64, 16, max_q_len=NUM_TOKENS)
    bad = dataclasses.replace(plan, rows=48)
    with pytest.raises(Exception, match="power of 2"):
        _lower(bad, _abstract_args(1, 64, 16, jnp.bfloat16), 64)


def test_every_axis_value_is_covered():
    groups, dims, pages = (set(axis) for axis in zip(*LAYOUTS))
    assert groups == {1, 4, 8} and dims == {64, 128} and pages == {16, 32}


def test_triton_ir_is_captured_where_known_to_work():
    ir = _lower(_plan(4, 128, 16, max_q_len=NUM_TOKENS),
                _abstract_args(4, 128, 16, jnp.bfloat16), 128)
    version = tuple(int(part) for part in jax.__version__.split(".")[:3])
    if ir is None and version > (0, 10, 2):
        pytest.skip(IR_HIDDEN)
    assert ir is not None and "tt.func" in ir and "tt.dot" in ir


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", ["mixed_split", "decode_split"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["window", "window-softcap"])
def test_sliding_window_and_softcap_variants_lower(kind, dtype, softcap):
    # The window is traced (one executable for every layer of a local/global model).
    plan = _plan(4, 128, 16, itemsize=jnp.dtype(dtype).itemsize, **KINDS[kind])

    inputs = _inputs(_abstract_args(4, 128, 16, dtype), sm_scale=128**-0.5,
                     sliding_window=jax.ShapeDtypeStruct((), jnp.int32), logit_softcap=softcap)
    with lowering.capture_triton_ir() as modules:
        text = lowering.lower_for_cuda(pallas_gpu.ragged_paged_attention_pallas_gpu, inputs,
                                       plan=plan)
    assert lowering.triton_kernel_calls(text) == 1
    if not modules:
        pytest.skip(IR_HIDDEN)
    ir = modules[0].ir
    assert ir.count("scf.for") == 3  # the window's left edge, the middle, the diagonal
    assert ("tanh" in ir) == (softcap is not None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("max_q_len", [1, NUM_TOKENS], ids=["decode", "mixed"])
def test_batch_invariant_kernel_lowers(max_q_len, dtype):
    # The batch-invariant plan (one plan per cache geometry, no split-K, every key step
    # masked), through the dispatch as the decoder calls it, with a window and a soft-cap.
    inputs = _inputs(_abstract_args(4, 64, 16, dtype), sm_scale=64**-0.5,
                     sliding_window=jax.ShapeDtypeStruct((), jnp.int32), logit_softcap=30.0,
                     max_q_len=max_q_len, batch_invariant=True)
    plan = api.gpu_plan_for(inputs, batch_invariant=True)
    assert plan.num_splits == 1 and plan.all_masked
    with lowering.capture_triton_ir() as modules:
        text = lowering.lower_for_cuda(api.paged_attention, inputs, impl="pallas_gpu")
    assert lowering.triton_kernel_calls(text) == 1
    if not modules:
        pytest.skip(IR_HIDDEN)
    assert modules[0].ir.count("tt.dot ") >= 2
