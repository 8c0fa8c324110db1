"""The W4A16 kernel inside the engine's step (arcjax/model/packed_matmul.py): an AWQ model
served with the kernel in Pallas' interpreter gives transformers' greedy tokens on the
dequantized weights, the kernel taking every packed projection of the decode-sized matmuls
and XLA the wider ones; the real step lowers for CUDA on the CPU with one kernel launch per
packed projection in decode buckets and none in prefill buckets; "auto" picks the kernel
only on a GPU with one device and packed weights in its layout; a kernel the platform or a
mesh cannot run is refused by name."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax import LLM, SamplingParams
from arcjax.bench.packed_checkpoints import packed_checkpoint
from arcjax.errors import EngineConfigError
from arcjax.model import packed_matmul
from arcjax.model.binding import LAYER_STACKS
from arcjax.model.layer_arrays import split_layers
from arcjax.model.formats.hub import resolve_model
from arcjax.model.formats.loader import load_model
from arcjax.model.specs import cache_specs, is_spec
from arcjax.runtime import step_program
from arcjax.runtime.batching import empty_batch
from arcjax.runtime.buckets import BucketSet
from arcjax.runtime.penalties import TokenTables
from arcjax.runtime.sampling import SamplingBatch, bitmask_words
from pallas_kernels import lowering
from pallas_kernels.w4a16 import MAX_ROWS
from support.hf_models import hf_greedy, tiny_model_dir

MAX_TOKENS = 6
PROJECTIONS = 7  # q, k, v, o, gate, up, down: each layer's packed matmuls


def _awq():
    return packed_checkpoint(tiny_model_dir("LlamaForCausalLM"), "awq")  # (packed, float)


def test_step_with_the_kernel_equals_transformers(monkeypatch):
    """Prompts of 3 and 20 tokens: the prefill step (wider than MAX_ROWS) runs XLA's
    dequantize-then-dot, the decode steps the kernel (its calls recorded as traced)."""
    qdir, fdir = _awq()
    rows = []

    def recording(x, *args, **kwargs):
        rows.append(x.shape[0])
        return kernel(x, *args, **kwargs)

    kernel = packed_matmul.w4a16_matmul
    monkeypatch.setattr(packed_matmul, "w4a16_matmul", recording)
    rs = np.random.RandomState(5)
    prompts = [rs.randint(3, 384, n).tolist() for n in (3, 20)]
    llm = LLM(qdir, packed_matmul_impl="w4a16_interpret", block_size=8, num_kv_blocks=64,
              max_model_len=128, max_num_seqs=4, attention_impl="auto", chunk_tile=16,
              max_num_batched_tokens=64, async_scheduling=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [hf_greedy(fdir, p, MAX_TOKENS)
                                                 for p in prompts]
    summary = llm.trace_summary(1.0)
    assert summary["packed_matmul"] == "w4a16_interpret" and summary["weight_dtype"] == "awq"
    assert rows and max(rows) <= MAX_ROWS and len(rows) % PROJECTIONS == 0
    widths = {r.bucket[0] for r in llm.engine.trace}  # (tokens, seqs, max_q_len)
    assert max(widths) > MAX_ROWS  # some step was wider: it took XLA


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_step_lowers_for_cuda_with_the_kernel_in_decode_buckets():
    unavailable = lowering.cuda_lowering_unavailable()
    if unavailable is not None:
        pytest.skip(unavailable)
    model = load_model(resolve_model(_awq()[0]), dtype=jnp.bfloat16)
    cfg, params = model.cfg, _abstract(model.params)
    cache = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16),
                         cache_specs(cfg, 32, 16), is_leaf=is_spec)
    buckets = BucketSet.create(tile=64, max_tokens=128, max_seqs=8).all()
    decode = min(buckets, key=lambda b: b.tokens)
    prefill = min((b for b in buckets if b.tokens > MAX_ROWS), key=lambda b: b.tokens)
    assert decode.tokens <= MAX_ROWS < prefill.tokens
    for bucket, launches in ((decode, PROJECTIONS), (prefill, 0)):
        tables = (bucket.seqs + 1, cfg.vocab_size)
        text = lowering.lower_for_cuda(
            step_program.step.__wrapped__, params, cache,
            _abstract(empty_batch(bucket, max_blocks=8, block_size=16, num_blocks=32)),
            _abstract(SamplingBatch.build([], bucket.seqs, bucket.seqs)),
            TokenTables(jax.ShapeDtypeStruct(tables, jnp.int32),
                        jax.ShapeDtypeStruct(tables, jnp.float32)),
            jax.ShapeDtypeStruct((bucket.seqs, bitmask_words(cfg.vocab_size)), jnp.int32),
            cfg=cfg, attn_impl="xla", dtype=jnp.bfloat16, max_q_len=bucket.max_q_len,
            matmul_impl="w4a16")
        # each packed projection calls the kernel (calls of one shape share its function)
        assert len(re.findall(r"\bcall @w4a16_matmul\w*\(", text)) == launches, bucket
        assert (lowering.triton_kernel_calls(text) > 0) == (launches > 0), bucket


def test_auto_picks_the_kernel_only_on_one_gpu_with_packed_weights():
    packed = load_model(resolve_model(_awq()[0]), dtype=jnp.float32).params
    float_params = load_model(resolve_model(_awq()[1]), dtype=jnp.float32).params
    assert packed_matmul.kernel_weights(packed) == ("wq", "wk", "wv", "wo", "w_gate",
                                                    "w_up", "w_down")
    assert packed_matmul.kernel_weights(float_params) == ()
    # the same weights held one array per layer (the unrolled layer loop)
    held = split_layers(packed, LAYER_STACKS, frozenset())
    assert packed_matmul.kernel_weights(held) == packed_matmul.kernel_weights(packed)
    resolve = packed_matmul.resolve_impl
    assert resolve("auto", packed, platform="gpu", parallel=False) == "w4a16"
    assert resolve("auto", packed, platform="gpu", parallel=True) == "xla"
    assert resolve("auto", packed, platform="cpu", parallel=False) == "xla"
    assert resolve("auto", float_params, platform="gpu", parallel=False) == "xla"
    assert resolve("w4a16_interpret", packed, platform="cpu", parallel=False) == (
        "w4a16_interpret")


def test_a_kernel_that_cannot_run_here_is_refused_by_name():
    qdir, _ = _awq()
    for options in ({"packed_matmul_impl": "w4a16"},  # the CPU
                    {"packed_matmul_impl": "w4a16_interpret", "tensor_parallel_size": 2},
                    {"packed_matmul_impl": "marlin"}):
        with pytest.raises(EngineConfigError) as err:
            LLM(qdir, **options)
        assert err.value.field == "packed_matmul_impl", options
