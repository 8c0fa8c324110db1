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

"auto" on a GPU (`choose`), for shapes the GPU kernels tile, one rule for all three:
1. the implementations that implement the call and can run here, in this order:
   "mosaic_gpu" (a plain decode-only batch of the shapes it takes), "pallas_gpu" (while
   Pallas' Triton backend exists and is not deprecated, for every option the caller
   says it takes: `pallas_gpu_ok`, by default plain batches only), "triton" (every
   option, when triton and jax_triton can launch);
2. the first of them with a recorded GPU pass for this device kind, these library
   versions and this shape class (`verified.has_passed`) runs, verified;
3. with none recorded, the first that may run unverified does, and the choice says so
   (`Choice.verified` False: the engine logs it and reports it with the command that
   verifies it); "mosaic_gpu" is never chosen unverified (nothing on the CPU runs it);
4. otherwise "xla". "auto" never selects a deprecated backend, so our call sites never
   emit the `jax-pallas-triton` warning (an explicit `impl="pallas_gpu"` still may).
Off the GPU, "auto" is "cpu" (the compiled CPU kernel, `cpu_attention`) where it builds and
takes the call's pages, else "xla".
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax

from pallas_kernels import verified

PALLAS_TRITON_DEPRECATION = "jax-pallas-triton"
GPU_KERNELS = ("mosaic_gpu", "pallas_gpu", "triton")  # "auto"'s order of preference
NEEDS_RECORD = ("mosaic_gpu",)  # chosen by "auto" only with a recorded GPU pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """The implementation a call runs, and whether a GPU pass vouches for it."""

    impl: str
    # True: a recorded GPU pass vouches for it; False: a GPU kernel runs without one;
    # None: not a GPU kernel ("xla", "reference"), nothing to record.
    verified: bool | None
    shape_class: str | None = None  # `verified.ShapeClass.key`, when known

    @property
    def note(self) -> str | None:
        """What the engine logs when a GPU kernel runs unverified, else None."""
        if self.verified is not False:
            return None
        return (f'attention impl="{self.impl}" runs without a recorded GPU pass for shape '
                f"class {self.shape_class or 'unknown'} on this device and jax "
                f"{jax.__version__} (verified: false); to verify it, on the GPU: "
                f"{verified.VERIFY_COMMAND}")


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


def verification(impl: str, shape: verified.ShapeClass | None,
                 kind: str | None = None) -> Choice:
    """`impl` (an explicit choice) as a `Choice`: verified when a GPU kernel has a record."""
    if impl not in GPU_KERNELS:
        return Choice(impl=impl, verified=None, shape_class=shape.key if shape else None)
    return Choice(impl=impl, verified=verified.has_passed(impl, kind or device_kind(), shape),
                  shape_class=shape.key if shape else None)


def choose(*, on_gpu: bool, can_tile: bool, decode_only: bool, plain: bool = True,
           kind: str | None = None, pallas_gpu_ok: bool | None = None,
           shape: verified.ShapeClass | None = None, cpu_ok: bool = False) -> Choice:
    """The implementation "auto" runs (the rule in the module docstring).

    Args:
        on_gpu: the default backend is a GPU.
        can_tile: the head dim and block size are ones the GPU kernels tile.
        decode_only: the batch is decode-only (`max_q_len == 1`) in shapes and dtypes the
            Mosaic GPU kernel takes.
        plain: no sliding window, soft-cap or k/v scales.
        kind: the device kind, for the records (defaults to the device's).
        pallas_gpu_ok: the Pallas GPU kernel implements every option of this call (None:
            only when `plain`).
        shape: the call's shape class, for the records (None: unknown, none vouches).
        cpu_ok: off the GPU, the compiled CPU kernel can take the call.
    """
    if not (on_gpu and can_tile):
        return Choice(impl="cpu" if cpu_ok and not on_gpu else "xla", verified=None,
                      shape_class=shape.key if shape else None)
    eligible = []
    if plain and decode_only and mosaic_gpu_unavailable() is None:
        eligible.append("mosaic_gpu")
    if (plain if pallas_gpu_ok is None else pallas_gpu_ok) and (
            pallas_triton_state() == "current"):
        eligible.append("pallas_gpu")
    if triton_unavailable() is None:
        eligible.append("triton")
    kind = kind or device_kind()
    key = shape.key if shape else None
    for impl in eligible:
        if verified.has_passed(impl, kind, shape):
            return Choice(impl=impl, verified=True, shape_class=key)
    unverified = [impl for impl in eligible if impl not in NEEDS_RECORD]
    if unverified:
        return Choice(impl=unverified[0], verified=False, shape_class=key)
    return Choice(impl="xla", verified=None, shape_class=key)


def resolve(**kwargs) -> str:
    """The implementation "auto" runs: `choose(**kwargs).impl`."""
    return choose(**kwargs).impl
