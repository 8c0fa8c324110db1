"""Host-side packing of a step plan into one step's inputs, padded to its bucket
(`PreparedStep`).

1. `prepare_step` picks the bucket (`buckets.py`: a verification bucket when decode rows
   carry draft tokens), packs the plan's columns into a `StepBatch` (`build_batch`), and
   builds the sampling inputs: per sequence, or per sampled position in a verification
   step (with the drafts to verify, `verification.pack`); a step with prompt_logprobs
   rows also gets its `PromptTargets`, one with pooling rows its `PoolingInputs`
   (`pooling_inputs.py`), and either reads hidden states at every token row.
2. `build_batch`: the plan's columns (`token_ids`, `starts`, `lengths`, `block_tables`) go
   straight into `pallas_kernels.paging.paged_layout`, which builds every index array in a
   few vectorized numpy operations (positions, slot mapping with out-of-range padding
   slots, cu_seqlens_q, kv_lens, block tables, each sequence's last row).
   `logits_rows[s]` is the last row of sequence s's chunk: the only row whose logits the
   engine may sample from.
3. `warmup_step`: an all-padding step of a bucket (writes nothing), for warm-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arcjax.model.decoder import StepBatch
from arcjax.runtime.buckets import Bucket, BucketSet
from arcjax.runtime.pooling_inputs import PoolingInputs, pooling_inputs
from arcjax.runtime.sampling import SamplingBatch
from arcjax.runtime.step_output import PromptTargets, prompt_targets
from arcjax.runtime import verification
from pallas_kernels.paging import paged_layout


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """One step's host inputs, padded to its bucket: what `ModelRunner.prepare` returns and
    `ModelRunner.launch` takes.

    Attributes:
      bucket: the bucket the step runs in (its executable).
      batch: the flat ragged batch: token rows [T], per sequence [S] index arrays.
      sampling: the sampling inputs of the R = S * bucket.sample_width sampled positions.
      prompt: a step with prompt_logprobs rows: each row's next prompt token (logits are
        then computed at every token row); else None.
      spec: a verification step (sample width > 1): the draft tokens to verify; else None.
      pooling: a step with pooling rows: each row's pooling weights (hidden states are then
        computed at every token row); else None.
      lora_slots: with LoRA adapters, each token row's adapter slot [T] int32 (0: the base
        model, and padding); else None.
    """

    bucket: Bucket
    batch: StepBatch
    sampling: SamplingBatch
    prompt: PromptTargets | None = None
    spec: verification.SpecInputs | None = None
    pooling: PoolingInputs | None = None
    lora_slots: np.ndarray | None = None

    @property
    def every_row(self) -> tuple[bool, bool]:
        """(prompt logprobs, pooling): what makes the step read every token row's hidden
        state (each pair is its own executable of the bucket)."""
        return self.prompt is not None, self.pooling is not None


def prepare_step(plan, sampling_rows: Sequence[tuple], prompt_rows=None, pooling_rows=None,
                 *, buckets: BucketSet, max_blocks: int, block_size: int, num_blocks: int,
                 spare_slot: int, num_groups: int = 1) -> PreparedStep:
    """Packs one step plan (see the module docstring; `ModelRunner.prepare` documents the
    arguments). Raises pallas_kernels.KernelArgumentError when the rows overflow."""
    drafts = plan.spec_token_ids
    if drafts:
        bucket = buckets.select_spec(plan.num_tokens, plan.num_seqs, max(plan.lengths))
    else:
        bucket = buckets.select(plan.num_tokens, plan.num_seqs, plan.decode_only)
    batch = build_batch(plan.token_ids, plan.starts, plan.lengths, plan.block_tables,
                        bucket=bucket, max_blocks=max_blocks, block_size=block_size,
                        num_blocks=num_blocks, group_tables=(
                            plan.group_block_tables(num_groups) if num_groups > 1 else None))
    spec = None
    if drafts:
        rows, sampling, spec = verification.pack(
            batch.cu_seqlens_q, plan.sample_counts, drafts, list(sampling_rows),
            num_seqs=bucket.seqs, width=bucket.sample_width, spare_slot=spare_slot)
        batch = dataclasses.replace(batch, logits_rows=rows)
    else:
        sampling = SamplingBatch.build(list(sampling_rows), bucket.seqs, spare_slot)
    prompt = pooling = None
    if prompt_rows is not None:
        prompt = prompt_targets(plan.starts, plan.lengths, prompt_rows, batch.logits_rows,
                                bucket.tokens)
    if pooling_rows is not None:
        pooling = pooling_inputs(plan.starts, plan.lengths, pooling_rows, batch.logits_rows,
                                 bucket.tokens)
    if prompt is not None or pooling is not None:  # hidden states at every token row
        batch = dataclasses.replace(batch, logits_rows=np.arange(bucket.tokens,
                                                                  dtype=np.int32))
    return PreparedStep(bucket, batch, sampling, prompt, spec, pooling)


def build_batch(token_ids: Sequence[int], starts: Sequence[int], lengths: Sequence[int],
                block_tables: Sequence[Sequence[int]], *, bucket: Bucket, max_blocks: int,
                block_size: int, num_blocks: int,
                group_tables: Sequence | None = None) -> StepBatch:
    """Packs one step's rows (plan columns) into numpy arrays padded to `bucket`.

    `group_tables`: with several KV cache groups, per group every row's table
    (`StepPlan.group_block_tables`; `block_tables` is then unused); each group gets its own
    tables [S, max_blocks] and slot mapping [T], stacked on a leading group axis (one
    group: that axis has length 1).

    Raises:
      pallas_kernels.KernelArgumentError: the rows overflow the bucket or a table is short.
    """
    layouts = [paged_layout(starts, lengths, tables, token_bucket=bucket.tokens,
                            seq_bucket=bucket.seqs, max_blocks=max_blocks,
                            block_size=block_size, num_blocks=num_blocks)
               for tables in group_tables or [block_tables]]
    layout = layouts[0]
    ids = np.zeros(bucket.tokens, np.int32)
    ids[:layout.num_tokens] = np.fromiter(token_ids, np.int32, layout.num_tokens)
    return StepBatch(token_ids=ids, positions=layout.positions,
                     slot_mapping=np.stack([g.slot_mapping for g in layouts]),  # [G, T]
                     cu_seqlens_q=layout.cu_seqlens_q, kv_lens=layout.kv_lens,
                     block_tables=np.stack([g.block_tables for g in layouts]),  # [G, S, mb]
                     num_seqs=np.int32(layout.num_seqs), logits_rows=layout.last_rows)


def empty_batch(bucket: Bucket, *, max_blocks: int, block_size: int,
                num_blocks: int, num_groups: int = 1) -> StepBatch:
    """An all-padding batch of `bucket`'s shape (writes nothing): for warm-up."""
    return build_batch((), (), (), (), bucket=bucket, max_blocks=max_blocks,
                       block_size=block_size, num_blocks=num_blocks,
                       group_tables=[()] * num_groups)


