"""The responses `/v1/responses` keeps (`store: true`): bounded in time and in bytes.

`ResponseStore(max_bytes, ttl)` holds, per response id, the response object as the API
returns it and the conversation it ends (the chat messages `previous_response_id`
continues from). Bounds:

1. Time: an entry expires `ttl` seconds after it was last written; an expired entry is
   gone (404) and its bytes are released.
2. Bytes: each entry is weighed as the UTF-8 size of its JSON (response and conversation);
   putting an entry evicts the least recently used others until the total fits
   `max_bytes`. An entry larger than `max_bytes` on its own is not kept (`put` says so).

Background responses (`background: true`) live here while they run: the entry holds the
task generating them, so `cancel` can stop it; `status` moves from "queued" or
"in_progress" to a final one ("completed", "incomplete", "failed", "cancelled").

NOTE: the store is used from the event loop only (no locks); time comes from `clock`.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import json
import time
from collections.abc import Callable

FINAL_STATUSES = ("completed", "incomplete", "failed", "cancelled")
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_TTL = 3600.0


@dataclasses.dataclass
class StoredResponse:
    """One kept response.

    Attributes:
      response: the response object (the JSON body `GET /v1/responses/{id}` returns).
      messages: the conversation this response ends, as chat messages (its input after
        `instructions`, then its output), for `previous_response_id`.
      input_items: the items of its own input (with ids), for `input_items`.
      task: the background task generating it (None: not background, or done).
      size: bytes counted against the store's bound.
      expires: clock time after which it is gone.
    """

    response: dict
    messages: tuple[dict, ...]
    input_items: tuple[dict, ...] = ()
    task: object = None
    size: int = 0
    expires: float = 0.0

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATUSES


def _weight(entry: StoredResponse) -> int:
    return len(json.dumps([entry.response, entry.messages, entry.input_items],
                          ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    """Responses by id, bounded by `ttl` seconds and `max_bytes` (see the module docstring).

    Args:
      max_bytes: the total size kept at most (least recently used entries go first).
      ttl: seconds an entry lives after its last write.
      clock: the time source (monotonic seconds).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, ttl: float = DEFAULT_TTL,
                 clock: Callable[[], float] = time.monotonic):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl, clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._deadlines: list[tuple[float, str]] = []  # (expires, id), stale ones skipped
        self.num_bytes = 0
        self.evicted = 0  # entries dropped for room (not counting expiry or delete)

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Keeps (or replaces) `entry` under its response's id; evicts what no longer fits.
        Returns False when the entry alone exceeds `max_bytes` (it is then not kept, and
        an older entry of that id is dropped)."""
        rid = entry.response["id"]
        self._drop(rid)
        self._expire()
        entry.size = _weight(entry)
        if entry.size > self.max_bytes:
            return False
        entry.expires = self.clock() + self.ttl
        heapq.heappush(self._deadlines, (entry.expires, rid))
        while self._entries and self.num_bytes + entry.size > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evicted += 1
        self._entries[rid] = entry
        self.num_bytes += entry.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        """The entry of `rid` (now the most recently used), or None: never kept, evicted,
        expired or deleted."""
        self._expire()
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> StoredResponse | None:
        """Removes `rid`; returns what it held (None if nothing)."""
        self._expire()
        return self._drop(rid)

    def _drop(self, rid: str) -> StoredResponse | None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.num_bytes -= entry.size
        return entry

    def _expire(self) -> None:
        now, deadlines = self.clock(), self._deadlines
        while deadlines and deadlines[0][0] <= now:
            expires, rid = heapq.heappop(deadlines)
            entry = self._entries.get(rid)
            if entry is not None and entry.expires == expires:  # else rewritten since
                self._drop(rid)
        if len(deadlines) > 2 * len(self._entries) + 64:  # stale deadlines: rebuild
            self._deadlines = [(e.expires, rid) for rid, e in self._entries.items()]
            heapq.heapify(self._deadlines)
