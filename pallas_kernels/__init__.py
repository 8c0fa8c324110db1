"""Attention kernels for arcjax: ragged paged attention and KV cache writes.

`ragged_paged_attention` dispatches to an implementation: "reference" (the
oracle), "xla" (vectorized jnp), "pallas_gpu" (Pallas-Triton kernel for NVIDIA
GPUs), "triton" (a Triton kernel through jax_triton), "mosaic_gpu" (a Pallas
Mosaic GPU decode kernel); `resolve_impl` says which one "auto" runs here.
"""

from pallas_kernels.api import IMPLS, ragged_paged_attention, resolve_impl
from pallas_kernels.errors import KernelArgumentError
from pallas_kernels.kv import write_kv

__all__ = ["IMPLS", "KernelArgumentError", "ragged_paged_attention", "resolve_impl", "write_kv"]
