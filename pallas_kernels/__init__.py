"""Attention kernels for arcjax: ragged paged attention and KV cache writes.

`ragged_paged_attention` dispatches to an implementation: "reference" (the
oracle), "xla" (vectorized jnp), "pallas_gpu" (Pallas kernel for NVIDIA GPUs).
"""

from pallas_kernels.api import IMPLS, ragged_paged_attention
from pallas_kernels.errors import KernelArgumentError
from pallas_kernels.kv import write_kv

__all__ = ["IMPLS", "KernelArgumentError", "ragged_paged_attention", "write_kv"]
