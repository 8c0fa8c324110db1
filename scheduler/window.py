"""Sliding-window KV memory: blocks no query will read again go back to the pool.

For a model whose every layer attends over a window of W keys (a query at position p sees keys
in (p - W, p]), a running sequence whose next query sits at position c (its cursor) never reads
a key below c - W + 1 again: later queries sit further right. Its blocks wholly below that key
are released when a step is planned (`StepBuilder` calls `slide` first), and its table keeps
their places as `RELEASED` entries, so block index i still covers positions i*bs .. i*bs + bs-1.

  * The device reads a released entry as page 0 (`pallas_kernels.paging`); attention masks
    every key outside the window, so whatever that page holds never reaches an output.
  * Overlapped scheduling plans step N+1 before step N ran; a block released then and reused
    by step N+1 is written only after step N read it (the device runs steps in order).
  * Prefix caching: a released cached block keeps its KV and becomes evictable, like any block
    its last holder gives back. A waiting sequence reuses a cached prefix of n blocks when the
    blocks its first computed query reads, `first_needed(n * bs) .. n - 1`, are all cached
    (`window_prefix`); the blocks before them need not be cached any more, and stay RELEASED
    in its table. Their digests chain from the first token, so a hit is the same prefix.

Mixed local/global models (Gemma 2/3) keep one table per KV cache group: scheduler/kv_groups.py
applies this rule to each sliding group (`slide_groups`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from scheduler.blocks import BlockPool
from scheduler.prefix import PrefixCache
from scheduler.state import DecodeTable, Partial

# A block-table entry whose block went back to the pool (outside every later query's window).
RELEASED = None


def first_needed(position: int, window: int, block_size: int) -> int:
    """The first block a query at `position` (or any later one) reads under `window`."""
    return max(0, position - window + 1) // block_size


def slid(table: tuple, cursor: int, window: int, block_size: int) -> tuple[tuple, tuple]:
    """(`table` with the blocks before the window of a query at `cursor` RELEASED, the blocks
    released now)."""
    n = first_needed(cursor, window, block_size)
    if not n or table[n - 1] is RELEASED:
        return table, ()
    freed = tuple(b for b in table[:n] if b is not RELEASED)
    return (RELEASED,) * n + table[n:], freed


def slide(dec: DecodeTable, partial: list[Partial], pool: BlockPool, window: int,
          block_size: int) -> tuple[DecodeTable, BlockPool, bool]:
    """Releases every running sequence's blocks wholly behind its window: returns the decode
    table, the pool, and whether some partial prefill's table changed (`partial`, the
    planner's scratch list, is updated in place)."""
    # NOTE: a decode row releases a block once per block_size steps: find those rows with two
    # comprehensions (no call per row), then slide only them.
    firsts = [(c - window + 1) // block_size for c in dec.computed]
    rows = [i for i, (n, t) in enumerate(zip(firsts, dec.tables))
            if n > 0 and t[n - 1] is not RELEASED]
    if rows:
        tables = list(dec.tables)
        for i in rows:
            tables[i], freed = slid(tables[i], dec.computed[i], window, block_size)
            pool = pool.give(freed)
        dec = dec.with_progress(tables=tuple(tables))
    changed = False
    for j, part in enumerate(partial):
        table, freed = slid(part.table, part.computed, window, block_size)
        if freed:
            partial[j] = dataclasses.replace(part, table=table)
            pool = pool.give(freed)
            changed = True
    return dec, pool, changed


def window_prefix(cache: PrefixCache, digests: Sequence[bytes], window: int,
                  block_size: int) -> tuple:
    """The longest cached prefix a sequence can reuse under `window`: the largest n <=
    len(digests) whose blocks first_needed(n * bs) .. n - 1 are all cached. Returns its table:
    RELEASED for the blocks before them, then the cached blocks (() when nothing is usable).

    One lookup per block at most, scanning from the end (the blocks before a window may have
    been evicted while the window's own are still cached).
    """
    end = len(digests)  # candidate prefix: blocks 0 .. end - 1
    found: list[int] = []  # cached blocks end - 1, end - 2, ... (newest first)
    j = end - 1
    while j >= first_needed(end * block_size, window, block_size):
        block = cache.lookup(digests[j])
        if block is None:  # no prefix may end after j: try ending at j
            end, found = j, []
        else:
            found.append(block)
        j -= 1
    if not end:
        return ()
    first = first_needed(end * block_size, window, block_size)
    return (RELEASED,) * first + tuple(reversed(found))