def warmup_step(bucket: Bucket, *, max_blocks: int, block_size: int, num_blocks: int,
                spare_slot: int, num_groups: int = 1, pooling: bool = False) -> PreparedStep:
    """An all-padding step of `bucket` (writes nothing, verifies no draft): for warm-up;
    `pooling`: of its pooling executable (every weight 0)."""
    batch = empty_batch(bucket, max_blocks=max_blocks, block_size=block_size,
                        num_blocks=num_blocks, num_groups=num_groups)
    pool = None
    if pooling:
        pool = pooling_inputs((), (), (), batch.logits_rows, bucket.tokens)
        batch = dataclasses.replace(batch, logits_rows=np.arange(bucket.tokens, dtype=np.int32))
    if bucket.sample_width == 1:
        return PreparedStep(bucket, batch, SamplingBatch.build([], bucket.seqs, spare_slot),
                            pooling=pool)
    rows, sampling, spec = verification.pack(batch.cu_seqlens_q, (), (), (), num_seqs=bucket.seqs,
                                             width=bucket.sample_width, spare_slot=spare_slot)
    if pool is not None:  # the verification rows are where sampling reads
        pool = dataclasses.replace(pool, sample_rows=rows)
    return PreparedStep(bucket, dataclasses.replace(batch, logits_rows=rows if pool is None
                                                    else batch.logits_rows), sampling,
                        spec=spec, pooling=pool)
