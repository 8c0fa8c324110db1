"""Automatic prefix caching as pure data: block hashes, reference counts, LRU eviction.

  1. Every FULL KV block is named by `block_hash(parent_digest, its token ids)`: blake2b over the
     parent's digest and the ids packed little-endian as int64, so a digest is the same in every
     process and on every host (several hosts compare plan hashes). The first block's parent is
     `root_digest(adapter)`: ROOT_DIGEST for the base model, a digest of the LoRA adapter's key
     otherwise, so blocks computed with two adapters (or with one and without) never share a
     name: their KV differs.
  2. `PrefixCache` maps digests to blocks (`index`) and keeps a record per cached block: its
     digest, how many live sequences hold it (`refs`) and when it was last released (`stamp`).
  3. A cached block whose refs drop to 0 stays cached (reusable) and joins the eviction queue; a
     cache hit takes it out again (refs 0 -> 1). When a fresh block is needed and no free block is
     left, the least recently released one is evicted (its digest forgotten). "Used" means last
     released: a hit takes the block out of the queue and its next release puts it back at the
     end. Blocks released by one table join the queue last block first, so a shared prefix
     outlives its tails.

Persistence: `PagedArray` is a fixed-length array stored as a trie of 64-entry tuples; an update
copies only the nodes on the paths it changes, so a step costs O(blocks touched), not O(cache
size). The eviction queue is append-only with lazy deletion: a hit or an eviction leaves a stale entry
(its stamp no longer matches the record) that popping skips; the queue is compacted when stale
entries outnumber live ones.

With several KV cache groups (scheduler/kv_groups.py) each group's block of the same tokens is
cached apart, under `group_key(digest, group)`; the host tier (scheduler/host_tier.py) keys its
slots the same way.

NOTE: invariants (checked by tests): a record exists iff its block is indexed under its digest;
refs == number of live block tables holding the block; refs == 0 iff the block is in the eviction
queue with its record's stamp (num_evictable of them); a block with refs > 0 is never evicted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

ROOT_DIGEST = b"\x00" * 16
_BIG_ENDIAN = sys.byteorder == "big"  # digests hash little-endian ids on every host
_QUEUE_PAGE = 256


def root_digest(adapter: int | None) -> bytes:
    """The parent of a sequence's first block: ROOT_DIGEST for the base model (adapter None),
    else blake2b-128 of b"adapter" and the adapter key as int64 little-endian."""
    if adapter is None:
        return ROOT_DIGEST
    digest = hashlib.blake2b(b"adapter", digest_size=16)
    digest.update(int(adapter).to_bytes(8, "little", signed=True))
    return digest.digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of a full block: blake2b-128 of the parent digest and the int64 little-endian ids."""
    ids = array("q", tokens)
    if _BIG_ENDIAN:
        ids.byteswap()
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(ids)
    return digest.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, parent: bytes = ROOT_DIGEST,
                 first_block: int = 0) -> tuple[bytes, ...]:
    """Digests of the full blocks of `tokens` from block `first_block` on (parent: the digest of
    block first_block - 1). Same digests as `block_hash` block by block; the ids are packed once
    and each block hashes a slice of them."""
    first = first_block * block_size
    count = (len(tokens) - first) // block_size
    if count <= 0:
        return ()
    ids = array("q", tokens[first:first + count * block_size])
    if _BIG_ENDIAN:
        ids.byteswap()
    raw = memoryview(ids).cast("B")
    width = block_size * ids.itemsize
    out = []
    for start in range(0, count * width, width):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(raw[start:start + width])
        parent = digest.digest()
        out.append(parent)
    return tuple(out)


def group_key(digest: bytes, group: int) -> bytes:
    """The cache key of a block of KV cache group `group` holding the tokens `digest` names:
    the digest itself for group 0 (so one group caches exactly as before), the digest and one
    group byte otherwise (17 bytes: never equal to a 16-byte digest)."""
    return digest + bytes((group,)) if group else digest


