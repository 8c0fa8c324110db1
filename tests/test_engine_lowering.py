"""Every bucket of the engine's step lowers for CUDA with a GPU attention kernel, on the CPU.

The whole jitted step (embedding, the layer scan with `write_kv` and ragged paged attention,
the LM head at the sampled rows, on-device sampling) is lowered with abstract inputs for a
small Llama-shaped model in bfloat16, so a lowering regression anywhere in the step shows up
without a GPU. The Triton kernel (impl="triton") is covered where jax_triton can lower
`triton_call` here: it needs jaxlib's CUDA plugin (jax-triton 0.3 refuses to import without
it), so on a CPU-only jaxlib that case is skipped and says why.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import cache_specs, is_spec, param_specs
from arcjax.runtime import step_program
from arcjax.runtime.batching import empty_batch
from arcjax.runtime.buckets import BucketSet
from arcjax.runtime.penalties import TokenTables
from arcjax.runtime.sampling import SamplingBatch, bitmask_words
from arcjax.runtime.verification import SpecInputs
from pallas_kernels import backends, lowering

_UNAVAILABLE = lowering.cuda_lowering_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")

CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 64, 32
MAX_SEQS = 16
BUCKETS = BucketSet.create(tile=64, max_tokens=256, max_seqs=MAX_SEQS)


def _abstract(tree, dtype=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype), tree)


def _abstract_specs(specs, dtype):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)


def _token_tables() -> TokenTables:
    """The step's penalty count table and logit-bias table, abstract (runtime/penalties.py)."""
    shape = (MAX_SEQS + 1, CFG.vocab_size)
    return TokenTables(jax.ShapeDtypeStruct(shape, jnp.int32),
                       jax.ShapeDtypeStruct(shape, jnp.float32))


IMPLS = ["pallas_gpu", pytest.param("triton", marks=pytest.mark.skipif(
    backends.triton_unavailable() is not None, reason=f"triton: {backends.triton_unavailable()}"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bucket", BUCKETS.all(), ids=str)
def test_every_engine_bucket_lowers_with_a_gpu_kernel(bucket, impl):
    dtype = jnp.bfloat16
    params = _abstract_specs(param_specs(CFG), dtype)
    cache = _abstract_specs(cache_specs(CFG, NUM_BLOCKS, BLOCK_SIZE), dtype)
    batch = _abstract(empty_batch(bucket, max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE,
                                  num_blocks=NUM_BLOCKS))
    sampling = _abstract(SamplingBatch.build([], bucket.seqs, MAX_SEQS))
    counts = _token_tables()
    bitmask = jax.ShapeDtypeStruct((bucket.seqs * bucket.sample_width,
                                    bitmask_words(CFG.vocab_size)), jnp.int32)
    text = lowering.lower_for_cuda(step_program.step.__wrapped__, params, cache, batch, sampling,
                                   counts, bitmask, cfg=CFG, attn_impl=impl, dtype=dtype,
                                   max_q_len=bucket.max_q_len)
    assert lowering.triton_kernel_calls(text) >= 1, "attention did not lower to the kernel"


SPEC_BUCKETS = [b for b in BucketSet.create(tile=64, max_tokens=256, max_seqs=MAX_SEQS,
                                            spec_width=4).all() if b.sample_width > 1]


@pytest.mark.parametrize("bucket", [SPEC_BUCKETS[0], SPEC_BUCKETS[-1]], ids=str)
def test_verification_buckets_lower_with_drafts_and_masks(bucket):
    """Speculative decoding's verification step (W positions per sequence, drafts, a grammar
    mask per position) lowers with the Pallas GPU kernel too."""
    dtype = jnp.bfloat16
    rows = bucket.num_samples
    params = _abstract_specs(param_specs(CFG), dtype)
    cache = _abstract_specs(cache_specs(CFG, NUM_BLOCKS, BLOCK_SIZE), dtype)
    batch = _abstract(empty_batch(bucket, max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE,
                                  num_blocks=NUM_BLOCKS))
    batch = dataclasses.replace(batch, logits_rows=jax.ShapeDtypeStruct((rows,), jnp.int32))
    sampling = _abstract(SamplingBatch.build([], rows, MAX_SEQS))
    counts = _token_tables()
    bitmask = jax.ShapeDtypeStruct((rows, bitmask_words(CFG.vocab_size)), jnp.int32)
    spec = SpecInputs(jax.ShapeDtypeStruct((rows,), jnp.int32),
                      jax.ShapeDtypeStruct((rows,), jnp.bool_))
    text = lowering.lower_for_cuda(step_program.step.__wrapped__, params, cache, batch, sampling,
                                   counts, bitmask, None, spec, cfg=CFG, attn_impl="pallas_gpu",
                                   dtype=dtype, max_q_len=bucket.max_q_len,
                                   sample_width=bucket.sample_width)
    assert lowering.triton_kernel_calls(text) >= 1, "attention did not lower to the kernel"
