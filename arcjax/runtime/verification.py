"""Verification of draft tokens in the jitted step (speculative decoding).

A step whose decode rows carry draft tokens runs in a bucket of sample width W = 1 + k
(`buckets.py`): sequence s samples at positions r = s * W + j, j < W, explicit rows of every
per-position input (logits, sampling parameters, draft tokens), so a per-position mask (a
grammar's bitmask) can join them as one more [R, ...] input.

1. Host (`pack`): `logits_rows[r]` is the token row of position j of sequence s: the row's last
   `sample_counts[s]` token rows (its newest token and its drafts); `SpecInputs.next_draft[r]`
   the draft that follows position r, where there is one; the sampling rows repeat the
   sequence's parameters with the token counter advanced by j (seeded keys, min_tokens).
2. Device (`verify`): each position's target distribution is the one plain decoding would use
   there: penalties count the drafts before it as generated (they are, if it is reached),
   temperature, top-k/top-p/min-p, the same random key as the (counter + j)-th token. Its
   target token `t_r` is drawn exactly as `sampling.sample` draws it (greedy: argmax).
3. Acceptance: a row accepts its drafts while each equals the target token of the position
   before it; it yields t at positions 0 .. a (the accepted drafts, then the target's token at
   the first rejection, or the bonus token after the last draft).

NOTE: this is the standard rejection sampler for a deterministic draft (q = a point mass on
the draft, what both proposers give, as vLLM V1's): accept d with probability
min(1, p(d) / q(d)) = p(d), otherwise resample from the normalized residual max(0, p - q),
which is p without d. Drawing t ~ p and accepting iff t == d realizes exactly that (P(accept)
= p(d); on rejection t ~ p conditioned on t != d, the residual) with one shared draw, and it
makes the output a function of the per-position keys alone: greedy AND seeded sampling give
the tokens of plain decoding, token for token, whatever was drafted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.runtime.penalties import TokenTables, count_sampled
from arcjax.model.row_tiles import RowTiles
from arcjax.runtime.sampling import (SamplingBatch, TokenLogprobs, adjust_logits, apply_bitmask,
                                     logprobs_if, sample_rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    """Draft tokens of a verification step, one entry per sampled position r = s * W + j."""

    next_draft: jax.Array  # [R] int32: the draft token after position r (0 where none)
    has_draft: jax.Array  # [R] bool: position r is followed by a draft


def pack(cu_seqlens: np.ndarray, sample_counts: Sequence[int],
         spec_token_ids: Sequence[Sequence[int]], sampling_rows: Sequence[tuple], *,
         num_seqs: int, width: int, spare_slot: int
         ) -> tuple[np.ndarray, SamplingBatch, SpecInputs]:
    """Per-position inputs of a step with draft tokens.

    Args:
      cu_seqlens: [S + 1] the batch's row offsets.
      sample_counts: per plan row, positions it samples at (`StepPlan.sample_counts`).
      spec_token_ids: per decode row, its drafts.
      sampling_rows: per plan row, (params, seed, tokens generated so far[, slot]).
      num_seqs, width: the bucket's S and W.
      spare_slot: the count table's spare row.

    Returns:
      (logits_rows [R], the per-position SamplingBatch [R], SpecInputs [R]).
    """
    n = len(sample_counts)
    counts = np.asarray(sample_counts, np.int64).reshape(n)
    j = np.arange(width)
    rows = np.zeros((num_seqs, width), np.int32)
    valid = j[None, :] < counts[:, None]  # [n, W]
    rows[:n] = np.where(valid, cu_seqlens[1:n + 1, None] - counts[:, None] + j[None, :], 0)
    next_draft = np.zeros((num_seqs, width), np.int32)
    has_draft = np.zeros((num_seqs, width), bool)
    for s, drafts in enumerate(spec_token_ids):
        next_draft[s, :len(drafts)] = drafts
        has_draft[s, :len(drafts)] = True
    positions = []
    for row in sampling_rows:
        p, seed, made = row[:3]
        rest = tuple(row[3:])
        positions += [(p, seed, made + i, *rest) for i in range(width)]
    sampling = SamplingBatch.build(positions, num_seqs * width, spare_slot)
    return rows.reshape(-1), sampling, SpecInputs(next_draft.reshape(-1), has_draft.reshape(-1))


def _draft_counts(spec: SpecInputs, width: int, vocab: int) -> jax.Array:
    """[R, V] int32: occurrences of each token among the drafts before each position."""
    seen = jax.nn.one_hot(spec.next_draft, vocab, dtype=jnp.int32) * spec.has_draft[:, None]
    seen = seen.reshape(-1, width, vocab)  # [S, W, V]
    return (jnp.cumsum(seen, axis=1) - seen).reshape(-1, vocab)


def verify(logits: jax.Array, sp: SamplingBatch, spec: SpecInputs, tables: TokenTables,
           width: int, bitmask: jax.Array | None = None, rows: RowTiles | None = None
           ) -> tuple[jax.Array, jax.Array, TokenLogprobs, jax.Array]:
    """Samples every position and accepts each row's longest matching draft prefix.

    Args:
      logits: [R, V] float32 at the sampled positions (R = S * width).
      sp: per-position sampling inputs [R].
      spec: the drafts.
      tables: the token tables (penalties.py), donated by the caller.
      width: W (static).
      bitmask: [R, ceil(V / 32)] int32, the tokens each position may take (structured
        outputs: the grammar's state after the drafts before it; all ones elsewhere), or None.
      rows: None, or the live positions' fixed tiles (batch-invariant mode): each position
        sampled and its logprobs computed as a plain decode row's.

    Returns:
      (target tokens [R] int32, tokens each sequence yields [S] int32 (1 + accepted drafts;
       the yielded tokens are its first positions' targets), raw log-probabilities of the
       targets [R] (zeros unless some row asked), the tables with the yielded tokens
       counted).
    """
    vocab = logits.shape[-1]
    if bitmask is not None:  # as plain sampling: before penalties and raw logprobs
        logits = jax.lax.cond(jnp.any(sp.constrained),
                              lambda: apply_bitmask(logits, bitmask), lambda: logits)
    adjusted = adjust_logits(logits, sp, tables, lambda: _draft_counts(spec, width, vocab))
    tokens = sample_rows(adjusted, sp, rows)  # [R]
    match = (spec.has_draft & (tokens == spec.next_draft)).reshape(-1, width)  # [S, W]
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)  # [S]
    yielded = jnp.arange(width)[None, :] <= accepted[:, None]  # [S, W]
    logprobs = logprobs_if(jnp.any(sp.logprobs), logits, tokens, rows)
    counts = count_sampled(tables.counts, sp.slot, tokens, sp.penalized & yielded.reshape(-1))
    return (tokens, (accepted + 1).astype(jnp.int32), logprobs,
            dataclasses.replace(tables, counts=counts))
