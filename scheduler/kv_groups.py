"""KV cache groups: one block table per attention type over one shared pool (vLLM's hybrid
KV cache manager, as pure data).

A hybrid model (Gemma 2/3: sliding-window layers beside full-attention ones) groups its layers
by attention type, each group of the same number of layers (`SchedulerConfig.kv_cache_groups`
gives each group's window; None = full attention). One block of the pool holds block_size
positions of the layers of ONE group, so a sequence holds, for every block index i (positions
i * bs .. i * bs + bs - 1), one block per group. Its table interleaves them:

    table[i * G + g]  the block of group g at block index i     (G = number of groups)

so every pool operation (take, give, acquire, releasable) works on tables unchanged, and with
one group a table is exactly the single-table layout (every existing plan is unchanged).
`group_tables` splits a table into the per-group tables the kernels read.

  * Allocation: a new block index takes G blocks, one per group (every layer writes every
    position). A sequence with c positions computed or scheduled holds G * blocks_for(c)
    entries.
  * Window release: a sliding group of window W releases, when a step is planned, the blocks
    wholly behind its window (`slide_groups`, `scheduler/window.py`'s rule per group); their
    entries become RELEASED and the device reads them as page 0, masked. Full groups keep
    every block.
  * Prefix hits (`find_hits`, vLLM's rule): the longest prefix cached in every full group,
    intersected with the longest prefix whose last window of blocks is cached in every
    sliding group (a fixed point: a shorter prefix needs other window blocks). Each group's
    block of the same tokens is cached under its own key (`prefix.group_key`); with a host
    tier a key the host holds counts as cached and is loaded back (scheduler/host_tier.py).
  * Registration: every group's block of a newly full block index is cached under its key
    (`filled_pairs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from scheduler.blocks import BlockPool, BlockTable
from scheduler.prefix import group_key
from scheduler.state import DecodeTable, Partial
from scheduler.window import RELEASED, first_needed, window_prefix

Windows = tuple[int | None, ...]


def group_tables(table: BlockTable, num_groups: int) -> tuple[BlockTable, ...]:
    """The per-group tables of an interleaved table: group g's is table[g::G]."""
    if num_groups == 1:
        return (table,)
    return tuple(table[g::num_groups] for g in range(num_groups))


def filled_pairs(table: BlockTable, hashes: Sequence[bytes], first: int, last: int,
                 num_groups: int) -> list[tuple[int, bytes]]:
    """(block, key) of every group's block at block indices first .. last - 1 (just filled)."""
    if num_groups == 1:
        return [(table[b], hashes[b]) for b in range(first, last)]
    return [(table[b * num_groups + g], group_key(hashes[b], g))
            for b in range(first, last) for g in range(num_groups)]


# ---- window release, per group --------------------------------------------------------------

def slid_groups(table: BlockTable, cursor: int, windows: Windows,
                block_size: int) -> tuple[BlockTable, tuple[int, ...]]:
    """(`table` with every sliding group's blocks before the window of a query at `cursor`
    RELEASED, the blocks released now, in table order)."""
    G = len(windows)
    positions = []
    for g, w in enumerate(windows):
        if w is None:
            continue
        j = first_needed(cursor, w, block_size) - 1
        while j >= 0 and table[j * G + g] is not RELEASED:  # released entries are a prefix
            positions.append(j * G + g)
            j -= 1
    if not positions:
        return table, ()
    positions.sort()
    entries = list(table)
    for p in positions:
        entries[p] = RELEASED
    return tuple(entries), tuple(table[p] for p in positions)


def slide_groups(dec: DecodeTable, partial: list[Partial], pool: BlockPool, windows: Windows,
                 block_size: int) -> tuple[DecodeTable, BlockPool, bool]:
    """`scheduler.window.slide` for several groups: every running sequence releases each
    sliding group's blocks wholly behind that group's window. Returns the decode table, the
    pool, and whether some partial prefill's table changed (`partial` is updated in place)."""
    G = len(windows)
    sliding = [(g, w) for g, w in enumerate(windows) if w is not None]
    if not sliding:
        return dec, pool, False
    rows = []  # decode rows with a block to release (once per block_size steps per group)
    for i, (c, t) in enumerate(zip(dec.computed, dec.tables)):
        for g, w in sliding:
            n = (c - w + 1) // block_size
            if n > 0 and t[(n - 1) * G + g] is not RELEASED:
                rows.append(i)
                break
    if rows:
        tables = list(dec.tables)
        for i in rows:
            tables[i], freed = slid_groups(tables[i], dec.computed[i], windows, block_size)
            pool = pool.give(freed)
        dec = dec.with_progress(tables=tuple(tables))
    changed = False
    for j, part in enumerate(partial):
        table, freed = slid_groups(part.table, part.computed, windows, block_size)
        if freed:
            partial[j] = dataclasses.replace(part, table=table)
            pool = pool.give(freed)
            changed = True
    return dec, pool, changed


