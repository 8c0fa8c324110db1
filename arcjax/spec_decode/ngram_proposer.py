"""Prompt lookup (n-gram) drafts on the host, one vectorized match per row.

For a row whose known tokens end with the n-gram g (the longest n in prompt_lookup_min ..
prompt_lookup_max that occurs earlier), find the earlier occurrences of g in its own tokens
(prompt and output) with vectorized comparisons (numpy); the tokens that followed an
occurrence are the drafts: the most recent occurrence followed by a full proposal, else the
earliest one (the longest continuation). No match: no drafts.

A row whose newest token is still on the device (`pending`, overlapped scheduling) is matched
on the tokens known at planning time: the continuation's first `pending` tokens guess the
unknown ones and the drafts follow them. A wrong guess costs acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from arcjax.spec_decode.speculative_config import ProposalRow


def lookup(tokens: np.ndarray, n_min: int, n_max: int, count: int) -> np.ndarray:
    """Up to `count` tokens that followed an earlier occurrence of the longest suffix n-gram
    (n_min <= n <= n_max) of `tokens` [L] int; empty when there is none.

    One comparison finds the earlier occurrences of the last token (the candidates); each
    candidate's match length is then read off a [candidates, n_max] comparison.
    """
    length = len(tokens)
    cap = min(n_max, length - 1)
    if cap < n_min:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:length - 1] == tokens[-1])  # where a match could end
    if not ends.size:
        return tokens[:0]
    back = np.arange(cap)
    at = ends[:, None] - back[None, :]  # [C, cap] positions compared with the suffix's
    same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[length - 1 - back][None, :])
    matched = np.cumprod(same, axis=1).sum(axis=1)  # [C] match length of each candidate
    best = matched.max()
    if best < n_min:
        return tokens[:0]
    hits = ends[matched == best]
    full = hits[hits + 1 + count <= length]
    start = (full[-1] if full.size else hits[0]) + 1
    return tokens[start:start + count]


class NgramProposer:
    """Prompt-lookup drafts (vLLM's "ngram" method)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, rows: Sequence[ProposalRow], k: int) -> list[tuple[int, ...]]:
        """Up to k drafts per row (see the module docstring)."""
        out = []
        for row in rows:
            tokens = np.fromiter(row.tokens, np.int64, len(row.tokens))
            found = lookup(tokens, self.n_min, self.n_max, k + row.pending)
            out.append(tuple(found[row.pending:].tolist()))
        return out

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def reset(self) -> None:
        """Nothing is kept."""
