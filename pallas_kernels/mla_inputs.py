"""The inputs of one ragged paged multi-head latent attention (MLA) call, as one pytree.

MLA (DeepSeek-V2/V3) caches, per token and layer, one latent `c` (`kv_lora_rank` values,
after its RMSNorm) and one rope key `k_pe` (`qk_rope_head_dim` values) shared by every
head. Head h's key is `[W_uk_h c, k_pe]` and its value `W_uv_h c`; attention runs
*absorbed*: the caller folds `W_uk_h` into the query (`q_latent_h = W_uk_h^T q_nope_h`)
and `W_uv_h` into the output, so the kernel is a multi-query attention over the latent
pages whose values are the latent itself:

    score_h(t, k) = sm_scale * (q_latent[t, h] . latent[k] + q_rope[t, h] . rope[k])
    out[t, h]     = sum_k softmax_k(score_h(t, .)) * latent[k]          # [Dl]

with the ragged, bottom-right causal rows of `AttentionInputs`: sequence `s < num_seqs`
owns query rows `cu_seqlens_q[s] : cu_seqlens_q[s+1]`, row `i` of a chunk of `q_len` sits
at position `kv_lens[s] - q_len + i` (its own q0 per sequence: decode rows and prefill
chunks mix) and sees keys `0 ..` that position; padding rows come out as zeros.

`MLAInputs.create` is the one validation (a `KernelArgumentError` naming the field); it
reads only shapes and dtypes, so `jax.ShapeDtypeStruct` fields describe a call too.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.attention_inputs import _cast, _dtype, _shape
from pallas_kernels.kernel_errors import require


def _static():
    return dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MLAInputs:
    """One ragged paged latent attention call. Build it with `create` (it validates)."""

    q_latent: jax.Array  # [T, Hq, Dl] absorbed no-rope queries
    q_rope: jax.Array  # [T, Hq, Dr] rope queries
    latent_pages: jax.Array  # [num_blocks, block_size, Dl]
    rope_pages: jax.Array  # [num_blocks, block_size, Dr]
    block_tables: jax.Array  # [S, max_blocks] int32
    kv_lens: jax.Array  # [S] int32
    cu_seqlens_q: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # [] int32
    sm_scale: float = _static()
    max_q_len: int = _static()

    @classmethod
    def create(cls, *, q_latent, q_rope, latent_pages, rope_pages, block_tables, kv_lens,
               cu_seqlens_q, num_seqs, sm_scale: float,
               max_q_len: int | None = None) -> MLAInputs:
        """Validates one call's inputs and returns them normalized (int32 indices).

        Args:
            q_latent, q_rope, latent_pages, rope_pages, block_tables, kv_lens,
                cu_seqlens_q, num_seqs: see the class; arrays, tracers or ShapeDtypeStructs.
            sm_scale: the softmax scale (a positive Python number; DeepSeek's is
                `(qk_nope_head_dim + qk_rope_head_dim) ** -0.5` times YaRN's mscale**2).
            max_q_len: static bound on any chunk's length (defaults to T, clipped to T).

        Raises:
            KernelArgumentError: naming the field with the wrong rank, shape, dtype or value.
        """
        ql, qr, lp, rp = (_shape(x) for x in (q_latent, q_rope, latent_pages, rope_pages))
        require(len(ql) == 3, "q_latent", f"expected rank 3 [T, Hq, Dl], got shape {ql}")
        require(len(qr) == 3 and qr[:2] == ql[:2], "q_rope",
                f"expected [T, Hq, Dr] with q_latent's T, Hq = {ql[:2]}, got shape {qr}")
        require(len(lp) == 3 and lp[2] == ql[2], "latent_pages",
                f"expected [num_blocks, block_size, {ql[2]}], got shape {lp}")
        require(len(rp) == 3 and rp[:2] == lp[:2] and rp[2] == qr[2], "rope_pages",
                f"expected [{lp[0]}, {lp[1]}, {qr[2]}] (latent_pages' blocks, q_rope's Dr), "
                f"got shape {rp}")
        tables = _shape(block_tables)
        require(len(tables) == 2, "block_tables",
                f"expected rank 2 [S, max_blocks], got shape {tables}")
        s = tables[0]
        require(_shape(kv_lens) == (s,), "kv_lens", f"expected shape ({s},), got {_shape(kv_lens)}")
        require(_shape(cu_seqlens_q) == (s + 1,), "cu_seqlens_q",
                f"expected shape ({s + 1},), got {_shape(cu_seqlens_q)}")
        require(_shape(num_seqs) == (), "num_seqs",
                f"expected a scalar, got shape {_shape(num_seqs)}")
        for name, x in (("block_tables", block_tables), ("kv_lens", kv_lens),
                        ("cu_seqlens_q", cu_seqlens_q)):
            require(jnp.issubdtype(_dtype(x), jnp.integer), name,
                    f"expected an integer dtype, got {_dtype(x)}")
        require(isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)
                and math.isfinite(sm_scale) and sm_scale > 0, "sm_scale",
                f"expected a positive Python float, got {sm_scale!r}")
        t = ql[0]
        max_q_len = t if max_q_len is None else max_q_len
        require(isinstance(max_q_len, int) and max_q_len >= 1, "max_q_len",
                f"expected a positive int, got {max_q_len!r}")
        i32 = jnp.int32
        return cls(q_latent=q_latent, q_rope=q_rope, latent_pages=latent_pages,
                   rope_pages=rope_pages, block_tables=_cast(block_tables, i32),
                   kv_lens=_cast(kv_lens, i32), cu_seqlens_q=_cast(cu_seqlens_q, i32),
                   num_seqs=_cast(num_seqs, i32), sm_scale=float(sm_scale),
                   max_q_len=min(max_q_len, t))

    @property
    def num_tokens(self) -> int:
        return self.q_latent.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q_latent.shape[1]

    @property
    def latent_dim(self) -> int:
        """Dl: `kv_lora_rank`."""
        return self.q_latent.shape[2]

    @property
    def rope_dim(self) -> int:
        """Dr: `qk_rope_head_dim`."""
        return self.q_rope.shape[2]

    @property
    def block_size(self) -> int:
        return self.latent_pages.shape[1]

    @property
    def seq_bucket(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]
