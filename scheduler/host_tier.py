"""The host-memory KV tier as pure data: evicted prefix blocks keep their KV in host RAM.

  1. Store: when the device's prefix cache evicts a cached block (`BlockPool.take`), its key
     gets a host slot (a fresh one, else the least recently used slot, whose key is
     forgotten) and the pool records (device block, slot) in `BlockPool.stores`; the plan
     hands them to the runner as `StepPlan.kv_stores`, which copies each block out before
     the step that reuses it runs. A key the host holds already is only touched (LRU).
  2. Load: an admission whose prefix hit reaches a key only the host holds takes a device
     block for it, registers it in the device cache under the key, and the plan records
     (slot, device block) in `StepPlan.kv_loads`: the runner copies it in right after
     launching the step, so the copy overlaps that step. The request runs its first chunk in
     the next step (`StepPlan.loading`): it waits for its blocks, nobody else does. Another
     admission hitting a block loaded in the same plan waits with it.
  3. A slot loaded by a plan is pinned (held in the host cache) until the plan is built, so no
     store of the same plan can reuse it; unpinning makes it the most recently used.

The slots are an LRU over a `PrefixCache` whose blocks are host slots: every stored slot is
released (references 0, evictable), a pinned one is held. Everything is keyed like the device
cache: `group_key(digest, group)` (scheduler/prefix.py).

NOTE: the runner executes every store of a plan before its step and every load after it, and
completes a plan's loads before the next plan's step runs (the device runs steps in order).
Hence a block is never read before its load lands, and a stored block's KV is final: it was
written by a step launched before the store was planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from scheduler.prefix import PrefixCache


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HostTier:
    """The host slots: which key each holds, and their LRU order.

    Attributes:
      num_slots: slots in host memory (`SchedulerConfig.num_host_blocks`).
      fresh: slots fresh .. num_slots - 1 were never written.
      cache: key -> slot, records, and the LRU queue of the slots not pinned.
    """

    num_slots: int
    fresh: int = 0
    cache: PrefixCache

    @classmethod
    def empty(cls, num_slots: int) -> "HostTier":
        return cls(num_slots=num_slots, cache=PrefixCache.empty(num_slots))

    @property
    def num_stored(self) -> int:
        """Slots holding a block: every slot once written (an evicted key's slot is rewritten
        at once)."""
        return self.fresh

    def lookup(self, key: bytes) -> int | None:
        """The slot holding `key`, or None."""
        return self.cache.lookup(key)

    def stored(self, key: bytes) -> tuple[int | None, "HostTier"]:
        """Gives `key` a slot for a block the device evicts. Returns (the slot to copy the
        block into, or None when no copy is needed or possible; the tier).

        None: the key is on the host already (it becomes the most recently used), or every
        slot is pinned by a load of this plan (the block is dropped, as without a host tier).
        """
        cache = self.cache
        slot = cache.lookup(key)
        if slot is not None:
            cache, _ = cache.acquired((slot,))
            cache, _ = cache.released((slot,))
            return None, dataclasses.replace(self, cache=cache)
        fresh = self.fresh
        if fresh < self.num_slots:
            slot, fresh = fresh, fresh + 1
        elif cache.num_evictable:
            (slot,), cache = cache.evicted(1)
        else:
            return None, self
        cache = cache.registered(((slot, key),))
        cache, _ = cache.released((slot,))
        return slot, HostTier(num_slots=self.num_slots, fresh=fresh, cache=cache)

    def pinned(self, slots: Sequence[int]) -> "HostTier":
        """Holds `slots` (being loaded) so that no store reuses them."""
        if not slots:
            return self
        cache, _ = self.cache.acquired(slots)
        return dataclasses.replace(self, cache=cache)

    def unpinned(self, slots: Sequence[int]) -> "HostTier":
        """Releases pinned `slots` (no repeats), most recently used last."""
        if not slots:
            return self
        cache, _ = self.cache.released(tuple(slots))
        return dataclasses.replace(self, cache=cache)

    def keys(self) -> dict[int, bytes]:
        """slot -> key of every slot holding a block (O(slots): for checks and tests)."""
        records = self.cache.records
        return {s: records[s].digest for s in range(self.fresh)}
