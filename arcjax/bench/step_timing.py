"""One paged model step, timed: what scripts/bench_moe.py and scripts/bench_quant.py share.

`step_call(cfg, params, starts, lengths, ...)` builds the batch of one step (sequence i has
`starts[i]` tokens cached and runs `lengths[i]` new ones: a decode row is length 1) and
returns a zero-argument call running `decoder.forward_with_stats` on it, KV cache donated,
no sampling. `time_round_robin(calls, iters)` runs several such calls in turn, each run
synchronized, and reports each one's median: load that drifts during a run hits every
call alike.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.model import decoder
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import make_cache
from arcjax.runtime.batching import build_batch
from arcjax.runtime.buckets import Bucket

BLOCK = 16  # tokens per KV block


def paged_batch(starts, lengths, num_blocks: int, max_blocks: int, vocab: int = 4096):
    """(StepBatch on the device, max_q_len) of one step over fresh block tables."""
    n = len(starts)
    tables, nxt = [], 0
    for s, ln in zip(starts, lengths):
        need = -(-(s + ln) // BLOCK)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    tokens = sum(lengths)
    decode = all(ln == 1 for ln in lengths)
    bucket = Bucket(tokens, n, 1 if decode else tokens)
    rng = np.random.default_rng(0)
    batch = build_batch(rng.integers(0, vocab, tokens).tolist(), starts, lengths, tables,
                        bucket=bucket, max_blocks=max_blocks, block_size=BLOCK,
                        num_blocks=num_blocks)
    return jax.tree.map(jnp.asarray, batch), bucket.max_q_len


def blocks_needed(starts, lengths) -> tuple[int, int]:
    """(num_blocks, max_blocks) a step over these sequences needs."""
    max_blocks = -(-max(s + ln for s, ln in zip(starts, lengths)) // BLOCK)
    num_blocks = -(-sum(s + ln for s, ln in zip(starts, lengths)) // BLOCK) + len(starts)
    return num_blocks, max_blocks


def step_call(cfg: ModelConfig, params, starts, lengths, *, num_blocks: int,
              max_blocks: int, moe_impl: str = "auto", dtype=jnp.float32):
    """A zero-argument call running one paged step (see the module docstring)."""
    batch, max_q_len = paged_batch(starts, lengths, num_blocks, max_blocks,
                                   min(4096, cfg.vocab_size))
    step = jax.jit(functools.partial(decoder.forward_with_stats, cfg=cfg, attn_impl="xla",
                                     max_q_len=max_q_len, moe_impl=moe_impl, dtype=dtype),
                   donate_argnames=("cache",))
    box = {"cache": make_cache(cfg, num_blocks, BLOCK, dtype)}

    def call():
        logits, box["cache"], _ = step(params, box["cache"], batch)
        return logits

    return call


def time_round_robin(calls: dict, iters: int) -> dict[str, float]:
    """Median milliseconds of each zero-argument call, the calls interleaved run by run."""
    times = {name: [] for name in calls}
    for _ in range(iters):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}
