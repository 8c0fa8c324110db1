"""Jitted model steps, one compiled executable per bucket.

1. `prepare(chunks, sampling_rows)` picks the bucket, packs host arrays
   (`arcjax.batching.build_batch`) and the per-row sampling inputs.
2. `run(bucket, batch, sampling)` calls the bucket's executable: forward over the
   ragged batch, KV written through `slot_mapping` into the donated cache, logits
   only at each sequence's last row, sampling on device. Returns token ids [S].
3. Executables are compiled ahead of time (`jit(...).lower(...).compile()`) and kept
   per bucket, so `compile_count` is exact and `warmup()` compiles every bucket.

NOTE: compiled executables depend only on shapes, dtypes and the static arguments, so
they are shared process-wide (`_EXECUTABLES`): a second engine over the same model
and cache geometry reuses them and counts no compile.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arcjax import model
from arcjax.batching import SeqChunk, build_batch
from arcjax.buckets import Bucket, BucketSet
from arcjax.config import ModelConfig
from arcjax.sampling import SamplingBatch, SamplingParams, sample


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl", "dtype", "max_q_len"),
                   donate_argnames=("cache",))
def _step(params, cache, batch, sampling, *, cfg, attn_impl, dtype, max_q_len):
    # cfg/attn_impl/dtype/max_q_len are static: one executable per bucket, no
    # recompiles from the traced metadata (num_seqs, kv_lens, ...).
    logits, cache = model.forward(params, cache, batch, cfg=cfg, attn_impl=attn_impl,
                                  dtype=dtype, max_q_len=max_q_len)
    return sample(logits, sampling), cache


_EXECUTABLES: dict[tuple, object] = {}


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef),) + tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


class ModelRunner:
    """Owns params and the paged KV cache; runs one bucket-shaped step at a time."""

    def __init__(self, cfg: ModelConfig, params, *, num_blocks: int, block_size: int,
                 max_blocks_per_seq: int, buckets: BucketSet, dtype, attn_impl: str):
        self.cfg, self.params = cfg, params
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks = max_blocks_per_seq
        self.buckets, self.dtype, self.attn_impl = buckets, jnp.dtype(dtype), attn_impl
        self.cache = model.make_cache(cfg, num_blocks, block_size, self.dtype)
        self._compiled: dict[Bucket, object] = {}
        self.compile_count = 0

    def prepare(self, chunks: Sequence[SeqChunk],
                sampling_rows: Sequence[tuple[SamplingParams, int, int]]):
        """Packs one step. Returns (bucket, batch, sampling) as host arrays."""
        decode_only = all(len(c.token_ids) == 1 for c in chunks)
        bucket = self.buckets.select(sum(len(c.token_ids) for c in chunks), len(chunks),
                                     decode_only)
        batch = build_batch(chunks, token_bucket=bucket.tokens, seq_bucket=bucket.seqs,
                            max_blocks=self.max_blocks, block_size=self.block_size,
                            num_blocks=self.num_blocks)
        return bucket, batch, SamplingBatch.build(list(sampling_rows), bucket.seqs)

    def _executable(self, bucket: Bucket, batch, sampling):
        exe = self._compiled.get(bucket)
        if exe is None:
            key = (self.cfg, self.attn_impl, str(self.dtype), bucket.max_q_len,
                   _signature((self.params, self.cache, batch, sampling)))
            exe = _EXECUTABLES.get(key)
            if exe is None:
                exe = _step.lower(self.params, self.cache, batch, sampling, cfg=self.cfg,
                                  attn_impl=self.attn_impl, dtype=self.dtype,
                                  max_q_len=bucket.max_q_len).compile()
                self.compile_count += 1
                _EXECUTABLES[key] = exe
            self._compiled[bucket] = exe
        return exe

    def run(self, bucket: Bucket, batch, sampling) -> np.ndarray:
        """Runs the step; returns sampled token ids [S] (host) after the device is done."""
        batch = jax.tree.map(jnp.asarray, batch)
        sampling = jax.tree.map(jnp.asarray, sampling)
        exe = self._executable(bucket, batch, sampling)
        tokens, self.cache = exe(self.params, self.cache, batch, sampling)
        return np.asarray(tokens)

    def warmup(self) -> float:
        """Compiles every bucket. Returns the seconds it took."""
        t0 = time.perf_counter()
        for bucket in self.buckets.all():
            if bucket in self._compiled:
                continue
            batch = build_batch([], token_bucket=bucket.tokens, seq_bucket=bucket.seqs,
                                max_blocks=self.max_blocks, block_size=self.block_size,
                                num_blocks=self.num_blocks)
            sampling = SamplingBatch.build([], bucket.seqs)
            self._executable(bucket, jax.tree.map(jnp.asarray, batch),
                             jax.tree.map(jnp.asarray, sampling))
        return time.perf_counter() - t0
