"""The request's pooling parameters (vLLM's path: `arcjax.pooling_params`).

`PoolingParams`: what an embedding request returns (vLLM's names). Validated when built:
a bad value raises `PoolingParamsError` whose `.field` names it. Whether the model allows
`dimensions` (Matryoshka truncation) is checked when the request is submitted.
"""

from __future__ import annotations

import dataclasses

from arcjax.errors import PoolingParamsError


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """How one embedding request's pooled vector is returned.

    Attributes:
      dimensions: keep the first `dimensions` values of the pooled vector (Matryoshka
        truncation, before normalization); None = all of them. Only for models that allow
        it (`arcjax.model.formats.pooler_config.PoolerConfig`).
      normalize: L2-normalize the vector; None = what the model's sentence-transformers
        files say (vLLM's default).
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise PoolingParamsError("dimensions", f"must be an int >= 1 or None, got {d!r}",
                                     limit=1)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingParamsError("normalize", f"must be a bool or None, got "
                                                  f"{self.normalize!r}")
