"""The attention inputs of every engine bucket, replayed through the interpreted Triton kernel.

A CPU run of a tiny Llama (xla attention) records, for every bucket its steps used, the
inputs and output of one attention call (the step with the most live sequences): real
block tables, ragged chunks, decode rows, bucket padding, a cache holding every layer's
pages. Each is replayed through `impl="triton", interpret=True` (Triton's own
interpreter) and must match what the xla path computed in the engine.
"""

import functools
import importlib.util

import jax
import numpy as np
import pytest

import pallas_kernels
from arcjax import LLM, SamplingParams
from arcjax.runtime.buckets import BucketSet
from pallas_kernels import gpu_plan
from support.hf_models import tiny_model_dir

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("triton", "torch")),
    reason="Triton's interpreter needs triton and torch (the test extra)")

TILE, MAX_TOKENS, MAX_SEQS = 16, 16, 8
# NOTE: num_kv_blocks is one no other test uses, so the engine's steps compile afresh here
# (compiled steps are shared by cache shape) and the capturing attention is traced.
# max_model_len 64: 8 table columns, so decode rows split their keys in 2 (split-K runs)
# and the interpreter walks half the programs 128 would give.
ENGINE = dict(attention_impl="xla", chunk_tile=TILE, max_num_batched_tokens=MAX_TOKENS,
              max_num_seqs=MAX_SEQS, policy="token_budget", block_size=8, num_kv_blocks=61,
              max_model_len=64)
PROMPT_LENS = (3, 9, 5, 2, 4, 6, 1, 3)  # all prefilled within a few 16-token steps
MAX_NEW = (2, 12, 4, 8, 10, 6, 14, 16)  # then 8 decode rows, finishing one by one


def _bucket_key(q, block_tables, max_q_len):
    return (q.shape[0], block_tables.shape[0], max_q_len)


@pytest.fixture(scope="module")
def captured():
    """{(T, S, max_q_len): (inputs, xla output)} from one engine run."""
    real = pallas_kernels.paged_attention
    calls: dict[tuple, tuple] = {}

    def record(key, *arrays):
        num_seqs = int(arrays[6])
        if key not in calls or int(calls[key][0][6]) < num_seqs:
            calls[key] = (tuple(np.asarray(a) for a in arrays[:7]), np.asarray(arrays[7]))

    def capturing(inputs, **kw):  # the decoder's one attention call per layer
        out = real(inputs, **kw)
        key = _bucket_key(inputs.q, inputs.block_tables, inputs.max_q_len)
        jax.debug.callback(lambda *a: record(key, *a), inputs.q, inputs.k_pages,
                           inputs.v_pages, inputs.block_tables, inputs.kv_lens,
                           inputs.cu_seqlens_q, inputs.num_seqs, out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pallas_kernels, "paged_attention", capturing)
        llm = LLM(tiny_model_dir("LlamaForCausalLM"), **ENGINE)
        rs = np.random.RandomState(5)
        prompts = [rs.randint(3, 384, n).tolist() for n in PROMPT_LENS]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
        llm.generate(prompts, params, use_tqdm=False)
    return calls


def test_every_bucket_was_captured(captured):
    buckets = BucketSet.create(tile=TILE, max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS).all()
    assert set(captured) == {(b.tokens, b.seqs, b.max_q_len) for b in buckets}


def test_replayed_buckets_match_the_xla_path(captured):
    for key, (args, xla_out) in sorted(captured.items()):
        plan = gpu_plan.make_gpu_plan(
            num_tokens=key[0], num_seqs=key[1], num_heads=args[0].shape[1],
            num_kv_heads=args[1].shape[2], head_dim=args[0].shape[2],
            page_size=args[1].shape[1], max_blocks=args[3].shape[1], max_q_len=key[2],
            itemsize=args[0].dtype.itemsize)
        if key[2] == 1:  # decode buckets: each decode row's keys are split across programs
            assert plan.num_splits > 1, key
        # jitted: one compile per bucket instead of one per eager operation and shape
        out = np.asarray(jax.jit(functools.partial(
            pallas_kernels.ragged_paged_attention, impl="triton", interpret=True,
            max_q_len=key[2]))(*args))
        real = int(args[5][int(args[6])])
        assert not np.isnan(out).any(), key
        np.testing.assert_array_equal(out[real:], 0.0, err_msg=str(key))
        np.testing.assert_allclose(out, xla_out, atol=5e-5, rtol=5e-5, err_msg=str(key))
