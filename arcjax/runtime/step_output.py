"""What a step returns (`StepOutput`) and the extra input of a step that computes prompt
log-probabilities (`PromptTargets`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from arcjax.runtime.sampling import TokenLogprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A step's results. R = S sampled positions, or S * W in a verification step (sequence
    s's positions are s * W .. s * W + W - 1; it yields the first `num_yielded[s]`)."""

    tokens: jax.Array  # [R] int32 sampled ids (numpy once `ModelRunner.run` returns)
    logprobs: TokenLogprobs  # [R] raw logprobs of the sampled tokens (zeros unless asked)
    prompt_logprobs: TokenLogprobs | None  # [T] of each row's next prompt token, or None
    num_yielded: jax.Array | None = None  # [S] int32 tokens each sequence yields (1 + accepted
    # drafts) in a verification step; None otherwise (every sequence yields its one token)

    def row_tokens(self, row: int, width: int) -> np.ndarray:
        """The tokens sequence `row` yields (host arrays; `width`: the bucket's W)."""
        n = 1 if self.num_yielded is None else int(self.num_yielded[row])
        return self.tokens[row * width:row * width + n]
    # [L, E] int32 tokens each expert received in each layer (mixtures of experts), or None
    expert_counts: jax.Array | None = None
    # [S, H] float32 pooled sums of each sequence's pooling rows (`pooling_inputs.py`), in a
    # step with pooling rows; None otherwise
    pooled: jax.Array | None = None

    def expert_tokens(self) -> tuple[tuple[int, ...], ...] | None:
        """`expert_counts` as host tuples (for the trace), or None for a dense model."""
        if self.expert_counts is None:
            return None
        return tuple(map(tuple, np.asarray(self.expert_counts).tolist()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptTargets:
    """Inputs of a step with prompt_logprobs rows: logits are then computed at every token
    row, sampling reads `sample_rows` of them, and row t's log-probabilities are taken of
    `targets[t]` (the prompt token after that row's position; 0 where there is none)."""

    sample_rows: jax.Array  # [S] int32, each sequence's last token row
    targets: jax.Array  # [T] int32


def prompt_targets(starts: Sequence[int], lengths: Sequence[int],
                   prompts: Sequence[Sequence[int] | None], sample_rows: np.ndarray,
                   num_tokens: int) -> PromptTargets:
    """Per token row, the next prompt token (rows of sequences whose prompt is None: 0)."""
    targets = np.zeros(num_tokens, np.int32)
    row = 0
    for start, n, prompt in zip(starts, lengths, prompts):
        if prompt is not None:
            nxt = np.asarray(prompt[start + 1:start + n + 1], np.int32)
            targets[row:row + len(nxt)] = nxt
        row += n
    return PromptTargets(np.asarray(sample_rows, np.int32), targets)
