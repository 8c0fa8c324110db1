"""Ragged paged attention as a compiled CPU kernel (`cpu_attention.cc`, an XLA FFI call).

Dataflow:
    1. `kernel_unavailable()` builds the kernel once per machine: the C++ source beside this
       file is compiled with the system's C++ compiler against jaxlib's FFI headers into a
       per-user cache directory (named by a digest of the source, the flags, jaxlib's
       version and the CPU), then loaded and registered as an FFI target. A machine
       without a compiler, or a failed build, gets a reason (the xla path runs instead).
    2. `ragged_paged_attention_cpu(inputs)` hands one call's arrays to the kernel: q as
       float32, the pages as they are stored (float32, bfloat16 or 8-bit with their
       value table), the options as small arrays (the window and scales may be traced).
    3. The kernel splits the rows over XLA's intra-op thread pool (both cores of a
       2-core machine), walks each row's visible keys a page at a time and writes
       float32 rows (padding rows zero); the output is cast back to q's dtype here.
    `write_kv_cpu` is the step's other half on the CPU: this step's keys and values
    copied into their slots in place (the pages aliased with the result).

Why a kernel of its own: XLA:CPU runs the xla path's tile loops on one core with a few
microseconds of dispatch per op, so a 32-row decode step spent most of its attention time
between ops, and gathering pages copied every key before reading it
(docs/design/cpu-step-profile.md). The kernel reads keys in place.

NOTE: every row is computed by the same code in the same key order (pages in position
order), whatever else the call holds: the kernel is batch- and chunk-invariant by
construction (docs/design/batch-invariance.md).
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
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels.attention_inputs import AttentionInputs

TARGET = "arcjax_cpu_paged_attention"
WRITE_TARGET = "arcjax_cpu_write_kv"
SOURCE = pathlib.Path(__file__).with_name("cpu_attention.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# Page storage the kernel reads: float32, bfloat16, float16, and 8-bit floats through a
# table (cpu_attention.cc PageKind).
_PAGE_KIND = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 3}
_BYTE_KIND = 2


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


def _build() -> pathlib.Path:
    """The kernel's shared library, compiled unless this machine already has it."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++ on PATH, or $CXX)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), cxx.encode(),
                                     jaxlib.__version__.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    lib = cache_dir() / f"cpu_attention-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders (test workers) never load
    # a half-written library.
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        built = pathlib.Path(tmp) / lib.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        os.replace(built, lib)
    return lib


@functools.cache
def kernel_unavailable() -> str | None:
    """Why the CPU kernel cannot run in this process, or None once it is built, loaded and
    registered (at most one build per process; the library is reused across processes)."""
    if os.environ.get("ARCJAX_CPU_ATTENTION", "1") == "0":
        return "disabled by ARCJAX_CPU_ATTENTION=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ArcjaxCpuAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(lib.ArcjaxCpuWriteKV),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"the CPU attention kernel could not be built: {e}"
    return None


def unsupported(*, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
                kv_dtype) -> str | None:
    """Why the kernel cannot take a call of these shapes (None: it can)."""
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in _PAGE_KIND and not (kv_dtype.itemsize == 1 and
                                           jnp.issubdtype(kv_dtype, jnp.floating)):
        return (f"pages of {kv_dtype} (the kernel reads float32, bfloat16, float16 and "
                f"8-bit float pages)")
    del head_dim, block_size, num_heads, num_kv_heads  # any (Hq a multiple of Hkv)
    return None


def _byte_table(dtype) -> np.ndarray:
    """[256] float32: the value of each byte of an 8-bit page (zeros for other pages)."""
    if jnp.dtype(dtype).itemsize != 1:
        return np.zeros(256, np.float32)
    return np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype)).astype(np.float32)


def ragged_paged_attention_cpu(inputs: AttentionInputs) -> jax.Array:  # [T, Hq, D]
    """`inputs`' attention by the compiled CPU kernel (`kernel_unavailable()` must be None).

    Returns:
        `[T, Hq, D]` in q's dtype; float32 arithmetic whatever the dtypes.
    """
    q = inputs.q
    kv_dtype = jnp.dtype(inputs.k_pages.dtype)
    i32, f32 = jnp.int32, jnp.float32
    window = (jnp.zeros((), i32) if inputs.sliding_window is None
              else jnp.asarray(inputs.sliding_window, i32))
    one = jnp.ones((), f32)
    scales = jnp.stack([one if inputs.k_scale is None else inputs.k_scale.astype(f32),
                        one if inputs.v_scale is None else inputs.v_scale.astype(f32)])
    sinks = (jnp.zeros((inputs.num_heads,), f32) if inputs.sinks is None
             else inputs.sinks.astype(f32))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, f32),
                            vmap_method="sequential")
    out = call(q.astype(f32), inputs.k_pages, inputs.v_pages, inputs.block_tables,
               inputs.kv_lens, inputs.cu_seqlens_q, inputs.num_seqs.astype(i32), window,
               scales, jnp.asarray(_byte_table(kv_dtype)), sinks,
               sm_scale=np.float32(inputs.sm_scale),
               softcap=np.float32(inputs.logit_softcap or 0.0),
               page_kind=np.int32(_PAGE_KIND.get(kv_dtype, _BYTE_KIND)),
               has_sinks=inputs.sinks is not None)
    return out.astype(q.dtype)


def write_kv_cpu(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows `k[t]`, `v[t]` ([T, Hkv, D], already in the pages' dtype) copied into slot
    `slot_mapping[t]` of the pages (`kernel_unavailable()` must be None); slots outside
    `[0, num_blocks * block_size)` write nothing. The results alias the pages, so under jit
    with the cache donated the write is in place: XLA:CPU's own scatter into 16-bit
    pages converts the whole cache to float32 and back.

    Returns:
        The updated `(k_pages, v_pages)`.
    """
    call = jax.ffi.ffi_call(WRITE_TARGET, (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                           jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))
