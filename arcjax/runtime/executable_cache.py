"""Compiled steps shared by runners: `ExecutableCache`, keyed by everything that changes
the compiled program.

NOTE: a key holds the model config, attention implementation, dtype, the bucket's static
bound and `input_signature` of the inputs (the shape, dtype and sharding of every leaf).
Runners share one cache only when they are given the same object (`build_engine` passes
`SHARED_EXECUTABLES`, so engines of one process over the same model and geometry compile
once).
"""

from __future__ import annotations

import threading

import jax


def input_signature(tree) -> tuple:
    """Structure, shapes, dtypes and shardings of every leaf of `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef),) + tuple(
        (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves)


class ExecutableCache:
    """Compiled steps keyed by everything that changes them (thread-safe)."""

    def __init__(self):
        self._items: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # executables this cache compiled (not found)

    def get_or_compile(self, key: tuple, compile_fn):
        with self._lock:
            exe = self._items.get(key)
            if exe is None:
                exe = compile_fn()
                self._items[key] = exe
                self.compiles += 1
            return exe

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Forgets every executable (runners that hold one keep it)."""
        with self._lock:
            self._items.clear()


SHARED_EXECUTABLES = ExecutableCache()
