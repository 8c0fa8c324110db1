"""Directories the test helpers write models and checkpoints into: all under one root per
process, removed when the process exits (so a session leaves nothing behind in the temp
directory). Each call makes a fresh directory (`tempfile.mkdtemp`), so two processes, or
two workers of one session, never write the same path."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile


@functools.lru_cache(maxsize=None)
def _root() -> str:
    root = tempfile.mkdtemp(prefix="arcjax-tests-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def scratch_dir(prefix: str) -> str:
    """A new empty directory named `prefix...` under this process's root."""
    return tempfile.mkdtemp(prefix=prefix, dir=_root())
