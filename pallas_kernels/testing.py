"""Batch factories for kernel tests and benchmarks (not used by the engine).

`make_batch` builds one ragged paged-attention input from a list of
`(q_len, kv_len)` pairs, the way the runner pads a step to its buckets:
sequence rows past `num_seqs` and query rows past `cu_seqlens_q[num_seqs]`
are padding. `Batch.args()` gives its arrays in `ragged_paged_attention`'s
order, `Batch.inputs(...)` the `AttentionInputs` the implementations take.
`make_mla_batch` is the same for latent attention (`MLABatch.inputs(...)`: `MLAInputs`).
`make_device_batch` (`make_mla_device_batch` for latent attention), `attention_work` and
`time_ms` serve the benchmarks (`scripts/bench_kernels.py`, `scripts/gpu_check.py`).
"""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paging, plan
from pallas_kernels.attention_inputs import AttentionInputs
from pallas_kernels.mla_inputs import MLAInputs


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
        """The arrays in `ragged_paged_attention`'s order."""
        return (self.q, self.k_pages, self.v_pages, self.block_tables, self.kv_lens,
                self.cu_seqlens_q, self.num_seqs)

    def inputs(self, **settings) -> AttentionInputs:
        """The batch as one call's inputs; `settings` are `AttentionInputs.create`'s
        (sm_scale, sliding_window, logit_softcap, k_scale, v_scale, max_q_len)."""
        return AttentionInputs.create(
            q=self.q, k_pages=self.k_pages, v_pages=self.v_pages, block_tables=self.block_tables,
            kv_lens=self.kv_lens, cu_seqlens_q=self.cu_seqlens_q, num_seqs=self.num_seqs,
            **settings)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLABatch:
    q_latent: jax.Array  # [T, Hq, Dl]
    q_rope: jax.Array  # [T, Hq, Dr]
    latent_pages: jax.Array  # [num_blocks, block_size, Dl]
    rope_pages: jax.Array  # [num_blocks, block_size, Dr]
    block_tables: jax.Array  # [S, max_blocks] int32
    kv_lens: jax.Array  # [S] int32
    cu_seqlens_q: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # scalar int32

    def args(self) -> tuple[jax.Array, ...]:
        """The arrays in `ragged_paged_mla`'s order."""
        return (self.q_latent, self.q_rope, self.latent_pages, self.rope_pages,
                self.block_tables, self.kv_lens, self.cu_seqlens_q, self.num_seqs)

    def inputs(self, **settings) -> MLAInputs:
        """The batch as one call's inputs; `settings`: sm_scale, max_q_len."""
        return MLAInputs.create(
            q_latent=self.q_latent, q_rope=self.q_rope, latent_pages=self.latent_pages,
            rope_pages=self.rope_pages, block_tables=self.block_tables, kv_lens=self.kv_lens,
            cu_seqlens_q=self.cu_seqlens_q, num_seqs=self.num_seqs, **settings)


def make_mla_batch(seqs: list[tuple[int, int]], *, num_heads: int, latent_dim: int,
                   rope_dim: int, block_size: int, **options) -> MLABatch:
    """A ragged latent-attention batch: `make_batch`'s layout (the same `seqs`, buckets,
    scrambled pages and NaN fill, from `options`) with one latent "head" of `latent_dim`
    and rope keys of `rope_dim` per token."""
    lat = make_batch(seqs, num_heads=num_heads, num_kv_heads=1, head_dim=latent_dim,
                     block_size=block_size, **options)
    # The same seed draws the same page order and tables; only the values differ.
    pe = make_batch(seqs, num_heads=num_heads, num_kv_heads=1, head_dim=rope_dim,
                    block_size=block_size, **options)
    return MLABatch(q_latent=lat.q, q_rope=pe.q, latent_pages=lat.k_pages[:, :, 0],
                    rope_pages=pe.k_pages[:, :, 0], block_tables=lat.block_tables,
                    kv_lens=lat.kv_lens, cu_seqlens_q=lat.cu_seqlens_q, num_seqs=lat.num_seqs)


def make_device_batch(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int, dtype, key: jax.Array) -> Batch:
    """A benchmark-sized batch drawn on the device, bucket-padded like the runner.

    Tokens pad to a multiple of 128 (none for a single token), sequences to a power of
    two >= 8; pages are handed out in a random order. Unlike `make_batch`, nothing
    is NaN-filled and the table has no garbage past each sequence's pages.
    """
    q_lens = np.array([q for q, _ in seqs])
    kv_lens = np.array([k for _, k in seqs])
    n, total = len(seqs), int(q_lens.sum())
    num_tokens = total if total <= 1 else -(-total // 128) * 128
    pages = -(-kv_lens // block_size)
    num_blocks = int(pages.sum())
    kq, kk, kv, kp = jax.random.split(key, 4)
    order = np.asarray(jax.random.permutation(kp, num_blocks))
    first = np.concatenate([[0], np.cumsum(pages)])
    layout = paging.paged_layout(kv_lens - q_lens, q_lens,
                                 [order[first[s]:first[s + 1]] for s in range(n)],
                                 token_bucket=num_tokens, seq_bucket=max(8, plan.next_pow2(n)),
                                 max_blocks=int(pages.max()), block_size=block_size,
                                 num_blocks=num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return Batch(q=jax.random.normal(kq, (num_tokens, num_heads, head_dim), dtype),
                 k_pages=jax.random.normal(kk, shape, dtype),
                 v_pages=jax.random.normal(kv, shape, dtype),
                 block_tables=jnp.asarray(layout.block_tables),
                 kv_lens=jnp.asarray(layout.kv_lens),
                 cu_seqlens_q=jnp.asarray(layout.cu_seqlens_q),
                 num_seqs=jnp.int32(layout.num_seqs))


def make_mla_device_batch(seqs: list[tuple[int, int]], *, num_heads: int, latent_dim: int,
                          rope_dim: int, block_size: int, dtype, key: jax.Array) -> MLABatch:
    """`make_device_batch`'s layout (buckets, random page order) for latent attention: one
    latent "head" of `latent_dim` and rope keys of `rope_dim` per token."""
    lat, pe = (make_device_batch(seqs, num_heads=num_heads, num_kv_heads=1, head_dim=d,
                                 block_size=block_size, dtype=dtype, key=key)
               for d in (latent_dim, rope_dim))  # one key: the same pages and tables
    return MLABatch(q_latent=lat.q, q_rope=pe.q, latent_pages=lat.k_pages[:, :, 0],
                    rope_pages=pe.k_pages[:, :, 0], block_tables=lat.block_tables,
                    kv_lens=lat.kv_lens, cu_seqlens_q=lat.cu_seqlens_q, num_seqs=lat.num_seqs)


def attention_work(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
                   head_dim: int, itemsize: int) -> tuple[float, float]:
    """(FLOPs of the causal work, bytes of K and V each read once) of a batch."""
    flops = kv_bytes = 0.0
    for q_len, kv_len in seqs:
        keys_seen = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2  # bottom-right causal
        flops += 4.0 * num_heads * head_dim * keys_seen  # QK^T and PV
        kv_bytes += 2.0 * kv_len * num_kv_heads * head_dim * itemsize
    return flops, kv_bytes


def time_ms(fn, args, *, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn(*args)`, each call synchronized."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(1, iters)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
