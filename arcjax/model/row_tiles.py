"""Row-wise work over fixed row tiles: what makes a row's bits independent of its batch.

XLA:CPU picks a matrix product's strategy (a matrix-vector product for one row, tiled
products of several sizes above) and a fused reduction's vectorization from the operand
shapes, so one row's result depends on how many rows share the call
(docs/design/batch-invariance.md). `RowTiles.map(fn, *arrays)` runs `fn` over the rows of
`arrays` `tile` rows at a time, each tile cut out of the (padded) rows by a dynamic slice:
every call of `fn` sees the same shapes whatever the bucket, and a row's result does not
depend on where in its tile it sits or what the other rows hold (XLA:CPU's products and
reductions compute each row of a fixed-shape operand alike; the batch-invariance tests
check it end to end).

The loop must stay a loop in every bucket: a tile whose computation XLA moves out of it is
fused with its neighbours, whose shapes follow the bucket. Its trip count is traced
(`live`: the rows that hold real work), so no count XLA knows lets it simplify the loop
away; and the rows are padded with one tile more than they fill, so no bucket's tile is
its whole operand (a dynamic slice as large as its operand starts at 0 whatever its index:
XLA then hoists the body out of the loop as loop-invariant, and the unrolled layer loop's
one-tile decode buckets computed a Gemma 2 row differently from their eight-row
neighbours, RESULTS.md "The unrolled loop in the mode"). Rows past `live` are not
computed; their outputs are zeros.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp

INVARIANT_ROWS = 8  # rows per tile in batch-invariant mode (the attention's query tile too)
class _Tracing(threading.local):
    """Per thread (steps may be traced on several): the live rows of each tile whose
    function is being traced, innermost last."""

    def __init__(self):
        self.stack = []


_TRACING = _Tracing()


def tile_live_rows() -> jax.Array | None:
    """The live rows of the row tile whose function `RowTiles.map` is tracing now on this
    thread ([] int32, traced, in [0, tile]), or None outside one. A row-invariant kernel
    called inside the tile computes only those (`packed_matmul.matmul`'s "cpu": a lone
    request's products then stream the weights for its one row, not for a whole tile)."""
    return _TRACING.stack[-1] if _TRACING.stack else None


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """Runs row-wise functions tile by tile.

    Attributes:
      live: [] int32 (traced), rows holding real work (a prefix of the rows).
      tile: rows per call of the function (static).
    """

    live: jax.Array
    tile: int = INVARIANT_ROWS

    def map(self, fn, *arrays):
        """fn(*tiles) -> a pytree of [tile, ...] arrays, over every tile of `arrays` (each a
        pytree of [N, ...] arrays, one N). Returns fn's pytree of [N, ...] arrays."""
        rows, _ = self.map_summed(lambda *xs: (fn(*xs), None), *arrays)
        return rows

    def map_summed(self, fn, *arrays):
        """fn(*tiles) -> (pytree of [tile, ...] arrays, pytree of totals): as `map`, and the
        totals summed over the live tiles (integer counts: exact in any order)."""
        leaves = jax.tree.leaves(arrays)
        n = leaves[0].shape[0]
        pad = -n % self.tile + self.tile  # one spare tile: the slice is never the whole
        padded = jax.tree.map(
            lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)), arrays)
        first = jax.tree.map(lambda a: a[:self.tile], padded)
        rows_shape, totals_shape = jax.eval_shape(fn, *first)
        rows = jax.tree.map(lambda s: jnp.zeros((n + pad, *s.shape[1:]), s.dtype), rows_shape)
        totals = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), totals_shape)

        def body(i, carry):
            out, acc = carry
            start = i * self.tile
            tiles = jax.tree.map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, start, self.tile), padded)
            _TRACING.stack.append(jnp.clip(self.live - start, 0, self.tile))
            try:
                y, t = fn(*tiles)
            finally:
                _TRACING.stack.pop()
            out = jax.tree.map(
                lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, v, start, 0), out, y)
            return out, jax.tree.map(jnp.add, acc, t)

        count = (self.live + self.tile - 1) // self.tile
        rows, totals = jax.lax.fori_loop(0, count, body, (rows, totals))
        return jax.tree.map(lambda a: a[:n], rows), totals

    def with_tile(self, tile: int) -> "RowTiles":
        """The same live rows, `tile` rows per call."""
        return dataclasses.replace(self, tile=tile)
