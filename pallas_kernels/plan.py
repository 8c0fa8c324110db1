"""Tiling plan shared by the vectorized and Pallas implementations.

A ragged batch is cut into *query tiles*: `block_q` consecutive query tokens of
one sequence. Tile `w` belongs to sequence `seq[w]` and covers flat rows
`q_start[w] .. q_start[w] + block_q - 1`, of which only those below `q_end[w]`
are real. Its first row sits at absolute position `first_pos[w]`, so row `r`
attends keys `0 .. first_pos[w] + r` (bottom-right causal). The number of
tiles depends on the traced lengths, so the plan fixes a static upper bound
`num_tiles` and marks tiles `>= num_live` as idle.

NOTE: nothing here depends on how a kernel is lowered (Triton, Mosaic GPU or
plain XLA); implementations share this index math and differ only in how they
walk the tiles.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TilePlan:
    """Static tile sizes; hashable, so it can be a jit static."""

    block_q: int  # query tokens per tile
    block_k: int  # keys per inner step; a multiple of the page size
    page_size: int  # the cache's block_size
    num_tiles: int  # static upper bound on live tiles
    # Every tile runs at the full block_q (the xla path's batch-invariant mode): a row's
    # arithmetic is then the same whatever its tile holds besides it.
    one_width: bool = False

    @property
    def pages_per_step(self) -> int:
        return self.block_k // self.page_size


def make_plan(*, num_tokens: int, num_seqs: int, page_size: int, max_blocks: int,
              max_q_len: int, block_q: int, block_k: int,
              pow2_tiles: bool = False, min_block_k: int = 1,
              one_width: bool = False) -> TilePlan:
    """Builds the static plan for a bucket of `num_tokens` rows and `num_seqs` sequences.

    Args:
        num_tokens: T, rows of q (the token bucket).
        num_seqs: S, rows of block_tables (the sequence bucket).
        page_size: keys per cache page.
        max_blocks: block-table width; no sequence has more keys than
            `max_blocks * page_size`, so block_k never needs to exceed that.
        max_q_len: static bound on any sequence's query length.
        block_q: query tokens per tile; clipped to max_q_len.
        block_k: target keys per inner step; rounded up to whole pages and
            capped at a whole table.
        pow2_tiles: keep block_q and the pages per step powers of two (GPU
            tiles need power-of-two shapes): caps round up, not down.
        min_block_k: smallest block_k allowed (a GPU matmul dimension).
        one_width: every tile is block_q rows wide, block_q not clipped to max_q_len
            (`TilePlan.one_width`).
    """
    cap = next_pow2(max_q_len) if pow2_tiles else max_q_len
    block_q = block_q if one_width else max(1, min(block_q, cap))
    pages = min(cdiv(block_k, page_size), max_blocks)
    pages = max(pages, cdiv(min_block_k, page_size), 1)
    if pow2_tiles:
        pages = next_pow2(pages)
    # sum_s cdiv(q_len_s, block_q) <= sum_s (q_len_s // block_q + 1) <= T // block_q + S.
    num_tiles = min(num_tokens // block_q + num_seqs, num_seqs * cdiv(max_q_len, block_q))
    return TilePlan(block_q=block_q, block_k=pages * page_size, page_size=page_size,
                    num_tiles=max(1, num_tiles), one_width=one_width)


class TileMetadata(NamedTuple):
    """Per-tile device arrays, each `[num_tiles]` int32, plus the live count."""

    seq: jax.Array  # sequence owning the tile
    q_start: jax.Array  # first flat query row
    q_end: jax.Array  # end (exclusive) of the sequence's rows; rows past it are idle
    first_pos: jax.Array  # absolute position of the tile's first row
    kv_len: jax.Array  # keys of the tile's sequence
    num_live: jax.Array  # scalar: tiles `>= num_live` do nothing


def tile_metadata(plan: TilePlan, kv_lens: jax.Array, cu_seqlens_q: jax.Array,
                  num_seqs: jax.Array) -> TileMetadata:
    """Assigns query tiles to sequences; traced, static shapes only.

    Args:
        plan: the static plan.
        kv_lens: [S] keys per sequence, this step's included.
        cu_seqlens_q: [S + 1] prefix sums of query lengths.
        num_seqs: scalar, live sequences.
    """
    s_max = kv_lens.shape[0]
    live = jnp.arange(s_max) < num_seqs  # [S]
    q_lens = jnp.where(live, cu_seqlens_q[1:] - cu_seqlens_q[:-1], 0)  # [S]
    tiles = cdiv(q_lens, plan.block_q)  # [S]
    tiles_end = jnp.cumsum(tiles)  # [S] inclusive prefix sums
    w = jnp.arange(plan.num_tiles, dtype=jnp.int32)  # [W]
    # First sequence whose tile range ends after w; idle tiles clamp to the last.
    seq = jnp.minimum(jnp.searchsorted(tiles_end, w, side="right"), s_max - 1).astype(jnp.int32)
    tile_in_seq = w - (tiles_end[seq] - tiles[seq])  # [W]
    q_rel = tile_in_seq * plan.block_q  # [W] first row inside the chunk
    num_live = tiles_end[-1]
    idle = w >= num_live  # idle tiles get an empty row range at row 0
    kv_len = kv_lens[seq]  # [W]
    q_start = jnp.where(idle, 0, cu_seqlens_q[seq] + q_rel)
    return TileMetadata(
        seq=seq,
        q_start=q_start,
        q_end=jnp.where(idle, 0, cu_seqlens_q[seq] + q_lens[seq]),
        first_pos=jnp.where(idle, 0, kv_len - q_lens[seq] + q_rel),
        kv_len=kv_len,
        num_live=num_live,
    )


def kv_steps(plan: TilePlan, first_pos: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inner-loop bounds of a tile with `rows` real rows starting at `first_pos`.

    A tile with no rows has no steps.

    Returns:
        (unmasked, total): steps `[0, unmasked)` hold only keys every row may see
        (no mask needed); steps `[unmasked, total)` straddle the causal diagonal;
        steps past `total` are fully masked and skipped.
    """
    last_pos = first_pos + rows - 1
    total = jnp.where(rows > 0, cdiv(last_pos + 1, plan.block_k), 0)
    unmasked = (first_pos + 1) // plan.block_k
    return jnp.minimum(unmasked, total), total


