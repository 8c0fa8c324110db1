"""One registry of the test caches whose values hold device state, so the suite can drop it.

`device_cache` is `functools.lru_cache(maxsize=None)` for a function whose values hold
compiled XLA executables or device buffers (engines with their compiled steps and KV caches,
loaded params); it registers the cache here, and tests/conftest.py calls
`clear_device_caches()` when the process holds too many memory mappings (see the NOTE
there). Caches of plain data (model directories on disk, reference token lists) hold no
mappings: they stay plain `functools.lru_cache`s and live for the whole session, so a model
directory keeps its path for every engine built from it.
"""

from __future__ import annotations

import functools

_CACHES: list = []


def device_cache(fn):
    """`functools.lru_cache(maxsize=None)(fn)`, registered for `clear_device_caches`."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _CACHES.append(cached)
    return cached


def clear_device_caches() -> int:
    """Empties every registered cache; returns how many entries were dropped."""
    dropped = 0
    for cache in _CACHES:
        dropped += cache.cache_info().currsize
        cache.cache_clear()
    return dropped
