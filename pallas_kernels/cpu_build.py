"""Building and loading the CPU kernels: C++ behind XLA's FFI (decision 0026).

`pallas_kernels/cpu_attention.cc` (attention, the KV write) and
`pallas_kernels/cpu_matmul.cc` (decode-sized products), with what they share
(`pallas_kernels/cpu_simd.h`), are compiled together, on first use,
with the machine's C++ compiler against jaxlib's FFI headers into one shared library in a
per-user cache directory, named by a digest of the sources, the flags, the compiler,
jaxlib's version and the CPU's feature flags (`-march=native` compiles for this CPU); then
loaded with ctypes and registered as FFI targets of the CPU platform. Concurrent builders
(test workers) each build beside the target and rename: nobody loads a half-written file.
`kernels_unavailable()` says why the kernels cannot run in this process (no compiler, a
failed build, `ARCJAX_CPU_KERNELS=0`), or None.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jaxlib

HERE = pathlib.Path(__file__).parent
SOURCES = (HERE / "cpu_attention.cc", HERE / "cpu_matmul.cc")
HEADERS = (HERE / "cpu_simd.h",)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         "-ffp-contract=fast")
# FFI target name -> the library's handler symbol
TARGETS = {"arcjax_cpu_paged_attention": "ArcjaxCpuAttention",
           "arcjax_cpu_write_kv": "ArcjaxCpuWriteKV",
           "arcjax_cpu_matmul": "ArcjaxCpuMatmul"}


def cache_dir() -> pathlib.Path:
    """Where built kernels live: $ARCJAX_CACHE_DIR, else $XDG_CACHE_HOME/arcjax, else
    ~/.cache/arcjax."""
    root = os.environ.get("ARCJAX_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME")
                            or os.path.join(os.path.expanduser("~"), ".cache"), "arcjax")
    return pathlib.Path(root) / "kernels"


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") \
        or shutil.which("clang++")


def build() -> pathlib.Path:
    """The kernels' shared library, compiled unless this machine already has it."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++ on PATH, or $CXX)")
    parts = [source.read_bytes() for source in SOURCES + HEADERS]
    parts += [" ".join(FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode(),
              _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    lib = cache_dir() / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        built = pathlib.Path(tmp) / lib.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        os.replace(built, lib)
    return lib


@functools.cache
def kernels_unavailable() -> str | None:
    """Why the CPU kernels cannot run in this process, or None once they are built, loaded
    and registered (at most one build per process; the library is reused across processes)."""
    if os.environ.get("ARCJAX_CPU_KERNELS", "1") == "0":
        return "disabled by ARCJAX_CPU_KERNELS=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return f"the CPU kernels could not be built: {e}"
    return None