def window_start(plan: TilePlan, first_pos: jax.Array, window: jax.Array | None) -> jax.Array:
    """First key step a tile starting at `first_pos` needs under a sliding window.

    Row 0 sees keys `(first_pos - window, first_pos]` and later rows slide right, so
    key steps wholly before `first_pos - window + 1` are skipped. No window: step 0.
    """
    if window is None:
        return jnp.zeros_like(first_pos)
    return jnp.maximum(first_pos - window + 1, 0) // plan.block_k


def window_full_start(plan: TilePlan, first_pos: jax.Array, rows: jax.Array,
                      window: jax.Array | None) -> jax.Array:
    """First key step every row of a tile sees whole under a sliding window: its keys are
    not older than the last row's window, `first_pos + rows - window`. No window: step 0.

    Together with `kv_steps`, a windowed tile's steps are: [window_start, full) straddle
    the window's left edge (masked), [full, unmasked) need no mask, [unmasked, total)
    straddle the causal diagonal (masked); when full >= unmasked, all are masked.
    """
    if window is None:
        return jnp.zeros_like(first_pos)
    return cdiv(jnp.maximum(first_pos + rows - window, 0), plan.block_k)


def longest_first(plan: TilePlan, meta: TileMetadata,
                  window: jax.Array | None = None) -> TileMetadata:
    """Reorders the tiles by key steps, most first (idle tiles, with none, stay last).

    A GPU starts programs roughly in launch order; starting the longest causal tiles
    first keeps the last wave from being one long tile on an otherwise idle GPU.
    Under a sliding window a tile's steps start at `window_start`. `num_live` is
    unchanged: every live tile has at least one step.
    """
    rows = jnp.where(jnp.arange(plan.num_tiles) < meta.num_live,
                     jnp.clip(meta.q_end - meta.q_start, 0, plan.block_q), 0)
    _, total = kv_steps(plan, meta.first_pos, rows)  # [W]
    total = total - jnp.minimum(window_start(plan, meta.first_pos, window), total)
    order = jnp.argsort(-total, stable=True)
    return meta._replace(**{name: getattr(meta, name)[order]
                            for name in meta._fields if name != "num_live"})
