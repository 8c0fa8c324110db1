"""What the installed JAX and Triton offer on the GPU, and which kernel "auto" runs.

The GPU implementations and what each needs:

- "pallas_gpu": Pallas' Triton backend (deprecated by JAX 0.11: it warns
  `jax-pallas-triton` whenever a kernel lowers). On the CPU: Pallas interpret mode and
  the CUDA lowering.
- "triton": `triton` + `jax_triton`, and a jaxlib with its CUDA plugin (which registers
  the custom call that launches Triton kernels; jax-triton 0.3 refuses to import without
  it). On the CPU: Triton's own interpreter.
- "mosaic_gpu": `jax.experimental.pallas.mosaic_gpu`; decode-only bf16/f16 batches. On the
  CPU: the CUDA lowering only; its numbers are trusted once a GPU run has passed.

"auto" on a GPU (`resolve`), for shapes the GPU kernels tile:
1. a plain decode-only batch takes "mosaic_gpu" once a GPU run of this very kernel
   passed the oracle on this kind of device and jax (`verified.has_passed`);
2. a plain batch takes "pallas_gpu" while Pallas' Triton backend exists and is not
   deprecated ("plain": no sliding window, soft-cap or k/v scales, which these two
   kernels lack);
3. "triton" (every option) when triton and jax_triton can launch;
4. otherwise "xla". "auto" never selects a deprecated backend, so our call sites never
   emit the `jax-pallas-triton` warning (an explicit `impl="pallas_gpu"` still may).
Off the GPU, "auto" is "xla".
"""

from __future__ import annotations

import functools
import importlib.util

import jax

from pallas_kernels import verified

PALLAS_TRITON_DEPRECATION = "jax-pallas-triton"


@functools.cache
def pallas_triton_state() -> str:
    """"current", "deprecated" (JAX warns when a kernel lowers) or "absent"."""
    try:
        from jax.experimental.pallas import triton as _  # noqa: F401
    except ImportError:
        return "absent"
    try:
        from jax._src import deprecations
    except ImportError:
        return "current"
    try:
        deprecations.is_accelerated(PALLAS_TRITON_DEPRECATION)
    except ValueError:  # not registered: this jax does not deprecate the backend
        return "current"
    return "deprecated"


@functools.cache
def triton_unavailable() -> str | None:
    """Why `impl="triton"` cannot launch on a GPU here, or None if it can."""
    for name in ("triton", "jax_triton"):
        if importlib.util.find_spec(name) is None:
            return f"the {name} package is not installed (pip install 'arcjax[gpu]')"
    from jax._src.lib import gpu_triton

    if not hasattr(gpu_triton, "TritonKernel"):
        return "this jaxlib has no CUDA plugin (its gpu_triton module cannot launch kernels)"
    return None


@functools.cache
def mosaic_gpu_unavailable() -> str | None:
    """Why `impl="mosaic_gpu"` cannot be built here, or None if it can."""
    try:
        from jax.experimental.pallas import mosaic_gpu as _  # noqa: F401
    except ImportError as e:
        return f"jax {jax.__version__} has no Pallas Mosaic GPU backend: {e}"
    return None


def mosaic_gpu_unsupported(**shapes) -> str | None:
    """Why the Mosaic GPU kernel cannot take these shapes (`mosaic_gpu.unsupported`), or
    None; also when this jax has no Mosaic GPU backend."""
    reason = mosaic_gpu_unavailable()
    if reason is not None:
        return reason
    from pallas_kernels import mosaic_gpu

    return mosaic_gpu.unsupported(**shapes)


def device_kind() -> str:
    """The default device's kind, e.g. "NVIDIA H200" (what GPU records are keyed by)."""
    return jax.devices()[0].device_kind


def resolve(*, on_gpu: bool, can_tile: bool, decode_only: bool, plain: bool = True,
            kind: str | None = None) -> str:
    """The implementation "auto" runs.

    Args:
        on_gpu: the default backend is a GPU.
        can_tile: the head dim and block size are ones the GPU kernels tile.
        decode_only: the batch is decode-only (`max_q_len == 1`) in shapes and dtypes the
            Mosaic GPU kernel takes.
        plain: no sliding window, soft-cap or k/v scales.
        kind: the device kind, for the Mosaic GPU record (defaults to the device's).
    """
    if not (on_gpu and can_tile):
        return "xla"
    if plain and decode_only and mosaic_gpu_unavailable() is None and verified.has_passed(
            "mosaic_gpu", kind or device_kind()):
        return "mosaic_gpu"
    if plain and pallas_triton_state() == "current":
        return "pallas_gpu"
    if triton_unavailable() is None:
        return "triton"
    return "xla"