_BITS = 6  # PagedArray pages hold 64 entries
_MASK = (1 << _BITS) - 1


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class PagedArray:
    """A persistent array of fixed length: a trie of 64-entry tuples (depth d covers 64**d
    entries: 2 levels up to 4,096 blocks, 4 up to 16M). `updated` copies the nodes on the paths
    it changes, once each: O(64 * depth) references per touched entry, never O(length).

    Attributes:
      length: entries.
      shift: index shift of the root's slots (0 when the root is a leaf).
      root: the top node.
    """

    length: int
    shift: int
    root: tuple

    @classmethod
    def filled(cls, length: int, value: object) -> "PagedArray":
        node, shift = (value,) * (1 << _BITS), 0
        while (1 << (shift + _BITS)) < length:
            node, shift = (node,) * (1 << _BITS), shift + _BITS
        return cls(length, shift, node)

    def __getitem__(self, i: int) -> object:
        node, shift = self.root, self.shift
        while shift:
            node = node[(i >> shift) & _MASK]
            shift -= _BITS
        return node[i & _MASK]

    def updated(self, changes: Iterable[tuple[int, object]]) -> "PagedArray":
        """The array with each (index, value) of `changes` set (later changes win).

        Bottom-up: the touched leaves are copied once each, then their parents, up to the root.
        """
        touched: dict[int, dict[int, object]] = {}  # node number -> {slot: new value}
        for i, value in changes:
            slots = touched.get(i >> _BITS)
            if slots is None:
                slots = touched[i >> _BITS] = {}
            slots[i & _MASK] = value
        if not touched:
            return self
        shift = 0  # the index shift of the nodes in `touched`
        while True:
            nodes = {}
            for n, slots in touched.items():
                node = list(self._node(n << (shift + _BITS), shift))
                for j, value in slots.items():
                    node[j] = value
                nodes[n] = tuple(node)
            if shift == self.shift:
                return PagedArray(self.length, self.shift, nodes[0])
            shift += _BITS
            touched = {}
            for n, node in nodes.items():
                slots = touched.get(n >> _BITS)
                if slots is None:
                    slots = touched[n >> _BITS] = {}
                slots[n & _MASK] = node

    def _node(self, i: int, shift: int) -> tuple:
        """The node whose slots are indexed by bits [shift, shift + 6) on the path to entry i."""
        node, s = self.root, self.shift
        while s > shift:
            node = node[(i >> s) & _MASK]
            s -= _BITS
        return node

    def __repr__(self) -> str:  # num_blocks entries would print; say how long it is
        return f"PagedArray(length={self.length})"


def _find(bucket: tuple[tuple[bytes, int], ...], digest: bytes) -> int | None:
    for d, block in bucket:
        if d == digest:
            return block
    return None


class CachedBlock(NamedTuple):
    """The record of one cached block."""

    digest: bytes
    refs: int  # live block tables holding it
    stamp: int  # the cache clock when it was last released (its eviction-queue entry)


