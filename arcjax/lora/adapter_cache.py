"""The host-side cache of loaded LoRA adapters: an LRU of `max_cpu_loras`, pinned while in use.

1. `check(request)` (any thread) loads and validates the adapter of a `LoRARequest` if it is
   not loaded yet (`peft_adapter.load_peft_adapter`; a bad adapter raises its
   `LoRAAdapterError` here, at submission), and keeps it, unpinned.
2. `acquire(request)` does the same and pins it: the request holds an `AdapterRef` until
   `release(ref)` (the engine's, when the request is released). A pinned adapter is never
   dropped, so the slot table can always copy it to the device.
3. Each load gets a fresh `key`: the scheduler's `Request.adapter` (slot constraint, prefix
   digests) and the device slot table's name for it. A reloaded adapter (dropped, then
   asked for again; or `forget`, then loaded anew) is a new key, so KV that an earlier copy
   computed is never reused for it.
4. Beyond `capacity` loaded adapters, the least recently used unpinned ones are dropped.
   `forget(lora_int_id)` (the server's unload) drops the adapter once no request pins it;
   requests already holding it run to the end. `fresh_id()` is an id none seen so far has
   (the server's adapters take these, so two servers of one engine never clash).

NOTE: one lock guards the maps; files are read outside it, so a slow load never holds up
the engine thread's `release` or `weights`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable

from arcjax.errors import LoRAAdapterError
from arcjax.lora.lora_request import LoRARequest
from arcjax.lora.peft_adapter import PeftAdapter


@dataclasses.dataclass(frozen=True)
class AdapterRef:
    """A pinned adapter, held by one request.

    Attributes:
      key: the adapter's key (the scheduler's `Request.adapter`, the slot table's name).
      request: the `LoRARequest` it was loaded for.
    """

    key: int
    request: LoRARequest


@dataclasses.dataclass(eq=False)
class _Entry:
    adapter: PeftAdapter
    request: LoRARequest
    key: int
    pins: int = 0


class AdapterCache:
    """Loaded adapters by `lora_int_id` (see the module docstring).

    Args:
      load: reads one adapter (`LoRARequest` -> `PeftAdapter`; raises `LoRAAdapterError`).
      capacity: adapters kept loaded when none is pinned (`LoRAConfig.cpu_capacity`).
    """

    def __init__(self, load: Callable[[LoRARequest], PeftAdapter], capacity: int):
        self._load, self.capacity = load, capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # lora_int_id, LRU first
        self._retired: dict[int, _Entry] = {}  # key -> forgotten entries still pinned
        self._keys = itertools.count(1)
        self._top_id = 0  # the largest lora_int_id seen (`fresh_id`)
        self.loads = 0  # adapters read from disk (or the Hub)
        self.evictions = 0

    def check(self, request: LoRARequest) -> None:
        """Loads and validates `request`'s adapter if needed (unpinned)."""
        self._get(request, pin=False)

    def acquire(self, request: LoRARequest) -> AdapterRef:
        """Loads `request`'s adapter if needed and pins it for one request."""
        entry = self._get(request, pin=True)
        return AdapterRef(entry.key, entry.request)

    def release(self, ref: AdapterRef) -> None:
        """Unpins `ref` (once per `acquire`)."""
        with self._lock:
            entry = self._by_key(ref.key)
            if entry is None:
                return
            entry.pins -= 1
            if entry.pins == 0 and self._retired.get(ref.key) is entry:
                del self._retired[ref.key]
                self.evictions += 1
            self._evict()

    def weights(self, key: int) -> PeftAdapter:
        """The host weights of a loaded adapter (pinned ones always are)."""
        with self._lock:
            entry = self._by_key(key)
        if entry is None:
            raise KeyError(f"adapter key {key} is not loaded")
        return entry.adapter

    def forget(self, lora_int_id: int) -> bool:
        """Drops the adapter of `lora_int_id` now, or once its last request releases it.
        Returns whether it was loaded."""
        with self._lock:
            entry = self._entries.pop(lora_int_id, None)
            if entry is None:
                return False
            if entry.pins:
                self._retired[entry.key] = entry
            else:
                self.evictions += 1
            return True

    def fresh_id(self) -> int:
        """A `lora_int_id` no adapter seen so far has (a server's names get these)."""
        with self._lock:
            self._top_id += 1
            return self._top_id

    def loaded(self) -> list[LoRARequest]:
        """The requests of the adapters loaded now (not forgotten), least recent first."""
        with self._lock:
            return [e.request for e in self._entries.values()]

    def pinned(self) -> int:
        """Adapters some request holds."""
        with self._lock:
            return sum(1 for e in (*self._entries.values(), *self._retired.values()) if e.pins)

    # --- internals (lock held where noted) --------------------------------------------------
    def _get(self, request: LoRARequest, pin: bool) -> _Entry:
        if not isinstance(request, LoRARequest):
            raise LoRAAdapterError(str(request), "lora_request",
                                   f"must be an arcjax.LoRARequest or None, got "
                                   f"{type(request).__name__}")
        with self._lock:
            self._top_id = max(self._top_id, request.lora_int_id)
            entry = self._hit(request, pin)
        if entry is not None:
            return entry
        adapter = self._load(request)  # outside the lock: may take a while, may raise
        with self._lock:
            entry = self._hit(request, pin)  # another thread may have loaded it meanwhile
            if entry is None:
                entry = _Entry(adapter, request, next(self._keys), pins=int(pin))
                self._entries[request.lora_int_id] = entry
                self.loads += 1
                self._evict()
        return entry

    def _hit(self, request: LoRARequest, pin: bool) -> _Entry | None:
        """(lock held) The loaded entry of `request`'s id, checked to be the same adapter."""
        entry = self._entries.get(request.lora_int_id)
        if entry is None:
            return None
        known = entry.request
        if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise LoRAAdapterError(request.lora_name, "lora_request.lora_int_id",
                                   f"{request.lora_int_id} names the loaded adapter "
                                   f"{known.lora_name!r} ({known.lora_path}); give another "
                                   "adapter its own id")
        self._entries.move_to_end(request.lora_int_id)
        entry.pins += int(pin)
        return entry

    def _by_key(self, key: int) -> _Entry | None:
        """(lock held)"""
        entry = self._retired.get(key)
        if entry is not None:
            return entry
        return next((e for e in self._entries.values() if e.key == key), None)

    def _evict(self) -> None:
        """(lock held) Drops least recently used unpinned adapters beyond the capacity."""
        excess = len(self._entries) - self.capacity
        for lora_id in [i for i, e in self._entries.items() if not e.pins][:max(0, excess)]:
            del self._entries[lora_id]
            self.evictions += 1
