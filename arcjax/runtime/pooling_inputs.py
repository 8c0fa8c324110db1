"""Pooling rows in the step: the extra input of a step that pools (`PoolingInputs`) and the
pooled sums it returns (`pool_rows`).

An embedding request is a prefill-only row (scheduler `Request.pooling`): its chunks run
in ordinary steps beside generation rows. A step with such rows computes the last layer's
hidden states at every token row (as a prompt-logprobs step does; sampling reads each
sequence's last row through `sample_rows`), applies the final norm, and returns per
sequence the weighted sum of its rows' hidden states, `[S, H]` float32:

  pooled[s] = sum over token rows t of sequence s of weights[t] * norm(hidden[t])

The host sets the weights from the pooling type (`pooling_inputs`): MEAN gives every
prompt position 1 / prompt length, LAST gives the prompt's last position 1 (in its final
chunk), CLS gives position 0 (in its first chunk); rows of other sequences weigh 0. So a
request's embedding is the sum of its chunks' `pooled` rows, whatever the chunking
(`arcjax.engine.pooled_state.PooledState` adds them up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.model.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PoolingRow:
    """A plan row of a pooling request: how it pools and its prompt's length."""

    pooling_type: str  # "LAST" | "MEAN" | "CLS" (`PoolerConfig.pooling_type`)
    prompt_len: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolingInputs:
    """Inputs of a step with pooling rows (see the module docstring)."""

    sample_rows: jax.Array  # [S] int32, each sequence's last token row (sampling reads it)
    segments: jax.Array  # [T] int32, the sequence each token row belongs to (padding: 0)
    weights: jax.Array  # [T] float32, each row's weight in its sequence's pooled sum


def pooling_inputs(starts: Sequence[int], lengths: Sequence[int],
                   rows: Sequence[PoolingRow | None], sample_rows: np.ndarray,
                   num_tokens: int) -> PoolingInputs:
    """The weights of every token row (rows whose entry in `rows` is None weigh 0)."""
    segments = np.zeros(num_tokens, np.int32)
    weights = np.zeros(num_tokens, np.float32)
    row0 = 0
    for s, (start, n, row) in enumerate(zip(starts, lengths, rows)):
        segments[row0:row0 + n] = s
        if row is not None:
            if row.pooling_type == "MEAN":
                weights[row0:row0 + n] = 1.0 / row.prompt_len
            elif row.pooling_type == "LAST":
                if start + n == row.prompt_len:
                    weights[row0 + n - 1] = 1.0
            elif start == 0:  # CLS
                weights[row0] = 1.0
        row0 += n
    return PoolingInputs(np.asarray(sample_rows, np.int32), segments, weights)


def pool_rows(params, cfg: ModelConfig, hidden: jax.Array, pooling: PoolingInputs,
              num_seqs: int) -> jax.Array:
    """Per sequence, the weighted sum of its rows' normalized hidden states.

    Args:
      hidden: [T, H] the last layer's output at every token row (before the final norm).
      num_seqs: S, the bucket's sequence count.

    Returns:
      [S, H] float32.
    """
    from arcjax.model.layers import rms_norm  # flax: imported where a model is traced

    h = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps,
                 cfg.norm_unit_offset).astype(jnp.float32)  # [T, H]
    return jax.ops.segment_sum(h * pooling.weights[:, None], pooling.segments,
                               num_segments=num_seqs)  # [S, H]
