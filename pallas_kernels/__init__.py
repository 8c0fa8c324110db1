"""Attention kernels for arcjax: ragged paged attention and KV cache writes.

`ragged_paged_attention` dispatches to an implementation: "reference" (the
oracle), "xla" (vectorized jnp), "pallas_gpu" (Pallas-Triton kernel for NVIDIA
GPUs), "triton" (a Triton kernel through jax_triton), "mosaic_gpu" (a Pallas
Mosaic GPU decode kernel); `resolve_impl` / `resolve_call` say which one "auto" runs
here, `choose_impl` / `choose_call` also whether a recorded GPU pass vouches for it,
`impl_unavailable` why an implementation cannot run here.
"""

from pallas_kernels.api import (IMPLS, choose_call, choose_impl, impl_unavailable,
                                ragged_paged_attention, resolve_call, resolve_impl)
from pallas_kernels.kernel_errors import KernelArgumentError
from pallas_kernels.kv import write_kv

__all__ = ["IMPLS", "KernelArgumentError", "choose_call", "choose_impl", "impl_unavailable",
           "ragged_paged_attention", "resolve_call", "resolve_impl", "write_kv"]
