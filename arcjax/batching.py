"""Host-side packing of scheduled chunks into a bucket-padded `StepBatch`.

1. Each scheduled sequence contributes one chunk: tokens `start .. start + len - 1`
   of its token list, and its block table (enough blocks for `start + len` keys).
2. Chunks are laid out back to back: `cu_seqlens_q` is the prefix sum of chunk
   lengths; `kv_lens[s] = start + len` (bottom-right causal alignment).
3. Every token gets a cache slot `block_table[pos // block_size] * block_size +
   pos % block_size`. Padding tokens get slot `num_blocks * block_size`, which is out
   of range, so `write_kv` drops them; padding sequences have q_len 0 and kv_len 0.
4. `logits_rows[s]` is the last row of sequence s's chunk: the only row whose logits
   the engine may sample from.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from arcjax.model import StepBatch


class BucketOverflowError(ValueError):
    """A step does not fit the token or sequence bucket it was packed for."""


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    token_ids: Sequence[int]  # this chunk's tokens
    start: int  # absolute position of the first token
    block_table: Sequence[int]  # blocks holding keys 0 .. start + len - 1


def build_batch(chunks: Sequence[SeqChunk], *, token_bucket: int, seq_bucket: int,
                max_blocks: int, block_size: int, num_blocks: int) -> StepBatch:
    """Packs chunks into numpy arrays padded to (token_bucket, seq_bucket)."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > token_bucket:
        raise BucketOverflowError(f"{total} tokens exceed token bucket {token_bucket}")
    if len(chunks) > seq_bucket:
        raise BucketOverflowError(f"{len(chunks)} sequences exceed sequence bucket {seq_bucket}")
    pad_slot = num_blocks * block_size
    token_ids = np.zeros(token_bucket, np.int32)
    positions = np.zeros(token_bucket, np.int32)
    slots = np.full(token_bucket, pad_slot, np.int32)
    cu = np.zeros(seq_bucket + 1, np.int32)
    kv_lens = np.zeros(seq_bucket, np.int32)
    tables = np.zeros((seq_bucket, max_blocks), np.int32)
    rows = np.zeros(seq_bucket, np.int32)
    t = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        needed = -(-(c.start + n) // block_size)
        if len(c.block_table) < needed or len(c.block_table) > max_blocks:
            raise BucketOverflowError(
                f"sequence {s}: block table has {len(c.block_table)} blocks, needs {needed} "
                f"(max {max_blocks})")
        pos = np.arange(c.start, c.start + n, dtype=np.int32)
        table = np.asarray(c.block_table, np.int32)
        token_ids[t:t + n] = c.token_ids
        positions[t:t + n] = pos
        slots[t:t + n] = table[pos // block_size] * block_size + pos % block_size
        tables[s, :len(table)] = table
        kv_lens[s] = c.start + n
        rows[s] = t + n - 1 if n else 0
        t += n
        cu[s + 1] = t
    cu[len(chunks) + 1:] = t
    return StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slots,
                     cu_seqlens_q=cu, kv_lens=kv_lens, block_tables=tables,
                     num_seqs=np.int32(len(chunks)), logits_rows=rows)
