"""Engine-side state of a pooling (embedding) request: its chunks' pooled sums, added up
into the embedding.

1. `pooling_rows(plan, reqs)` (the step's "pack" stage): per plan row, how it pools
   (`PoolingRow`), or None everywhere when no row of the step pools.
2. `add_pooled(plan, reqs, pooled)` (the "collect" stage): each pooling row's `[H]` sum
   (`arcjax.runtime.pooling_inputs`) goes into its request's `PooledState`. A chunk that
   starts at position 0 starts the sum afresh (a request preempted mid-prompt is computed
   again from the start: it never reads the prefix cache).
3. `PooledState.embedding()` once the scheduler has finished the request: truncated to
   `dimensions`, then L2-normalized when asked (vLLM's order).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arcjax.pooling_params import PoolingParams
from arcjax.runtime.pooling_inputs import PoolingRow

NORM_EPS = 1e-12  # torch.nn.functional.normalize's


@dataclasses.dataclass(eq=False)
class PooledState:
    """The pooling of one request (mutable; owned by the stepping thread).

    Attributes:
      params: what the request asked for.
      pooling_type: the model's pooling ("LAST", "MEAN", "CLS").
      normalize: L2-normalize the embedding (the request's choice, else the model's).
      total: [H] float32, the sum of the pooled rows so far (None before the first chunk).
      covered: prompt positions whose rows are in `total`.
    """

    params: PoolingParams
    pooling_type: str
    normalize: bool
    total: np.ndarray | None = None
    covered: int = 0

    def add(self, start: int, length: int, pooled: np.ndarray) -> None:
        """Adds the pooled sum of the chunk at positions start .. start + length - 1.

        Raises:
          RuntimeError: the chunk does not follow the ones added before (a bug).
        """
        if start == 0:
            self.total = np.array(pooled, np.float32)
        elif start == self.covered:
            self.total = self.total + pooled
        else:
            raise RuntimeError(f"pooling chunk at {start} after {self.covered} positions")
        self.covered = start + length

    def embedding(self) -> np.ndarray:
        """The request's vector [dimensions or H] float32."""
        v = self.total if self.params.dimensions is None else self.total[:self.params.dimensions]
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), NORM_EPS)
        return np.asarray(v, np.float32)


def pooling_rows(plan, reqs) -> list[PoolingRow | None] | None:
    """Per plan row, its `PoolingRow` (None for rows that do not pool); None when none does."""
    rows = [PoolingRow(req.pooling.pooling_type, len(req.prompt_ids))
            if req.pooling is not None else None for req in reqs]
    return rows if any(r is not None for r in rows) else None


def add_pooled(plan, reqs, pooled: np.ndarray) -> None:
    """Adds each live pooling row's sum (`pooled` [S, H], host) to its request."""
    for i, req in enumerate(reqs):
        if req.pooling is not None and not req.finished:
            req.pooling.add(plan.starts[i], plan.lengths[i], pooled[i])
