"""Batch factories for kernel tests and benchmarks (not used by the engine).

`make_batch` builds one ragged paged-attention input from a list of
`(q_len, kv_len)` pairs, the way the runner pads a step to its buckets:
sequence rows past `num_seqs` and query rows past `cu_seqlens_q[num_seqs]`
are padding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paging


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    q: jax.Array  # [T, Hq, D]
    k_pages: jax.Array  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array  # [num_blocks, block_size, Hkv, D]
    block_tables: jax.Array  # [S, max_blocks] int32
    kv_lens: jax.Array  # [S] int32
    cu_seqlens_q: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # scalar int32

    def args(self) -> tuple[jax.Array, ...]:
        return (self.q, self.k_pages, self.v_pages, self.block_tables, self.kv_lens,
                self.cu_seqlens_q, self.num_seqs)


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_tokens: int | None = None,
    seq_bucket: int | None = None,
    max_blocks: int | None = None,
    num_blocks: int | None = None,
    dtype=jnp.float32,
    scramble: bool = True,
    nan_fill: bool = True,
    seed: int = 0,
) -> Batch:
    """A ragged batch with random q/k/v, pages allocated per sequence.

    Args:
        seqs: `(q_len, kv_len)` per live sequence; needs `q_len <= kv_len`.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        block_size: keys per page.
        num_tokens: T (token bucket); defaults to the total query length.
        seq_bucket: S (sequence bucket); defaults to `len(seqs)`.
        max_blocks: block-table width; defaults to what the longest sequence needs.
        num_blocks: pages in the cache; defaults to what the sequences need plus
            one unowned page (garbage / NaN).
        dtype: q and page dtype.
        scramble: hand pages out in a random order instead of 0, 1, 2, ...
        nan_fill: fill every cache slot past a sequence's kv_len, every unowned
            page and every padding query row with NaN.
        seed: numpy seed.
    """
    rng = np.random.default_rng(seed)
    q_lens = np.array([ql for ql, _ in seqs], np.int32)
    kv_lens = np.array([kl for _, kl in seqs], np.int32)
    if np.any(q_lens > kv_lens):
        raise ValueError(f"seqs: q_len must not exceed kv_len, got {seqs}")
    n = len(seqs)
    s_bucket = n if seq_bucket is None else seq_bucket
    t = int(q_lens.sum()) if num_tokens is None else num_tokens
    t = max(t, 1)
    pages_needed = -(-kv_lens // block_size)  # [n]
    width = max(1, int(pages_needed.max(initial=0))) if max_blocks is None else max_blocks
    if num_blocks is None:
        num_blocks = int(pages_needed.sum()) + 1
    if num_blocks < pages_needed.sum():
        raise ValueError(
            f"num_blocks: {num_blocks} pages cannot hold {seqs} at block_size {block_size}")
    order = rng.permutation(num_blocks) if scramble else np.arange(num_blocks)
    first_page = np.concatenate([[0], np.cumsum(pages_needed)])  # [n + 1]
    seq_pages = [order[first_page[s]:first_page[s + 1]] for s in range(n)]
    layout = paging.paged_layout(kv_lens - q_lens, q_lens, seq_pages, token_bucket=t,
                                 seq_bucket=s_bucket, max_blocks=width, block_size=block_size,
                                 num_blocks=num_blocks)
    # Table entries past a sequence's pages (and padding rows) hold garbage page ids.
    tables = layout.block_tables.copy()
    unused = np.arange(width)[None, :] >= np.pad(pages_needed, (0, s_bucket - n))[:, None]
    tables[unused] = rng.integers(0, num_blocks, size=int(unused.sum()))

    k = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), np.float32)
    q = rng.standard_normal((t, num_heads, head_dim), np.float32)
    if nan_fill:  # every slot past a sequence's keys, and every padding query row
        # The same layout over whole sequences (every key "new") names every owned slot.
        keys = paging.paged_layout(np.zeros(n, np.int64), kv_lens, seq_pages,
                                   token_bucket=int(kv_lens.sum()), seq_bucket=n,
                                   max_blocks=width, block_size=block_size,
                                   num_blocks=num_blocks)
        owned = np.zeros(num_blocks * block_size, bool)
        owned[keys.slot_mapping] = True
        owned = owned.reshape(num_blocks, block_size)
        k[~owned] = np.nan
        v[~owned] = np.nan
        q[layout.num_tokens:] = np.nan
    return Batch(
        q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype),
        block_tables=jnp.asarray(tables), kv_lens=jnp.asarray(layout.kv_lens),
        cu_seqlens_q=jnp.asarray(layout.cu_seqlens_q), num_seqs=jnp.int32(layout.num_seqs))
