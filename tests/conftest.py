"""Test-wide settings: CPU only, deterministic hypothesis profile, and a bound on the
memory mappings the compiled steps of one long pytest process hold.

NOTE: every XLA:CPU executable maps its code and data in hundreds of small regions (an
engine step of a tiny test model: ~600), and Linux refuses a process more than
`vm.max_map_count` (65,530 by default) mappings: past that, the next compile dies with a
segmentation fault inside XLA. Engines built by `build_engine` share their compiled steps
through `executable_cache.SHARED_EXECUTABLES`, and test modules keep engines in caches that outlive
them, so nothing compiled in the suite was ever freed: it crossed the limit about half-way.
After each test module, when the process holds more than MAX_MAPPINGS regions, the shared
executables, every cache registered with `support.device_caches` (the cached engines and
loaded params) and JAX's caches are dropped (later modules compile what they need again).

NOTE: compiling is most of the suite's time (an engine module spends ~70% of it in XLA), and
the same programs are compiled again and again: by both xdist workers, by a module after the
caches were dropped, and by the subprocesses tests start (servers, multi-device runs, the GPU
check's tasks). So the suite runs with JAX's persistent compilation cache in one directory per
run: the first process to start (the xdist controller, or a lone pytest) makes it, every later
worker and subprocess inherits it through `JAX_COMPILATION_CACHE_DIR`, and the maker deletes it
at exit. A compile found there is the executable XLA wrote, byte for byte, so no test sees a
different program. No size limit: a limit turns on JAX's eviction, which lists and reads the
whole directory on every write (quadratic: ~0.2 s a write at 1,500 entries). Without it two
processes may write one entry at once; a reader that finds it half-written fails to decompress
it, warns and compiles (JAX catches cache read errors). Set `JAX_COMPILATION_CACHE_DIR`
yourself to keep a cache across runs (it is then never deleted).
"""

import atexit
import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _share_compiled_programs() -> None:
    """One persistent compilation cache for this run's processes (before JAX is imported)."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="arcjax-tests-xla-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    # compiles under a quarter second are cheaper to redo than to write
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")


_share_compiled_programs()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")

MAX_MAPPINGS = 30_000  # of the kernel's default 65,530; one module adds up to ~13,000


def _mappings() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return None


def _free_compiled_steps() -> None:
    import jax

    from arcjax.runtime import executable_cache
    from support.device_caches import clear_device_caches

    clear_device_caches()
    executable_cache.SHARED_EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(trylast=True)  # after the module's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and nextitem.module is item.module:
        return
    count = _mappings()
    if count is not None and count > MAX_MAPPINGS:
        _free_compiled_steps()
