"""What this machine has: whether JAX sees a GPU (the `gpu`-marked tests run only then)."""

from __future__ import annotations

import jax

try:
    has_gpu = bool(jax.devices("gpu"))
except RuntimeError:
    has_gpu = False
