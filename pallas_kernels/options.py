"""The optional attention semantics every implementation shares.

`AttentionOptions` carries the per-call options past plain causal attention:

- `sliding_window` (int32 scalar, may be traced: one value per layer inside the
  decoder's scan): a query at absolute position p sees keys in `(p - window, p]`.
- `logit_softcap` (static float): scores after `sm_scale` become
  `cap * tanh(s / cap)` before masking (Gemma 2).
- `k_scale`, `v_scale` (float32 scalars, may be traced): the pages hold
  `value / scale` (e.g. float8_e4m3fn); attention reads `float32(page) * scale`.

Its three methods are the only places these semantics are written for the jnp
paths; kernels that need the raw values read the fields.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    sliding_window: jax.Array | None = None  # [] int32
    logit_softcap: float | None = None  # static
    k_scale: jax.Array | None = None  # [] float32
    v_scale: jax.Array | None = None  # [] float32

    def in_window(self, keys: jax.Array, positions: jax.Array) -> jax.Array:
        """Whether `keys` are not older than the window of a query at `positions`."""
        if self.sliding_window is None:
            return jnp.ones(jnp.broadcast_shapes(jnp.shape(keys), jnp.shape(positions)), bool)
        return keys > positions - self.sliding_window

    def visible(self, keys: jax.Array, positions: jax.Array) -> jax.Array:
        """Whether a query at `positions` may see `keys` (broadcasting): causal and windowed."""
        return (keys <= positions) & self.in_window(keys, positions)

    def softcap(self, scores: jax.Array) -> jax.Array:
        """Soft-capped scores (identity without a cap)."""
        if self.logit_softcap is None:
            return scores
        cap = jnp.float32(self.logit_softcap)
        return cap * jnp.tanh(scores / cap)

    def dequantize(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values as float32 values (scaled when the pages are quantized)."""
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        if self.k_scale is not None:
            k = k * self.k_scale
        if self.v_scale is not None:
            v = v * self.v_scale
        return k, v
