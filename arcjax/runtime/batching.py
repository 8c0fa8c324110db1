"""Host-side packing of a step plan into a bucket-padded `StepBatch`.

The plan's columns (`token_ids`, `starts`, `lengths`, `block_tables`) go straight into
`pallas_kernels.paging.paged_layout`, which builds every index array in a few vectorized
numpy operations (positions, slot mapping with out-of-range padding slots, cu_seqlens_q,
kv_lens, block tables, each sequence's last row). `logits_rows[s]` is the last row of
sequence s's chunk: the only row whose logits the engine may sample from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from arcjax.model.decoder import StepBatch
from arcjax.runtime.buckets import Bucket
from pallas_kernels.paging import paged_layout


def build_batch(token_ids: Sequence[int], starts: Sequence[int], lengths: Sequence[int],
                block_tables: Sequence[Sequence[int]], *, bucket: Bucket, max_blocks: int,
                block_size: int, num_blocks: int) -> StepBatch:
    """Packs one step's rows (plan columns) into numpy arrays padded to `bucket`.

    Raises:
      pallas_kernels.KernelArgumentError: the rows overflow the bucket or a table is short.
    """
    layout = paged_layout(starts, lengths, block_tables, token_bucket=bucket.tokens,
                          seq_bucket=bucket.seqs, max_blocks=max_blocks,
                          block_size=block_size, num_blocks=num_blocks)
    ids = np.zeros(bucket.tokens, np.int32)
    ids[:layout.num_tokens] = np.fromiter(token_ids, np.int32, layout.num_tokens)
    return StepBatch(token_ids=ids, positions=layout.positions,
                     slot_mapping=layout.slot_mapping, cu_seqlens_q=layout.cu_seqlens_q,
                     kv_lens=layout.kv_lens, block_tables=layout.block_tables,
                     num_seqs=np.int32(layout.num_seqs), logits_rows=layout.last_rows)


def empty_batch(bucket: Bucket, *, max_blocks: int, block_size: int,
                num_blocks: int) -> StepBatch:
    """An all-padding batch of `bucket`'s shape (writes nothing): for warm-up."""
    return build_batch((), (), (), (), bucket=bucket, max_blocks=max_blocks,
                       block_size=block_size, num_blocks=num_blocks)
