"""Records of GPU runs that passed the oracle, and the check "auto" makes against them.

Interpret mode and the CUDA lowering check a GPU kernel's logic and its lowering on the
CPU, never its numbers on the device. `scripts/gpu_check.sh` runs every GPU
implementation against the oracle on the GPU and, for an implementation whose every case
passed there, writes one record per shape class its cases covered:

    {"impl": "triton", "device_kind": "NVIDIA H200", "jax": "0.11.2", "jaxlib": "0.11.2",
     "libraries": {"jax-triton": "0.3.1", "triton": "3.6.0"},
     "source": "<sha256 of the kernel's source files>", "shape_class": "d128-p16-g4-fp8",
     "when": "2026-11-20T10:00:00Z", "cases": 2}

A record vouches only for the same implementation, on the same kind of device, under the
same jax/jaxlib and the implementation's own libraries (`library_versions`), for the same
shape class (`ShapeClass`: head dim, page size, GQA ratio, window / soft-cap / FP8 pages /
sinks; for latent attention's kernel, "mla_pallas_gpu", latent dim, rope dim, page size and
heads: its records are written by the device check's `kernel_table.mla` row),
with the kernel's source byte for byte as it was (`source_digest`): edit the kernel and
its records no longer count until the check passes again.

Records are read from `pallas_kernels/verified_kernels.json`, shipped with the package (a
developer commits the records a GPU session brought back, so every installation of that
release trusts them), and from the file `$ARCJAX_VERIFIED_KERNELS` names, if set. They
are written only there: the device script sets it to its output directory, so the
records come back with the run's figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from importlib import metadata

import jax
import jaxlib

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verified_kernels.json")
ENV = "ARCJAX_VERIFIED_KERNELS"
# What a user runs, on the GPU, to record passes (scripts/gpu_check.sh's header).
VERIFY_COMMAND = "bash scripts/gpu_check.sh --out DIR"

# The source files each implementation's numbers depend on (besides its libraries).
SOURCES = {
    "mosaic_gpu": ("mosaic_gpu.py", "gpu_plan.py", "plan.py", "attention_inputs.py"),
    "triton": ("triton_kernel.py", "triton_gpu.py", "gpu_plan.py", "plan.py",
               "attention_inputs.py"),
    "pallas_gpu": ("pallas_gpu.py", "gpu_plan.py", "plan.py", "attention_inputs.py"),
    # latent attention's Pallas GPU kernel (`mla.py`'s impl="pallas_gpu")
    "mla_pallas_gpu": ("mla_pallas_gpu.py", "mla_inputs.py", "pallas_gpu.py", "gpu_plan.py",
                       "plan.py"),
}
MLA_KERNEL = "mla_pallas_gpu"  # latent attention's Pallas GPU kernel, in SOURCES' names
# Distributions each implementation runs on besides jax and jaxlib.
LIBRARIES = {"mosaic_gpu": (), "pallas_gpu": (), "triton": ("jax-triton", "triton"),
             "mla_pallas_gpu": ()}


class RecordPathError(ValueError):
    """No record file to write: `$ARCJAX_VERIFIED_KERNELS` is not set and no path given."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeClass:
    """The facts of a call a GPU pass is specific to. Latent attention (MLA) is one KV
    "head" shared by every query head: `head_dim` its latent dim, `rope_dim` its rope
    dim, `gqa` the query heads."""

    head_dim: int
    page_size: int
    gqa: int  # query heads per KV head
    rope_dim: int = 0  # MLA's rope key dim (0: not latent attention)
    window: bool = False  # a sliding window
    softcap: bool = False  # a logit soft-cap
    fp8: bool = False  # 1-byte pages (with k/v scales)
    sinks: bool = False  # per-head sink logits

    @property
    def key(self) -> str:
        """e.g. "d128-p16-g4", "d128-p16-g4-window-softcap" or (MLA) "d512-r64-p16-g16"."""
        flags = [name for name in ("window", "softcap", "fp8", "sinks") if getattr(self, name)]
        rope = [f"r{self.rope_dim}"] if self.rope_dim else []
        return "-".join([f"d{self.head_dim}", *rope, f"p{self.page_size}", f"g{self.gqa}",
                         *flags])

    @classmethod
    def from_key(cls, key: str) -> "ShapeClass":
        """The class `key` names (the inverse of `key`); ValueError if it names none."""
        match = re.fullmatch(r"d(\d+)(?:-r(\d+))?-p(\d+)-g(\d+)((?:-window)?)((?:-softcap)?)"
                             r"((?:-fp8)?)((?:-sinks)?)", key)
        if match is None:
            raise ValueError(f"shape_class: {key!r} is not like 'd128[-r64]-p16-g4[-window]"
                             f"[-softcap][-fp8][-sinks]'")
        d, r, p, g, window, softcap, fp8, sinks = match.groups()
        return cls(head_dim=int(d), rope_dim=int(r or 0), page_size=int(p), gqa=int(g),
                   window=bool(window),
                   softcap=bool(softcap), fp8=bool(fp8), sinks=bool(sinks))


def local_path() -> str | None:
    """The record file `$ARCJAX_VERIFIED_KERNELS` names, or None."""
    return os.environ.get(ENV) or None


@functools.cache
def source_digest(impl: str) -> str:
    """sha256 over the source files of `impl` (see `SOURCES`)."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in SOURCES[impl]:
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


@functools.cache
def library_versions(impl: str) -> dict[str, str | None]:
    """Installed versions of the distributions `impl` runs on (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in LIBRARIES[impl]:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _read(path: str | None) -> list[dict]:
    if not path:
        return []
    try:
        with open(path) as f:
            records = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return []  # an unreadable record file vouches for nothing
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def records(path: str | None = None) -> list[dict]:
    """Every record: the shipped ones, then `path`'s (default: `local_path()`)."""
    return _read(SHIPPED) + _read(path or local_path())


def current(impl: str, device_kind: str, shape: ShapeClass) -> dict:
    """The fields a record must carry to vouch for `impl` on `shape` here and now."""
    return dict(impl=impl, device_kind=device_kind, jax=jax.__version__,
                jaxlib=jaxlib.__version__, libraries=library_versions(impl),
                source=source_digest(impl), shape_class=shape.key)


def has_passed(impl: str, device_kind: str, shape: ShapeClass | None,
               path: str | None = None) -> bool:
    """Whether a GPU run of this very kernel passed on this kind of device, these library
    versions and this shape class (None: a class not known, which nothing vouches for)."""
    if shape is None or impl not in SOURCES:
        return False
    want = current(impl, device_kind, shape)
    return any(all(r.get(k) == v for k, v in want.items()) for r in records(path))


def record_pass(impl: str, device_kind: str, cases: Mapping[ShapeClass, int], *,
                path: str | None = None) -> list[dict]:
    """Appends one record per shape class of a passing run (class -> cases that passed)
    to `path` (default: `$ARCJAX_VERIFIED_KERNELS`); returns them. Raises
    RecordPathError with neither."""
    path = path or local_path()
    if not path:
        raise RecordPathError(f"{ENV} is not set: no record file to write GPU passes to")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = [current(impl, device_kind, shape) | dict(when=when, cases=n)
               for shape, n in sorted(cases.items(), key=lambda item: item[0].key)]
    existing = _read(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(existing + entries, f, indent=1)
    os.replace(tmp, path)
    return entries
