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
"""

import gc
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
