"""Lowering for CUDA without a GPU: the check every kernel (and engine) test can call.

`jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))` runs the whole
Pallas -> Triton lowering on the host. It catches what interpret mode cannot:
shapes Triton refuses (non power-of-two blocks, dots below 16), unsupported
primitives inside the kernel, and index math that only the real lowering
type-checks. Compiling the Triton IR to PTX is a separate step
(`scripts/gpu_compile_report.py`, needs the optional `triton` package).

NOTE: nothing here imports triton; `capture_triton_ir` reads the Triton module
text through a jax-internal hook and is for tools, not for the engine.

NOTE: from jax 0.11 the Pallas Triton lowering asks which GPU it lowers for
(`get_gpu_info`) and, with no GPU attached, refuses unless an abstract GPU device
is in context; `lower_for_cuda` lowers inside one (`TARGET_DEVICE_KIND`, the
H200 the kernels are tuned for) wherever this jax offers it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp


TARGET_DEVICE_KIND = "NVIDIA H200"  # what a CPU host lowers for (sm_90a)
TARGET_CORES = 132  # its SMs


def _target_device():
    """A context naming an abstract `TARGET_DEVICE_KIND` GPU for the lowering, or a null
    context on a jax without abstract devices (<= 0.10 lowers without asking)."""
    device_cls = getattr(jax.sharding, "AbstractDevice", None)
    if device_cls is None or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = device_cls(device_kind=TARGET_DEVICE_KIND, num_cores=TARGET_CORES,
                        platform="gpu")
    try:
        mesh = jax.sharding.AbstractMesh((1,), ("target",), abstract_device=device)
    except TypeError:  # an AbstractMesh without devices: nothing to name
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def lower_for_cuda(fn: Callable, *args, **static) -> str:
    """StableHLO text of `fn(*args, **static)` lowered for CUDA on this host.

    Args:
        fn: any jax function; `static` keyword arguments are bound with
            `functools.partial` (so they must be hashable-free Python values,
            not arrays).
        args: arrays or `jax.ShapeDtypeStruct`s.

    Returns:
        The lowered module's text; a Pallas Triton kernel appears in it as a
        custom call whose target names triton.
    """
    jitted = jax.jit(functools.partial(fn, **static))
    with _target_device():
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Custom-call targets of a Pallas Triton kernel in lowered text: jaxlib <= 0.10.2 carries
# the Triton IR for XLA to compile; later versions compile at lowering time (FFI call).
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def triton_kernel_calls(lowered_text: str) -> int:
    """How many Pallas Triton kernel launches the lowered text contains.

    An engine step that lowered every layer's attention to the XLA fallback
    instead would show 0 here.
    """
    targets = "|".join(re.escape(t) for t in TRITON_CALL_TARGETS)
    return len(re.findall(rf'custom_call @"?(?:{targets})', lowered_text))


def cuda_lowering_unavailable() -> str | None:
    """Why this jax cannot lower a Pallas kernel for CUDA here, or None if it can.

    The probe is a trivial copy kernel through the same Triton lowering as ours,
    so its failure is the platform's (no CUDA lowering registered, a jaxlib that
    compiles Triton at lowering time without its plugin), never a bug in our
    kernels: those must fail the tests instead.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def probe(x):  # through the Triton lowering, as our kernels (not jax's GPU default)
        return pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=plgpu.CompilerParams())(x)

    try:
        lower_for_cuda(probe, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    except Exception as e:  # noqa: BLE001 - any failure of a trivial kernel is the platform's
        return f"jax {jax.__version__} cannot lower Pallas/Triton for CUDA here: {e}"
    return None


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas kernel's Triton IR, as the lowering produced it."""

    name: str
    ir: str  # MLIR text of the `tt` module


@contextlib.contextmanager
def capture_triton_ir() -> Iterator[list[TritonModule]]:
    """Collects the Triton module of every Pallas kernel lowered inside the block.

    Wraps jax's (internal) Pallas -> Triton lowering function; the list fills
    as kernels lower. Raises RuntimeError if this jax has no such function.
    """
    try:
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError as e:
        raise RuntimeError(f"jax {jax.__version__} has no Pallas Triton lowering: {e}") from e
    original = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:
        raise RuntimeError(f"jax {jax.__version__}: Pallas Triton lowering entry point moved")
    modules: list[TritonModule] = []

    @functools.wraps(original)
    def capturing(jaxpr, *rest, **kwargs):
        result = original(jaxpr, *rest, **kwargs)
        op = result.module.operation
        modules.append(TritonModule(name=str(op.attributes["sym_name"]).strip('"'),
                                    ir=op.get_asm(enable_debug_info=False)))
        return result

    triton_lowering.lower_jaxpr_to_triton_module = capturing
    try:
        yield modules
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original


@contextlib.contextmanager
def capture_mosaic_smem() -> Iterator[list[int]]:
    """Collects the shared memory (bytes) of every Mosaic GPU kernel lowered inside the
    block, as the lowering sizes it (a kernel over the limit is refused after its size
    is collected).

    Wraps jax's (internal) Mosaic GPU shared-memory sizing; raises RuntimeError if this
    jax has no such function.
    """
    try:
        from jax.experimental.mosaic.gpu import core as mosaic_core
    except ImportError as e:
        raise RuntimeError(f"jax {jax.__version__} has no Mosaic GPU: {e}") from e
    original = getattr(mosaic_core, "_smem_tree_size", None)
    if original is None:
        raise RuntimeError(f"jax {jax.__version__}: Mosaic GPU shared-memory sizing moved")
    sizes: list[int] = []

    @functools.wraps(original)
    def capturing(tree):
        size = original(tree)
        sizes.append(int(size))
        return size

    mosaic_core._smem_tree_size = capturing
    try:
        yield sizes
    finally:
        mosaic_core._smem_tree_size = original