# ---- prefix hits -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Hits:
    """The cached prefix a waiting sequence can reuse.

    Attributes:
      num_blocks: block indices the prefix covers (its tokens: num_blocks * block_size).
      table: the interleaved entries of those indices: device blocks, RELEASED behind a
        sliding group's window, and RELEASED stand-ins for the entries `loads` fills.
      loads: (position in `table`, host slot, key) of each entry only the host tier holds.
    """

    num_blocks: int
    table: BlockTable
    loads: tuple[tuple[int, int, bytes], ...] = ()


NO_HITS = Hits(0, ())


def find_hits(pool: BlockPool, hashes: Sequence[bytes], windows: Windows,
              block_size: int) -> Hits:
    """The longest prefix of the blocks named by `hashes` that every group can reuse (module
    docstring), found on the device or, with a host tier, on the host."""
    if pool.cache is None or not hashes:
        return NO_HITS
    if len(windows) == 1 and pool.host is None:  # one group, device only: scheduler/window.py
        if windows[0] is None:
            table = pool.cache.longest_prefix(hashes)
        else:
            table = window_prefix(pool.cache, hashes, windows[0], block_size)
        return Hits(len(table), table)
    where = _Locator(pool, hashes)
    n = len(hashes)
    for g, w in enumerate(windows):  # full attention: the leading run every full group holds
        if w is None:
            i = 0
            while i < n and where(i, g) is not None:
                i += 1
            n = i
    while n:  # sliding groups: shorten until every one holds its last window (a fixed point)
        m = n
        for g, w in enumerate(windows):
            if w is not None:
                m = _window_end(where, g, w, m, block_size)
        if m == n:
            break
        n = m
    entries: list[int | None] = []
    loads = []
    for i in range(n):
        for g, w in enumerate(windows):
            if w is not None and i < first_needed(n * block_size, w, block_size):
                entries.append(RELEASED)
                continue
            block, slot = where(i, g)
            if block is None:
                loads.append((len(entries), slot, group_key(hashes[i], g)))
            entries.append(block)
    return Hits(n, tuple(entries), tuple(loads))


class _Locator:
    """(device block, None) or (None, host slot) of group g's block at index i, or None;
    memoized (the fixed point asks again)."""

    def __init__(self, pool: BlockPool, hashes: Sequence[bytes]):
        self.cache, self.host, self.hashes = pool.cache, pool.host, hashes
        self.found: dict[tuple[int, int], tuple | None] = {}

    def __call__(self, i: int, g: int) -> tuple[int | None, int | None] | None:
        found = self.found.get((i, g), False)
        if found is False:
            key = group_key(self.hashes[i], g)
            block = self.cache.lookup(key)
            slot = self.host.lookup(key) if block is None and self.host is not None else None
            found = (block, None) if block is not None else (
                (None, slot) if slot is not None else None)
            self.found[i, g] = found
        return found


def _window_end(where: Callable, g: int, window: int, limit: int, block_size: int) -> int:
    """The largest n <= limit whose blocks first_needed(n * bs) .. n - 1 group g holds
    (scheduler/window.py's `window_prefix`, scanning from the end)."""
    end = limit
    j = end - 1
    while j >= first_needed(end * block_size, window, block_size):
        if where(j, g) is None:  # no prefix may end after j: try ending at j
            end = j
        j -= 1
    return end


def load_hits(pool: BlockPool, hits: Hits
              ) -> tuple[BlockPool, BlockTable, list[tuple[int, int]]]:
    """Takes a device block for every entry of `hits` only the host holds (its slot pinned
    first, so no store of this plan reuses it), caches it under its key, held by the
    admission (its KV lands before the next step: scheduler/host_tier.py). Returns the pool,
    the table with those blocks, and the (host slot, device block) loads."""
    slots = [slot for _, slot, _ in hits.loads]
    pool = dataclasses.replace(pool, host=pool.host.pinned(slots))
    blocks, pool = pool.take(len(slots))
    pool = pool.register([(block, key) for (_, _, key), block in zip(hits.loads, blocks)])
    entries = list(hits.table)
    for (position, _, _), block in zip(hits.loads, blocks):
        entries[position] = block
    return pool, tuple(entries), list(zip(slots, blocks))
