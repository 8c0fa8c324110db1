"""Host-side index math of a ragged paged batch: the one place it is written.

Given each sequence's chunk (`start`, `length`) and its block table, `paged_layout` builds the
index arrays every attention call needs, padded to a (token, sequence) bucket, in a few vectorized
numpy operations (no per-sequence Python loop beyond flattening the tables):

1. Chunks are laid out back to back: `cu_seqlens_q` is the prefix sum of the lengths, and
   `kv_lens[s] = start + length` (bottom-right causal alignment).
2. Token `t` of sequence `s` sits at position `start[s] + (t - cu_seqlens_q[s])` and is written to
   cache slot `table[pos // block_size] * block_size + pos % block_size`.
3. Padding tokens get slot `num_blocks * block_size` (out of range: `write_kv` drops it);
   padding sequences have q_len 0, kv_len 0 and an all-zero table row. A table entry that is
   None (a block a sliding window released: attention never reads it) becomes page 0.
4. `last_rows[s]` is the last token row of sequence s (0 for padding sequences): the only row whose
   logits an engine samples from.

Used by the engine's batch packing (`arcjax.runtime.batching`), the kernel tests' batch factory
(`pallas_kernels.testing`) and the kernel benchmark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pallas_kernels.kernel_errors import KernelArgumentError


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Index arrays of one bucket-padded ragged batch (host numpy, int32)."""

    positions: np.ndarray  # [T] absolute position of each token (0 for padding)
    slot_mapping: np.ndarray  # [T] cache slot of each token; padding: num_blocks * block_size
    cu_seqlens_q: np.ndarray  # [S + 1] prefix sums of chunk lengths
    kv_lens: np.ndarray  # [S] keys per sequence, this chunk included
    block_tables: np.ndarray  # [S, max_blocks]
    last_rows: np.ndarray  # [S] last token row of each sequence (0 for padding)
    num_seqs: int  # real sequences (the rest of S is padding)
    num_tokens: int  # real tokens (the rest of T is padding)


def paged_layout(starts: Sequence[int], lengths: Sequence[int],
                 block_tables: Sequence[Sequence[int | None]], *, token_bucket: int,
                 seq_bucket: int, max_blocks: int, block_size: int,
                 num_blocks: int) -> PagedLayout:
    """Index arrays of sequences running `lengths[s]` tokens from position `starts[s]`.

    Args:
      starts: [n] position of each chunk's first token (its computed tokens so far).
      lengths: [n] tokens in each chunk (1 for a decode; 0 is allowed).
      block_tables: n tables, each holding at least the blocks for `start + length` keys.
      token_bucket, seq_bucket: T and S to pad to.
      max_blocks: block-table width.
      block_size, num_blocks: the cache geometry (one layer).

    Raises:
      KernelArgumentError: the chunks overflow the bucket, or a table is too short or too wide.
    """
    n = len(lengths)
    if len(starts) != n or len(block_tables) != n:
        raise KernelArgumentError("block_tables", f"{len(starts)} starts, {n} lengths and "
                                  f"{len(block_tables)} tables: one each per sequence")
    if n > seq_bucket:
        raise KernelArgumentError("seq_bucket", f"{n} sequences exceed the bucket {seq_bucket}")
    start = np.asarray(starts, np.int64).reshape(n)
    length = np.asarray(lengths, np.int64).reshape(n)
    cu = np.zeros(seq_bucket + 1, np.int64)
    np.cumsum(length, out=cu[1:n + 1])
    cu[n + 1:] = cu[n]
    total = int(cu[n])
    if total > token_bucket:
        raise KernelArgumentError("token_bucket",
                                  f"{total} tokens exceed the bucket {token_bucket}")
    table_lens = np.fromiter(map(len, block_tables), np.int64, n)
    needed = -(-(start + length) // block_size)
    short = np.flatnonzero((table_lens < needed) | (table_lens > max_blocks))
    if short.size:
        s = int(short[0])
        raise KernelArgumentError(
            "block_tables", f"sequence {s}: table has {table_lens[s]} blocks, needs "
            f"{needed[s]} (at most {max_blocks})")
    tables = np.zeros((seq_bucket, max_blocks), np.int32)
    if n:
        rows = np.repeat(np.arange(n), table_lens)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)
        tables[rows, cols] = np.fromiter(  # `b or 0`: None (released) -> page 0
            (b or 0 for table in block_tables for b in table), np.int64, rows.size)
    seq_of = np.repeat(np.arange(n), length)  # [total]
    pos = start[seq_of] + np.arange(total) - cu[seq_of]
    positions = np.zeros(token_bucket, np.int32)
    positions[:total] = pos
    slots = np.full(token_bucket, num_blocks * block_size, np.int32)
    slots[:total] = tables[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    kv_lens = np.zeros(seq_bucket, np.int32)
    kv_lens[:n] = start + length
    last = np.zeros(seq_bucket, np.int32)
    last[:n] = np.maximum(cu[1:n + 1] - 1, 0)
    return PagedLayout(positions=positions, slot_mapping=slots,
                       cu_seqlens_q=cu.astype(np.int32), kv_lens=kv_lens, block_tables=tables,
                       last_rows=last, num_seqs=n, num_tokens=total)
