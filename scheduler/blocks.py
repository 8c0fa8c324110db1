"""KV block accounting: a persistent free pool whose operations cost O(tables moved), not O(blocks).

The pool is the never-allocated range [fresh, num_blocks) plus a stack of freed block tables
(each pushed whole by `give`). `take` pops freed tables first, taking the front of the last one it
needs, then cuts from the fresh range; both are C-level tuple operations.

The stack is a flat tuple of (table, first) entries, newest last: `table[first:]` is still free.
When it grows past MAX_FREED_TABLES entries, `give` merges them into one table in pop order
(amortized O(1) per block), so the nesting depth is constant (no cons lists: pickle and deepcopy
of a pool never recurse deeply).

NOTE: invariants the tests check every step:
  * every block id in [0, num_blocks) is either free or owned by exactly one sequence;
  * a sequence with c computed-or-scheduled tokens owns exactly blocks_for(c) blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from itertools import chain
from typing import TypeAlias

BlockTable: TypeAlias = tuple[int, ...]

# Freed tables, newest last: (table, first) where table[first:] is free.
FreedStack: TypeAlias = tuple[tuple[BlockTable, int], ...]
MAX_FREED_TABLES = 64


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding `num_tokens` KV entries."""
    return -(-num_tokens // block_size)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BlockPool:
    """The free blocks of the cache.

    Attributes:
      num_blocks: blocks in the cache.
      num_free: free blocks (freed ones plus the fresh range).
      fresh: blocks fresh .. num_blocks - 1 were never allocated.
      freed: blocks given back, as (table, first) entries, newest last; allocated (newest table
        first) before the fresh range.
    """

    num_blocks: int
    num_free: int
    fresh: int = 0
    freed: FreedStack = ()

    @classmethod
    def full(cls, num_blocks: int) -> "BlockPool":
        """All blocks free; block 0 is allocated first."""
        return cls(num_blocks=num_blocks, num_free=num_blocks)

    def take(self, count: int) -> tuple[BlockTable, "BlockPool"]:
        """Pops `count` blocks (count <= num_free); returns them and the smaller pool."""
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
        if need:
            parts.append(tuple(range(fresh, fresh + need)))
            fresh += need
        blocks = parts[0] if len(parts) == 1 else tuple(chain.from_iterable(parts))
        return blocks, BlockPool(num_blocks=self.num_blocks, num_free=self.num_free - count,
                                 fresh=fresh, freed=freed)

    def give(self, blocks: Iterable[int]) -> "BlockPool":
        """Returns freed blocks to the pool."""
        table = tuple(blocks)
        if not table:
            return self
        return BlockPool(num_blocks=self.num_blocks, num_free=self.num_free + len(table),
                         fresh=self.fresh, freed=_pushed(self.freed, table))

    def free_blocks(self) -> tuple[int, ...]:
        """The free block ids, next-allocated first (O(num_free): for checks and tests)."""
        return _pop_order(self.freed) + tuple(range(self.fresh, self.num_blocks))


def _pop_order(freed: FreedStack) -> BlockTable:
    """Every block of the stack in the order `take` pops them."""
    return tuple(chain.from_iterable(table[first:] for table, first in reversed(freed)))


def _pushed(freed: FreedStack, table: BlockTable) -> FreedStack:
    """`freed` with `table` on top; merged into one entry when it holds too many."""
    if len(freed) >= MAX_FREED_TABLES:
        return ((_pop_order(freed + ((table, 0),)), 0),)
    return freed + ((table, 0),)
