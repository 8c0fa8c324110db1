"""Attention kernels for arcjax: ragged paged attention and KV cache writes.

`ragged_paged_attention(q, k_pages, ...)` builds one `AttentionInputs` pytree
(`AttentionInputs.create` validates it) and `paged_attention(inputs, impl=...)`
dispatches it to an implementation: "reference" (the oracle), "xla" (vectorized
jnp), "cpu" (a C++ kernel behind XLA's FFI, built on first use: `cpu_attention`),
"pallas_gpu" (Pallas-Triton kernel for NVIDIA GPUs), "triton" (a Triton
kernel through jax_triton), "mosaic_gpu" (a Pallas Mosaic GPU decode kernel);
`resolve_impl` / `resolve_call` / `resolve_inputs` say which one "auto" runs here,
`choose_impl` / `choose_call` / `choose_inputs` also whether a recorded GPU pass
vouches for it, `impl_unavailable` why an implementation cannot run here.
"""

from pallas_kernels.api import (IMPLS, choose_call, choose_impl, choose_inputs, impl_unavailable,
                                paged_attention, ragged_paged_attention, resolve_call,
                                resolve_impl, resolve_inputs)
from pallas_kernels.attention_inputs import AttentionInputs
from pallas_kernels.kernel_errors import KernelArgumentError
from pallas_kernels.kv import write_kv

__all__ = ["IMPLS", "AttentionInputs", "KernelArgumentError", "choose_call", "choose_impl",
           "choose_inputs", "impl_unavailable", "paged_attention", "ragged_paged_attention",
           "resolve_call", "resolve_impl", "resolve_inputs", "write_kv"]
