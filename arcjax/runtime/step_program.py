"""The traced programs of a step: what `ModelRunner` (`runner.py`) compiles per bucket.

`step` is the forward over a ragged batch plus sampling (and verification of drafts) in one
program; `forward` and `sample` are its two halves, for a step whose bitmask is not known at
launch; `feed` puts tokens the previous step sampled on the device into the next step's
input ids. Every argument named in `STATIC_ARGS` is static: one executable per bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from arcjax.model import decoder
from arcjax.model.model_config import ModelConfig
from arcjax.model.row_tiles import RowTiles
from arcjax.runtime import verification
from arcjax.runtime.pooling_inputs import pool_rows
from arcjax.runtime.sampling import TokenLogprobs, sample_step, token_logprobs
from arcjax.runtime.step_output import StepOutput


STATIC_ARGS = ("cfg", "attn_impl", "dtype", "max_q_len", "parallel", "kv", "lora_impl",
               "matmul_impl", "batch_invariant", "layer_loop")


def model_outputs(params, cache, batch, prompt, pooling, lora, *, cfg, attn_impl, dtype,
                  max_q_len, parallel, kv, lora_impl, matmul_impl, batch_invariant,
                  layer_loop):
    """The forward: (logits [R, V] at the sampled positions, prompt logprobs or None, pooled
    sums [S, H] or None, the cache, tokens per expert [L, E] or None). `lora`: the adapters'
    `LoRAWeights`, or None. `batch_invariant`: fixed row tiles (`decoder.forward_with_stats`)."""
    every_row = prompt is not None or pooling is not None
    out, cache, expert_counts = decoder.forward_with_stats(
        params, cache, batch, cfg=cfg, attn_impl=attn_impl, dtype=dtype, max_q_len=max_q_len,
        parallel=parallel, head=not every_row, kv=kv, lora=lora, lora_impl=lora_impl,
        matmul_impl=matmul_impl, batch_invariant=batch_invariant, layer_loop=layer_loop)
    if not every_row:  # [R, V] at `batch.logits_rows`
        return out, None, None, cache, expert_counts
    # hidden states at every token row [T, H]; sampling reads its rows
    sample_rows = (prompt if prompt is not None else pooling).sample_rows
    head = functools.partial(decoder.lm_head, params, cfg, parallel=parallel,
                             matmul_impl=matmul_impl)
    if prompt is None:
        prompt_lp = None
    elif batch_invariant:
        prompt_lp = decoder.token_rows(batch).map(lambda h, t: token_logprobs(head(h), t), out,
                                                  prompt.targets)
    else:
        prompt_lp = prompt_logprobs(params, cfg, out, prompt.targets, parallel)
    pooled = (None if pooling is None
              else pool_rows(params, cfg, out, pooling, batch.kv_lens.shape[0]))
    hidden = out[sample_rows]
    logits = (decoder.head_rows(batch, hidden.shape[0]).map(head, hidden) if batch_invariant
              else head(hidden))
    return logits, prompt_lp, pooled, cache, expert_counts


def sampled(logits, sampling, counts, bitmask, spec, sample_width, rows=None):
    """(tokens [R], tokens each sequence yields [S] or None, logprobs, count table).
    `rows`: the live positions' fixed tiles (batch-invariant mode), or None."""
    if spec is None:
        tokens, logprobs, counts = sample_step(logits, sampling, counts, bitmask, rows)
        return tokens, None, logprobs, counts
    return verification.verify(logits, sampling, spec, counts, sample_width, bitmask, rows)


def sample_tiles(num_seqs, sample_width: int, batch_invariant: bool) -> RowTiles | None:
    """The sampled positions' fixed tiles in batch-invariant mode (the real sequences'
    positions live), else None."""
    return RowTiles(num_seqs * sample_width) if batch_invariant else None


@functools.partial(jax.jit, static_argnames=(*STATIC_ARGS, "sample_width"),
                   donate_argnames=("cache", "counts"))
