"""x @ w for decode-sized products on the CPU: a compiled kernel (`cpu_matmul.cc`, an XLA
FFI call built with the attention kernel, `cpu_build`).

XLA:CPU multiplies a few rows by a weight matrix at about half the speed it streams the
weights for one row (RESULTS.md: 30 layers of a 576 x 1536 float32 matrix, 1 row at 23 GB/s
of weights, 8 rows at 12 GB/s), and it converts bfloat16 weights to float32 before every
product. The kernel streams the weights once per 8 rows, widens bfloat16 in registers, and
computes every output element as one chain of fused multiply-adds over k: its bits depend
on its row and column alone, whatever the number of rows (batch-invariant by construction).

`cpu_matmul(x, w)`: x [M, K] float32, w [K, N] float32 or bfloat16 -> [M, N] float32;
`transposed=True`: w is [N, K] (a tied embedding as the LM head) and the product is x @ w.T;
`rows` ([] int32, may be traced): only x's first `rows` rows are multiplied, the others'
outputs are zeros (a batch-invariant row tile's live rows: arcjax/model/row_tiles.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.kernel_errors import require

TARGET = "arcjax_cpu_matmul"
_WEIGHT_KIND = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1}  # cpu_matmul.cc


def unsupported(w) -> str | None:
    """Why the kernel cannot take weight `w` (an array or `jax.ShapeDtypeStruct`), or None."""
    if getattr(w, "ndim", None) != 2:
        return f"a weight of shape {getattr(w, 'shape', None)} (the kernel takes matrices)"
    if jnp.dtype(w.dtype) not in _WEIGHT_KIND:
        return f"{w.dtype} weights (the kernel reads float32 and bfloat16)"
    return None


def cpu_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False,
               rows: jax.Array | int | None = None) -> jax.Array:
    """x [M, K] @ w ([K, N], or [N, K] when `transposed`) -> [M, N] float32, the rows from
    `rows` on (None: M; clipped to [0, M]) zeros.

    Raises:
        KernelArgumentError: the kernels cannot run here ("impl"), or `w` is not a float32
            or bfloat16 matrix ("w").
    """
    reason = cpu_build.kernels_unavailable()
    require(reason is None, "impl", reason)
    reason = unsupported(w)
    require(reason is None, "w", f"the CPU matmul kernel does not take {reason}")
    n = w.shape[0] if transposed else w.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    rows = x.shape[0] if rows is None else rows
    return call(x.astype(jnp.float32), w, jnp.asarray(rows, jnp.int32).reshape(()),
                weight_kind=np.int32(_WEIGHT_KIND[jnp.dtype(w.dtype)]), nk=transposed)
