"""Records of GPU runs that passed the oracle tests, and the check "auto" makes against them.

A kernel that cannot run or be interpreted on the CPU (`impl="mosaic_gpu"`) is trusted by
"auto" only once a GPU run has shown it agrees with the oracle. `scripts/gpu_check.py`
writes one record per implementation it checked and passed:

    {"impl": "mosaic_gpu", "device_kind": "NVIDIA H200", "jax": "0.11.2",
     "jaxlib": "0.11.2", "source": "<sha256 of the kernel's source files>",
     "when": "2026-11-20T10:00:00Z", "cases": 4}

A record vouches only for the same implementation, on the same kind of device, under the
same jax/jaxlib, with the kernel's source byte for byte as it was (`source_digest`): edit
the kernel and the record no longer counts until the check passes again.

Records are read from two places:
1. `pallas_kernels/verified_kernels.json`, shipped with the package (a developer commits
   the records of a GPU session, so every installation of that release trusts them);
2. the local record file, written by `scripts/gpu_check.py` on this machine:
   `$ARCJAX_VERIFIED_KERNELS` if set, else `~/.cache/arcjax/verified_kernels.json`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os

import jax
import jaxlib

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verified_kernels.json")
ENV = "ARCJAX_VERIFIED_KERNELS"

# The source files each implementation's numbers depend on (besides jax itself).
SOURCES = {
    "mosaic_gpu": ("mosaic_gpu.py", "gpu_plan.py", "plan.py", "attention_inputs.py"),
    "triton": ("triton_kernel.py", "triton_gpu.py", "gpu_plan.py", "plan.py",
               "attention_inputs.py"),
    "pallas_gpu": ("pallas_gpu.py", "gpu_plan.py", "plan.py", "attention_inputs.py"),
}


def local_path() -> str:
    """Where this machine's records live."""
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "arcjax",
                                               "verified_kernels.json")


def source_digest(impl: str) -> str:
    """sha256 over the source files of `impl` (see `SOURCES`)."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in SOURCES[impl]:
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            records = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return []  # an unreadable record file vouches for nothing
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def records(path: str | None = None) -> list[dict]:
    """Every record: the shipped ones, then the local file's (or `path`'s)."""
    return _read(SHIPPED) + _read(path or local_path())


def current(impl: str, device_kind: str) -> dict:
    """The fields a record must carry to vouch for `impl` here and now."""
    return dict(impl=impl, device_kind=device_kind, jax=jax.__version__,
                jaxlib=jaxlib.__version__, source=source_digest(impl))


def has_passed(impl: str, device_kind: str, path: str | None = None) -> bool:
    """Whether a GPU run of this very kernel passed on this kind of device and jax."""
    want = current(impl, device_kind)
    return any(all(r.get(k) == v for k, v in want.items()) for r in records(path))


def record_pass(impl: str, device_kind: str, *, cases: int, path: str | None = None) -> dict:
    """Appends a passing run's record to the local file (or `path`); returns it."""
    path = path or local_path()
    entry = current(impl, device_kind) | dict(
        when=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        cases=cases)
    existing = _read(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(existing + [entry], f, indent=1)
    os.replace(tmp, path)
    return entry
