"""Vectorized jnp latent attention (MLA, absorbed): the CPU path and the fallback.

The same walk as `xla.py` (`plan.tile_metadata` query tiles, `xla.walk_tiles` at the
narrowest row width, padding rows zero), with the MLA score of `MLAInputs`: every query
head of a tile's rows is one row of `M = rows * Hq` against the one latent "head", so a
key block is read once for all heads:

    s = q_latent @ latent^T + q_rope @ rope^T   # [M, bk]
    acc += softmax-weights @ latent             # [M, Dl]

with an online softmax over key blocks up to the tile's causal frontier. Math is float32
whatever the input dtype; memory is `M x block_k` scores per step.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import plan as plan_lib
from pallas_kernels.mla_inputs import MLAInputs
from pallas_kernels.xla import padded_tables, walk_tiles


def _tile(rows: int, tiles: plan_lib.TilePlan, inputs: MLAInputs, q_lat: jax.Array,
          q_rope: jax.Array, table: jax.Array, q_start: jax.Array, first_pos: jax.Array,
          kv_len: jax.Array, n_rows: jax.Array) -> jax.Array:  # [rows, Hq, Dl] float32
    """One tile: `rows` (static) query tokens from `q_start`, `n_rows` of them real."""
    _, hq, dl = q_lat.shape
    dr = q_rope.shape[2]
    bk, pps = tiles.block_k, tiles.pages_per_step
    r = jnp.arange(rows)
    real = r < n_rows
    pos = jnp.repeat(jnp.where(real, first_pos + r, -1), hq)  # [M]; idle rows see no key

    def rows_of(q, width):  # [rows * Hq, width] float32, zero (NaN-free) on idle rows
        x = jax.lax.dynamic_slice_in_dim(q, q_start, rows).astype(jnp.float32)
        return jnp.where(real[:, None, None], x, 0).reshape(rows * hq, width)

    ql = rows_of(q_lat, dl) * inputs.sm_scale  # [M, Dl]
    qr = rows_of(q_rope, dr) * inputs.sm_scale  # [M, Dr]
    _, total = plan_lib.kv_steps(tiles, first_pos, n_rows)

    def step(i, carry):
        m, l, acc = carry  # [M], [M], [M, Dl]
        pages = jax.lax.dynamic_slice_in_dim(table, i * pps, pps)  # [pps]
        keys = i * bk + jnp.arange(bk)  # [bk]
        key_ok = keys < kv_len  # pages past kv_len may hold anything, NaN included
        c = inputs.latent_pages[pages].reshape(bk, dl).astype(jnp.float32)  # [bk, Dl]
        pe = inputs.rope_pages[pages].reshape(bk, dr).astype(jnp.float32)  # [bk, Dr]
        c = jnp.where(key_ok[:, None], c, 0)
        pe = jnp.where(key_ok[:, None], pe, 0)
        s = ql @ c.T + qr @ pe.T  # [M, bk]
        ok = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.where(ok, jnp.exp(s - m_safe[:, None]), 0)
        alpha = jnp.exp(m - m_safe)
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[:, None] * acc + p @ c

    m_rows = rows * hq
    init = (jnp.full((m_rows,), -jnp.inf), jnp.zeros((m_rows,)), jnp.zeros((m_rows, dl)))
    _, l, acc = jax.lax.fori_loop(0, total, step, init)
    return (acc / jnp.where(l > 0, l, 1)[:, None]).reshape(rows, hq, dl)


def mla_attention_xla(inputs: MLAInputs, tiles: plan_lib.TilePlan) -> jax.Array:
    """See `pallas_kernels.mla.ragged_paged_mla`. Returns [T, Hq, Dl] in q_latent's dtype."""
    q_lat, q_rope = inputs.q_latent, inputs.q_rope
    t, hq, dl = q_lat.shape
    bq = tiles.block_q
    meta = plan_lib.tile_metadata(tiles, inputs.kv_lens, inputs.cu_seqlens_q, inputs.num_seqs)
    tables = padded_tables(tiles, inputs.block_tables, inputs.latent_pages.shape[0])
    ql_pad = jnp.pad(q_lat, ((0, bq), (0, 0), (0, 0)))  # [T + bq, Hq, Dl]
    qr_pad = jnp.pad(q_rope, ((0, bq), (0, 0), (0, 0)))  # [T + bq, Hq, Dr]

    def attend(width, w, n_rows):
        return _tile(width, tiles, inputs, ql_pad, qr_pad, tables[meta.seq[w]],
                     meta.q_start[w], meta.first_pos[w], meta.kv_len[w], n_rows)

    return walk_tiles(tiles, meta, t, (hq, dl), q_lat.dtype, attend)