_new_record = functools.partial(tuple.__new__, CachedBlock)  # CachedBlock from a tuple, in C


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrefixCache:
    """The cached full blocks (see the module docstring).

    Attributes:
      records: block id -> CachedBlock, or None for a block that is not cached.
      index: bucket -> ((digest, block), ...); a digest's bucket is its first 8 bytes modulo the
        bucket count (a power of two).
      queue: eviction queue pages of (stamp, block), oldest first; only the last page is short.
      queue_head: entries of queue[0] already popped.
      queue_len: entries in the queue, stale ones included.
      num_evictable: cached blocks with refs == 0.
      clock: the next release stamp.
    """

    records: PagedArray
    index: PagedArray
    queue: tuple[tuple[tuple[int, int], ...], ...] = ()
    queue_head: int = 0
    queue_len: int = 0
    num_evictable: int = 0
    clock: int = 0

    @classmethod
    def empty(cls, num_blocks: int) -> "PrefixCache":
        buckets = 1 << max(num_blocks - 1, 1).bit_length()
        return cls(records=PagedArray.filled(num_blocks, None),
                   index=PagedArray.filled(buckets, ()))

    def _bucket(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "little") & (self.index.length - 1)

    def lookup(self, digest: bytes) -> int | None:
        """The block cached under `digest`, or None."""
        return _find(self.index[self._bucket(digest)], digest)

    def longest_prefix(self, digests: Sequence[bytes]) -> tuple[int, ...]:
        """The cached blocks of the longest leading run of `digests` that is cached."""
        blocks = []
        for digest in digests:
            block = self.lookup(digest)
            if block is None:
                break
            blocks.append(block)
        return tuple(blocks)

    def registered(self, pairs: Iterable[tuple[int, bytes]]) -> "PrefixCache":
        """Caches each (block, digest) whose digest is not cached yet; the block's one holder is
        the sequence that filled it (refs 1). A digest already cached keeps its block: the new
        block stays uncached and is freed normally."""
        records, buckets = {}, {}
        index, mask = self.index, self.index.length - 1
        for block, digest in pairs:
            b = int.from_bytes(digest[:8], "little") & mask
            bucket = buckets[b] if b in buckets else index[b]
            if bucket and _find(bucket, digest) is not None:
                continue  # cached already (under another block)
            buckets[b] = bucket + ((digest, block),)
            records[block] = _new_record((digest, 1, 0))
        if not records:
            return self
        return dataclasses.replace(self, records=self.records.updated(records.items()),
                                   index=self.index.updated(buckets.items()))

    def acquired(self, blocks: Iterable[int]) -> tuple["PrefixCache", int]:
        """Cache hits: refs + 1 for each block. Returns the cache and how many left the eviction
        queue (refs 0 -> 1)."""
        changes: dict[int, CachedBlock] = {}
        revived = 0
        for block in blocks:
            rec = changes.get(block) or self.records[block]
            if rec.refs == 0:
                revived += 1
            changes[block] = rec._replace(refs=rec.refs + 1)
        return dataclasses.replace(self, records=self.records.updated(changes.items()),
                                   num_evictable=self.num_evictable - revived), revived

    def released(self, blocks: Sequence[int]) -> tuple["PrefixCache", int]:
        """refs - 1 for each cached block of one table (no repeats); those reaching 0 join the
        eviction queue last block first. Returns the cache and how many became evictable."""
        changes: dict[int, CachedBlock] = {}
        for block in blocks:
            rec = changes.get(block) or self.records[block]
            changes[block] = rec._replace(refs=rec.refs - 1)
        clock, entries = self.clock, []
        for block in reversed(blocks):
            rec = changes[block]
            if rec.refs == 0:
                changes[block] = rec._replace(stamp=clock)
                entries.append((clock, block))
                clock += 1
        cache = dataclasses.replace(self, records=self.records.updated(changes.items()),
                                    clock=clock, num_evictable=self.num_evictable + len(entries))
        return cache._pushed(entries), len(entries)

    def _pushed(self, entries: list[tuple[int, int]]) -> "PrefixCache":
        if not entries:
            return self
        pages = list(self.queue)
        for entry in entries:
            if pages and len(pages[-1]) < _QUEUE_PAGE:
                pages[-1] += (entry,)
            else:
                pages.append((entry,))
        cache = dataclasses.replace(self, queue=tuple(pages),
                                    queue_len=self.queue_len + len(entries))
        if cache.queue_len > 2 * cache.num_evictable + _QUEUE_PAGE:
            return cache._compacted()
        return cache

    def _live(self, entry: tuple[int, int]) -> bool:
        stamp, block = entry
        rec = self.records[block]
        return rec is not None and rec.refs == 0 and rec.stamp == stamp

    def queue_entries(self) -> list[tuple[int, int]]:
        """Live (stamp, block) entries, oldest (next evicted) first; O(queue_len)."""
        entries = [e for page in self.queue for e in page][self.queue_head:]
        return [e for e in entries if self._live(e)]

    def _compacted(self) -> "PrefixCache":
        live = self.queue_entries()
        pages = tuple(tuple(live[i:i + _QUEUE_PAGE]) for i in range(0, len(live), _QUEUE_PAGE))
        return dataclasses.replace(self, queue=pages, queue_head=0, queue_len=len(live))

    def evicted(self, count: int) -> tuple[tuple[int, ...], "PrefixCache"]:
        """Pops the `count` least recently released evictable blocks (count <= num_evictable)
        and forgets their digests; returns them and the cache."""
        pages, head, popped = self.queue, self.queue_head, 0
        blocks: list[int] = []
        while len(blocks) < count:
            entry = pages[0][head]
            head += 1
            popped += 1
            if head == len(pages[0]):
                pages, head = pages[1:], 0
            if self._live(entry):
                blocks.append(entry[1])
        buckets: dict[int, tuple] = {}
        for block in blocks:
            digest = self.records[block].digest
            b = self._bucket(digest)
            buckets[b] = tuple(e for e in buckets.get(b, self.index[b]) if e[0] != digest)
        cache = PrefixCache(records=self.records.updated((b, None) for b in blocks),
                            index=self.index.updated(buckets.items()), queue=pages,
                            queue_head=head, queue_len=self.queue_len - popped,
                            num_evictable=self.num_evictable - count, clock=self.clock)
        return tuple(blocks), cache
