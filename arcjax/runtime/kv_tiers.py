"""The host-memory KV tier's data: host slots beside the device cache, and the copies the
plans ask for (scheduler/host_tier.py decides which blocks move; this module moves them).

1. `store(cache, plan.kv_stores)`, before the step's launch (the step may overwrite those
   blocks): one small jitted gather takes every slot's page of each stored block, K and V, on
   the device; their copy to the host starts at once, and `flush` writes them into the pool
   once they landed (at the latest before a load reads those slots).
2. `load(cache, plan.kv_loads) -> cache`, right after the step's launch: the slots' pages,
   copied out of the pool on the host, go to the device asynchronously and a jitted scatter
   writes them into the cache the step returns. The device runs the scatter after that step
   and before the next one, so the transfer overlaps the step and no later step reads a
   block before its KV landed.
3. `stats`: blocks and bytes moved each way, and the loads' latency (dispatch to landed, as
   seen when the next step is collected).

A block of the pool is, for every cache slot p, page `p * num_blocks + block` of the flat
cache (arcjax/model/kv_layout.py): a host slot holds `[num_slots, block_size, Hkv, D]` of K
and of V in the cache's dtype (FP8 pages move as they are; their scales are per layer and
never move). Transfer counts are padded to powers of two (padding reads block 0 and writes
nowhere), so a few small executables serve every step. Under tensor parallelism the pages
keep the cache's head sharding: each device copies out its shard and is given its shard back.

NOTE: the pool is plain numpy memory; PJRT stages the transfers through its own (pinned on a
GPU) buffers. A pool allocated in pinned host memory is not built.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


@jax.jit
def _gather(k, v, pages):
    """Pages `pages` [n, P] of K and V: [n, P, block_size, Hkv, D] each."""
    return k[pages], v[pages]


@functools.partial(jax.jit, donate_argnames=("cache",))
def _scatter(cache, pages, k, v):
    """The cache with pages `pages` [n, P] set to k, v [n, P, block_size, Hkv, D]; an
    out-of-range page (padding) writes nothing."""
    return {**cache, "k": cache["k"].at[pages].set(k, mode="drop"),
            "v": cache["v"].at[pages].set(v, mode="drop")}


def _padded(n: int) -> int:
    """Transfer count rounded up to a power of two (a handful of executables)."""
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass
class TierStats:
    """What the host tier moved so far (read by the engine's metrics)."""

    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    load_seconds: float = 0.0  # summed over loads, dispatch to landed
    loads_timed: int = 0


class HostKVPool:
    """The host slots and their transfers (see the module docstring)."""

    def __init__(self, num_host_slots: int, *, num_slots: int, num_blocks: int,
                 page_shape: tuple[int, int, int], dtype, cache_sharding=None,
                 v_page_shape: tuple[int, int, int] | None = None):
        # page_shape: (block_size, Hkv, D) of the whole model (every device's heads);
        # v_page_shape: V's when it differs (latent attention: the rope keys' pages)
        self.num_host_slots, self.num_slots, self.num_blocks = num_host_slots, num_slots, num_blocks
        self.k = np.zeros((num_host_slots, num_slots, *page_shape), dtype)  # calloc: pages
        self.v = np.zeros((num_host_slots, num_slots, *(v_page_shape or page_shape)),
                          dtype)  # are committed when first written
        self.block_bytes = self.k[0].nbytes + self.v[0].nbytes
        self._sharding = _data_sharding(cache_sharding)
        self._stores: list[tuple[np.ndarray, jax.Array, jax.Array, int]] = []  # in flight
        self._loads: list[tuple[float, jax.Array]] = []  # (dispatched, device data)
        self.stats = TierStats()

    @staticmethod
    def slots_for(size_bytes: int, *, num_slots: int, page_shape: tuple[int, int, int],
                  dtype, v_page_shape: tuple[int, int, int] | None = None) -> int:
        """Host slots that fit in `size_bytes` (a slot holds one block's K and V)."""
        values = int(np.prod(page_shape)) + int(np.prod(v_page_shape or page_shape))
        per_slot = num_slots * values * np.dtype(dtype).itemsize
        return int(size_bytes // per_slot)

    def _pages(self, blocks: Sequence[int], count: int, fill: int) -> np.ndarray:
        """[count, P] int32: block b's page in every slot; rows past len(blocks) = fill."""
        pages = np.full((count, self.num_slots), fill, np.int32)
        b = np.asarray(blocks, np.int64)
        pages[:len(b)] = b[:, None] + np.arange(self.num_slots) * self.num_blocks
        return pages

    def store(self, cache, stores: Sequence[tuple[int, int]]) -> None:
        """Starts copying the (device block, host slot) pairs out of `cache` (call before
        the launch that may overwrite them)."""
        if not stores:
            return
        blocks, slots = zip(*stores)
        pages = self._pages(blocks, _padded(len(blocks)), 0)
        k, v = _gather(cache["k"], cache["v"], pages)
        k.copy_to_host_async()
        v.copy_to_host_async()
        self._stores.append((np.asarray(slots, np.int64), k, v, len(slots)))
        self.stats.blocks_stored += len(slots)
        self.stats.bytes_to_host += len(slots) * self.block_bytes

    def flush(self) -> None:
        """Writes every store in flight into the pool (waits for its copy), in order."""
        for slots, k, v, n in self._stores:
            self.k[slots] = np.asarray(k)[:n]
            self.v[slots] = np.asarray(v)[:n]
        self._stores.clear()

    def load(self, cache, loads: Sequence[tuple[int, int]]):
        """Dispatches the (host slot, device block) copies into `cache` (call right after the
        step's launch, with the cache it returned); returns the cache to run the next step on."""
        if not loads:
            return cache
        slots, blocks = zip(*loads)
        if self._stores:  # a slot read here may still be on its way from the device
            pending = set().union(*(set(s.tolist()) for s, _, _, _ in self._stores))
            if pending.intersection(slots):
                self.flush()
        count = _padded(len(blocks))
        pages = self._pages(blocks, count, self.num_slots * self.num_blocks)  # padding: drop
        index = np.zeros(count, np.int64)
        index[:len(slots)] = slots
        k, v = self.k[index], self.v[index]  # host copies: later stores cannot touch them
        if self._sharding is not None:
            k, v = jax.device_put(k, self._sharding), jax.device_put(v, self._sharding)
        else:
            k, v = jax.device_put(k), jax.device_put(v)
        self._loads.append((time.perf_counter(), k))
        self.stats.blocks_loaded += len(slots)
        self.stats.bytes_to_device += len(slots) * self.block_bytes
        return _scatter(cache, pages, k, v)

    def poll(self) -> None:
        """Times the loads that landed (call once a step is collected)."""
        now, waiting = time.perf_counter(), []
        for dispatched, data in self._loads:
            if data.is_ready():
                self.stats.load_seconds += now - dispatched
                self.stats.loads_timed += 1
            else:
                waiting.append((dispatched, data))
        self._loads = waiting

    def reset(self) -> None:
        """Drops every copy in flight (the scheduler forgot the tier: its keys are gone)."""
        self._stores.clear()
        self._loads.clear()


def _data_sharding(cache_sharding):
    """The sharding of [n, P, block_size, Hkv, D] transfers for a cache sharded as
    `cache_sharding` ([P * num_blocks, block_size, Hkv, D]): the same head split."""
    if isinstance(cache_sharding, NamedSharding):
        spec = tuple(cache_sharding.spec) + (None,) * (4 - len(cache_sharding.spec))
        return NamedSharding(cache_sharding.mesh, PartitionSpec(None, None, *spec[1:]))
    return cache_sharding
