"""KV block accounting: a persistent free pool whose operations cost O(tables moved), not O(blocks).

The pool is the never-allocated range [fresh, num_blocks) plus a stack of freed block tables
(each pushed whole by `give`). `take` pops freed tables first, taking the front of the last one it
needs, then cuts from the fresh range; both are C-level tuple operations.

The stack is a flat tuple of (table, first) entries, newest last: `table[first:]` is still free.
When it grows past MAX_FREED_TABLES entries, `give` merges them into one table in pop order
(amortized O(1) per block), so the nesting depth is constant (no cons lists: pickle and deepcopy
of a pool never recurse deeply).

With prefix caching (`cache` is a scheduler.prefix.PrefixCache) a released block that holds a
cached full block keeps its KV and joins the cache's eviction queue instead of the stack; `take`
evicts from that queue (least recently released first) only when the stack and the fresh range
are empty. `num_free` counts every block usable for a new allocation: free plus cached-but-
unreferenced. `num_in_use` is the rest: blocks some live sequence holds.

With a host tier (`host`, scheduler/host_tier.py) an evicted cached block is not lost: `take`
gives its key a host slot and appends (block, slot) to `stores`, which the planner moves into
the step plan (the runner copies the block out before the step that reuses it).

NOTE: invariants the tests check every step:
  * free, cached-unreferenced and referenced blocks partition [0, num_blocks);
  * a referenced block is in exactly one live block table, unless it is a cached full block,
    which is in exactly `refs` of them (shared prefixes);
  * a sequence with c computed-or-scheduled tokens owns exactly blocks_for(c) blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from itertools import chain
from typing import TypeAlias

from scheduler.host_tier import HostTier
from scheduler.prefix import PrefixCache

# Block ids by block index; with a sliding window, leading entries may be RELEASED (None).
BlockTable: TypeAlias = tuple[int | None, ...]

# Freed tables, newest last: (table, first) where table[first:] is free.
FreedStack: TypeAlias = tuple[tuple[BlockTable, int], ...]
MAX_FREED_TABLES = 64


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding `num_tokens` KV entries."""
    return -(-num_tokens // block_size)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BlockPool:
    """The free blocks of the cache (and the cached ones, with prefix caching).

    Attributes:
      num_blocks: blocks in the cache.
      num_free: blocks usable for new allocations: the stack, the fresh range and (with prefix
        caching) cached blocks no live sequence holds.
      fresh: blocks fresh .. num_blocks - 1 were never allocated.
      freed: blocks given back, as (table, first) entries, newest last; allocated (newest table
        first) before the fresh range.
      cache: the prefix cache; None when prefix caching is off.
      host: the host tier evicted cached blocks move to; None when off.
      stores: (device block, host slot) of every eviction copied to the host since the
        planner last took them (within one `schedule` call; empty in every state).
    """

    num_blocks: int
    num_free: int
    fresh: int = 0
    freed: FreedStack = ()
    cache: PrefixCache | None = None
    host: HostTier | None = None
    stores: tuple[tuple[int, int], ...] = ()

    @classmethod
    def full(cls, num_blocks: int, *, prefix_caching: bool = False,
             host_blocks: int = 0) -> "BlockPool":
        """All blocks free; block 0 is allocated first. `host_blocks` > 0 adds a host tier of
        that many slots (prefix caching only)."""
        cache = PrefixCache.empty(num_blocks) if prefix_caching else None
        host = HostTier.empty(host_blocks) if host_blocks and prefix_caching else None
        return cls(num_blocks=num_blocks, num_free=num_blocks, cache=cache, host=host)

    @property
    def num_in_use(self) -> int:
        """Blocks held by live sequences (0 when nothing runs; cached idle blocks excluded)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no live sequence holds (evictable; counted in num_free)."""
        return self.cache.num_evictable if self.cache is not None else 0

    def take(self, count: int) -> tuple[BlockTable, "BlockPool"]:
        """Pops `count` blocks (count <= num_free); returns them and the smaller pool.

        Order: the freed stack, then the fresh range, then (evicted) cached blocks.
        """
        parts = []
        freed, need = self.freed, count
        top = len(freed)
        while need and top:
            table, first = freed[top - 1]
            left = len(table) - first
            if left <= need:
                parts.append(table[first:] if first else table)
                need -= left
                top -= 1
            else:
                parts.append(table[first:first + need])
                freed = freed[:top - 1] + ((table, first + need),)
                need = 0
        if top < len(freed):
            freed = freed[:top]
        fresh = self.fresh
        if need and fresh < self.num_blocks:
            n = min(need, self.num_blocks - fresh)
            parts.append(tuple(range(fresh, fresh + n)))
            fresh += n
            need -= n
        cache, host, stores = self.cache, self.host, self.stores
        if need:
            evicted, cache = cache.evicted(need)
            parts.append(evicted)
            if host is not None:
                host, stores = _stored(host, stores, self.cache, evicted)
        blocks = parts[0] if len(parts) == 1 else tuple(chain.from_iterable(parts))
        return blocks, BlockPool(num_blocks=self.num_blocks, num_free=self.num_free - count,
                                 fresh=fresh, freed=freed, cache=cache, host=host,
                                 stores=stores)

    def give(self, blocks: Iterable[int | None]) -> "BlockPool":
        """Releases one block table: uncached blocks go back to the stack; cached ones lose a
        reference and, at zero, stay cached and become evictable. RELEASED (None) entries, which
        a sliding window gave back already, are skipped."""
        table = _held(tuple(blocks))
        if not table:
            return self
        cache = self.cache
        if cache is None:
            return BlockPool(num_blocks=self.num_blocks, num_free=self.num_free + len(table),
                             fresh=self.fresh, freed=_pushed(self.freed, table))  # no host
        records = cache.records
        cached = [b for b in table if records[b] is not None]
        freed = self.freed
        if len(cached) < len(table):
            plain = tuple(b for b in table if records[b] is None) if cached else table
            freed = _pushed(freed, plain)
        evictable = 0
        if cached:
            cache, evictable = cache.released(cached)
        return BlockPool(num_blocks=self.num_blocks,
                         num_free=self.num_free + len(table) - len(cached) + evictable,
                         fresh=self.fresh, freed=freed, cache=cache, host=self.host,
                         stores=self.stores)

    def acquire(self, blocks: BlockTable) -> "BlockPool":
        """Cache hits: one more reference to each (cached) block (RELEASED entries skipped)."""
        blocks = _held(blocks)
        if not blocks:
            return self
        cache, revived = self.cache.acquired(blocks)
        return BlockPool(num_blocks=self.num_blocks, num_free=self.num_free - revived,
                         fresh=self.fresh, freed=self.freed, cache=cache, host=self.host,
                         stores=self.stores)

    def register(self, pairs: list[tuple[int, bytes]]) -> "BlockPool":
        """Caches newly full blocks under their digests (see PrefixCache.registered)."""
        if not pairs:
            return self
        return dataclasses.replace(self, cache=self.cache.registered(pairs))

    def releasable(self, tables: Iterable[BlockTable]) -> int:
        """Blocks that releasing all of `tables` would make usable (num_free would grow by it)."""
        counts: dict[int, int] = {}
        total = 0
        for table in map(_held, tables):
            if self.cache is None:
                total += len(table)
                continue
            for b in table:
                counts[b] = counts.get(b, 0) + 1
        records = self.cache.records if self.cache is not None else None
        for b, n in counts.items():
            rec = records[b]
            total += rec is None or rec.refs == n
        return total

    def free_blocks(self) -> tuple[int, ...]:
        """The uncached free block ids, next-allocated first (O(num_free): for checks and tests)."""
        return _pop_order(self.freed) + tuple(range(self.fresh, self.num_blocks))

    def cached_free_blocks(self) -> tuple[int, ...]:
        """Cached blocks no live sequence holds, next-evicted first (O(queue): for tests)."""
        if self.cache is None:
            return ()
        return tuple(block for _, block in self.cache.queue_entries())

    def ref_count(self, block: int) -> int | None:
        """References to a cached block, or None if the block is not cached."""
        rec = self.cache.records[block] if self.cache is not None else None
        return None if rec is None else rec.refs


def _stored(host: HostTier, stores: tuple, cache: PrefixCache, evicted: BlockTable):
    """The host tier and `stores` after the device evicted `evicted` (`cache`: before the
    eviction, which still knows their keys)."""
    stores = list(stores)
    for block in evicted:
        slot, host = host.stored(cache.records[block].digest)
        if slot is not None:
            stores.append((block, slot))
    return host, tuple(stores)


def _held(table: tuple) -> BlockTable:
    """The table without RELEASED (None) entries (scheduler/window.py)."""
    return tuple(b for b in table if b is not None) if None in table else table


def _pop_order(freed: FreedStack) -> BlockTable:
    """Every block of the stack in the order `take` pops them."""
    return tuple(chain.from_iterable(table[first:] for table, first in reversed(freed)))


def _pushed(freed: FreedStack, table: BlockTable) -> FreedStack:
    """`freed` with `table` on top; merged into one entry when it holds too many."""
    if len(freed) >= MAX_FREED_TABLES:
        return ((_pop_order(freed + ((table, 0),)), 0),)
    return freed + ((table, 0),)
