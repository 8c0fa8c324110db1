"""KV block accounting: a persistent free pool whose operations cost O(tables moved), not O(blocks).

The pool is the never-allocated range [fresh, num_blocks) plus a stack of freed block tables
(each pushed whole by `give`). `take` pops freed tables first, splitting the last one it needs,
then cuts from the fresh range; both are C-level tuple operations.

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

# Freed tables as a persistent cons list: (table, older) or None.
FreedStack: TypeAlias = "tuple[BlockTable, FreedStack] | None"


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
      freed: blocks given back, newest table first; allocated before the fresh range.
    """

    num_blocks: int
    num_free: int
    fresh: int = 0
    freed: FreedStack = None

    @classmethod
    def full(cls, num_blocks: int) -> "BlockPool":
        """All blocks free; block 0 is allocated first."""
        return cls(num_blocks=num_blocks, num_free=num_blocks)

    def take(self, count: int) -> tuple[BlockTable, "BlockPool"]:
        """Pops `count` blocks (count <= num_free); returns them and the smaller pool."""
        parts = []
        stack, need = self.freed, count
        while need and stack is not None:
            table, older = stack
            if len(table) <= need:
                parts.append(table)
                need -= len(table)
                stack = older
            else:
                parts.append(table[:need])
                stack = (table[need:], older)
                need = 0
        fresh = self.fresh
        if need:
            parts.append(tuple(range(fresh, fresh + need)))
            fresh += need
        blocks = parts[0] if len(parts) == 1 else tuple(chain.from_iterable(parts))
        return blocks, BlockPool(num_blocks=self.num_blocks, num_free=self.num_free - count,
                                 fresh=fresh, freed=stack)

    def give(self, blocks: Iterable[int]) -> "BlockPool":
        """Returns freed blocks to the pool."""
        table = tuple(blocks)
        if not table:
            return self
        return BlockPool(num_blocks=self.num_blocks, num_free=self.num_free + len(table),
                         fresh=self.fresh, freed=(table, self.freed))

    def free_blocks(self) -> tuple[int, ...]:
        """The free block ids, next-allocated first (O(num_free): for checks and tests)."""
        parts = []
        stack = self.freed
        while stack is not None:
            table, stack = stack
            parts.append(table)
        parts.append(range(self.fresh, self.num_blocks))
        return tuple(chain.from_iterable(parts))
