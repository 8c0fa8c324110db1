"""Vectorized jnp ragged paged attention: the CPU engine's path and the fallback.

Dataflow:
    1. `plan.tile_metadata` cuts the ragged batch into query tiles of up to
       `block_q` tokens of one sequence (static count; idle tiles marked).
    2. A loop walks the live tiles only (traced bound). Each tile picks, by its
       real row count, the narrowest of a few static row widths (`ROW_WIDTHS`),
       so a decode row costs one row of work, not `block_q`.
    3. Inside a tile, an online softmax walks the keys `block_k` at a time, up
       to the tile's causal frontier (traced bound): fully masked key blocks
       are never touched.
    4. Real rows are written back into the flat `[T, Hq, D]` output, outside the
       width's branch (the loop carry updated in place); padding rows stay exactly zero.

Memory is `Hq x block_q x block_k` scores per step: never `T x total_keys`.
Math is float32 whatever the input dtype.

NOTE: a batched pass over all decode rows at once (one `[S, block_k]` gather
per step) measured slower on CPU than walking decode tiles one by one (64
sequences x 1k keys: 110 ms vs 68 ms, same load), so decode rows take the
tile loop too.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import plan as plan_lib
from pallas_kernels.attention_inputs import AttentionInputs

ROW_WIDTHS = (1, 8, 32, 128)  # static tile widths a tile may shrink to


def _tile_attention(
    rows: int,  # static width of this branch
    tiles: plan_lib.TilePlan,
    inputs: AttentionInputs,  # the pages, the options and sm_scale
    q: jax.Array,  # [T + block_q, Hq, D] padded
    table: jax.Array,  # [max_blocks_padded] this sequence's pages
    q_start: jax.Array,  # scalar: first flat row
    first_pos: jax.Array,  # scalar: absolute position of the first row
    kv_len: jax.Array,  # scalar
    n_rows: jax.Array,  # scalar: real rows, <= rows
) -> jax.Array:  # [rows, Hq, D] float32
    _, hq, d = q.shape
    hkv = inputs.num_kv_heads
    group = hq // hkv
    bk, pps = tiles.block_k, tiles.pages_per_step
    r = jnp.arange(rows)
    pos = jnp.where(r < n_rows, first_pos + r, -1)  # [rows]; idle rows see no key
    qt = jax.lax.dynamic_slice_in_dim(q, q_start, rows).astype(jnp.float32) * inputs.sm_scale
    qt = jnp.where((r < n_rows)[:, None, None], qt, 0)  # [rows, Hq, D], NaN-free
    qt = qt.reshape(rows, hkv, group, d).transpose(1, 0, 2, 3).reshape(hkv, rows * group, d)
    pos_m = jnp.repeat(pos, group)  # [M] with M = rows * G, row-major (row, g)
    _, total = plan_lib.kv_steps(tiles, first_pos, n_rows)
    start = jnp.minimum(plan_lib.window_start(tiles, first_pos, inputs.sliding_window), total)

    def step(i, carry):
        m, l, acc = carry  # [Hkv, M], [Hkv, M], [Hkv, M, D]
        pages = jax.lax.dynamic_slice_in_dim(table, i * pps, pps)  # [pps]
        keys = i * bk + jnp.arange(bk)  # [bk]
        # Keys the tile may read: below kv_len and not older than row 0's window (later
        # rows' windows start later). Others may hold anything, NaN included.
        key_ok = (keys < kv_len) & inputs.in_window(keys, first_pos)
        k = inputs.k_pages[pages].reshape(bk, hkv, d).transpose(1, 0, 2)  # [Hkv, bk, D]
        v = inputs.v_pages[pages].reshape(bk, hkv, d).transpose(1, 0, 2)  # [Hkv, bk, D]
        k, v = inputs.dequantize(k, v)  # float32
        v = jnp.where(key_ok[None, :, None], v, 0)
        s = inputs.softcap(jnp.einsum("hmd,hkd->hmk", qt, k))  # [Hkv, M, bk]
        ok = key_ok[None, :] & inputs.visible(keys[None, :], pos_m[:, None])  # [M, bk]
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.where(ok, jnp.exp(s - m_safe[..., None]), 0)  # [Hkv, M, bk]
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("hmk,hkd->hmd", p, v)
        return m_new, l, acc

    m_rows = rows * group
    init = (jnp.full((hkv, m_rows), -jnp.inf), jnp.zeros((hkv, m_rows)),
            jnp.zeros((hkv, m_rows, d)))
    m, l, acc = jax.lax.fori_loop(start, total, step, init)
    sinks = None
    if inputs.sinks is not None:  # [Hq] -> [Hkv, M], M row-major (row, g)
        sinks = jnp.tile(inputs.sinks.reshape(hkv, 1, group), (1, rows, 1)).reshape(hkv, m_rows)
    o = inputs.normalize(acc, m, l, sinks)  # [Hkv, M, D]
    return o.reshape(hkv, rows, group, d).transpose(1, 0, 2, 3).reshape(rows, hq, d)


def walk_tiles(tiles: plan_lib.TilePlan, meta: plan_lib.TileMetadata, num_tokens: int,
               row_shape: tuple[int, ...], dtype, attend) -> jax.Array:  # [T, *row_shape]
    """Steps 2 and 4 of the dataflow: every live tile at the narrowest of `ROW_WIDTHS`
    that holds its rows, its real rows written into a zeroed `[T, *row_shape]` output.

    `attend(width, w, n_rows) -> [width, *row_shape]` computes tile `w` (a traced index into
    `meta`) at the static `width`; rows at and past `n_rows` are discarded. Shared by the
    paged attention here and the latent attention of `mla_xla`."""
    bq = tiles.block_q
    widths = (bq,) if tiles.one_width else tuple(w for w in ROW_WIDTHS if w < bq) + (bq,)

    def tile(w, out):  # out: [T + bq, *row_shape]
        q_start = meta.q_start[w]
        n_rows = jnp.minimum(meta.q_end[w] - q_start, bq)

        def attend_padded(width):  # every branch returns bq rows: the write stays outside
            o = attend(width, w, n_rows).astype(out.dtype)
            return jnp.pad(o, ((0, bq - width),) + ((0, 0),) * len(row_shape))

        # The branch only computes; the loop carry is written after it. A branch that
        # wrote into `out` itself made XLA copy the whole [T + bq, ...] carry into and out
        # of the conditional once per tile (1.1-1.3x the prefill attention's time).
        which = jnp.searchsorted(jnp.array(widths), n_rows)  # narrowest width that fits
        o = jax.lax.switch(which, [functools.partial(attend_padded, wd) for wd in widths])
        old = jax.lax.dynamic_slice_in_dim(out, q_start, bq)
        keep = (jnp.arange(bq) < n_rows).reshape((bq,) + (1,) * len(row_shape))
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, o, old), q_start, 0)

    out = jax.lax.fori_loop(0, meta.num_live, tile,
                            jnp.zeros((num_tokens + bq, *row_shape), dtype))
    return out[:num_tokens]


def padded_tables(tiles: plan_lib.TilePlan, block_tables: jax.Array,
                  num_blocks: int) -> jax.Array:
    """[S, max_blocks padded to whole key steps]: entries past a sequence's pages (they may
    hold anything) clipped in bounds."""
    pad = (-block_tables.shape[1]) % tiles.pages_per_step
    return jnp.pad(jnp.clip(block_tables, 0, num_blocks - 1), ((0, 0), (0, pad)))


def ragged_paged_attention_xla(inputs: AttentionInputs,
                               tiles: plan_lib.TilePlan) -> jax.Array:  # [T, Hq, D]
    q = inputs.q  # [T, Hq, D]
    t, hq, d = q.shape
    meta = plan_lib.tile_metadata(tiles, inputs.kv_lens, inputs.cu_seqlens_q, inputs.num_seqs)
    tables = padded_tables(tiles, inputs.block_tables, inputs.k_pages.shape[0])
    q_pad = jnp.pad(q, ((0, tiles.block_q), (0, 0), (0, 0)))  # [T + bq, Hq, D]

    def attend(width, w, n_rows):
        return _tile_attention(width, tiles, inputs, q_pad, tables[meta.seq[w]],
                               meta.q_start[w], meta.first_pos[w], meta.kv_len[w], n_rows)

    return walk_tiles(tiles, meta, t, (hq, d), q.dtype, attend)