def step(params, cache, batch, sampling, counts, bitmask, prompt=None, spec=None,
         pooling=None, lora=None, *, cfg, attn_impl, dtype, max_q_len, parallel=None, kv=None,
         sample_width=1, lora_impl="masked", matmul_impl="xla", batch_invariant=False,
         layer_loop="scan"):
    # cfg/attn_impl/dtype/max_q_len/parallel/kv/sample_width/lora_impl/matmul_impl are
    # static: one executable per bucket, no recompiles from the traced metadata (num_seqs, kv_lens,
    # ...). `prompt` (prompt logprobs) is None or not: at most a second executable per
    # bucket, built on demand; so is `pooling` (a step with pooling rows: the pooled sums
    # of their hidden states). `spec` (draft tokens to verify) is set exactly in buckets of
    # sample_width > 1. `bitmask` [R, ceil(V / 32)] int32 is always an input (all ones for
    # unconstrained rows): structured outputs need no other executable. `lora` (LoRA
    # adapters' slots and each token's slot) is None, or an input of every step: adapters
    # change no executable. `batch_invariant`: every row computed alike whatever else the
    # step holds (fixed row tiles; docs/design/batch-invariance.md). `layer_loop`: the
    # bucket's layer loop, "scan" or "unrolled" (arcjax/model/layer_arrays.py).
    logits, prompt_lp, pooled, cache, experts = model_outputs(
        params, cache, batch, prompt, pooling, lora, cfg=cfg, attn_impl=attn_impl, dtype=dtype,
        max_q_len=max_q_len, parallel=parallel, kv=kv, lora_impl=lora_impl,
        matmul_impl=matmul_impl, batch_invariant=batch_invariant, layer_loop=layer_loop)
    tokens, yielded, logprobs, counts = sampled(
        logits, sampling, counts, bitmask, spec, sample_width,
        sample_tiles(batch.num_seqs, sample_width, batch_invariant))
    return (StepOutput(tokens, logprobs, prompt_lp, num_yielded=yielded,
                       expert_counts=experts, pooled=pooled), cache, counts)


@functools.partial(jax.jit, static_argnames=STATIC_ARGS, donate_argnames=("cache",))
def forward(params, cache, batch, prompt=None, pooling=None, lora=None, *, cfg, attn_impl,
            dtype, max_q_len, parallel=None, kv=None, lora_impl="masked",
            matmul_impl="xla", batch_invariant=False, layer_loop="scan"):
    """`step` without its sampling: for a step whose bitmask is not known at launch."""
    return model_outputs(params, cache, batch, prompt, pooling, lora, cfg=cfg,
                         attn_impl=attn_impl, dtype=dtype, max_q_len=max_q_len,
                         parallel=parallel, kv=kv, lora_impl=lora_impl,
                         matmul_impl=matmul_impl, batch_invariant=batch_invariant,
                         layer_loop=layer_loop)


@functools.partial(jax.jit, static_argnames=("sample_width", "batch_invariant"),
                   donate_argnames=("counts",))
def sample(logits, sampling, counts, bitmask, spec=None, num_seqs=None, *, sample_width=1,
           batch_invariant=False):
    """`step`'s sampling (and verification) alone, after `forward`; `num_seqs` (the
    step's real sequences) only in batch-invariant mode."""
    return sampled(logits, sampling, counts, bitmask, spec, sample_width,
                   sample_tiles(num_seqs, sample_width, batch_invariant))


PROMPT_LOGPROB_ROWS = 128  # rows whose [rows, V] logits exist at once in a prompt-logprobs step


def prompt_logprobs(params, cfg: ModelConfig, hidden, targets, parallel) -> TokenLogprobs:
    """Log-probabilities of `targets` [T] after each row of `hidden` [T, H], a block of
    PROMPT_LOGPROB_ROWS rows at a time: never [T, V] logits at once (a 256k vocabulary at
    T = 2048 would be 2 GiB of float32)."""
    t = hidden.shape[0]
    rows = min(PROMPT_LOGPROB_ROWS, t)
    pad = -t % rows
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, rows, hidden.shape[-1])
    ids = jnp.pad(targets, (0, pad)).reshape(-1, rows)
    out = jax.lax.map(lambda x: token_logprobs(decoder.lm_head(params, cfg, x[0], parallel),
                                               x[1]), (h, ids))
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:t], out)


@jax.jit
def feed(token_ids, prev_tokens, rows, positions):
    """Input ids [T] with row t replaced by `prev_tokens[positions[t]]` wherever rows[t]
    (prev_tokens: [R], the previous step's sampled positions; see `TokenFeed`)."""
    return jnp.where(rows, prev_tokens[positions], token_ids)
