"""Public entry points: the documented signature, the dispatch of one `AttentionInputs` to
an implementation, and which implementation a call runs ("auto" resolved)."""

import importlib.util

import jax
import jax.numpy as jnp

from pallas_kernels import backends, cpu_attention, cpu_build
from pallas_kernels import gpu_plan as gpu_plan_lib
from pallas_kernels import pallas_gpu
from pallas_kernels import plan as plan_lib
from pallas_kernels import verified
from pallas_kernels.attention_inputs import OPTIONS, AttentionInputs
from pallas_kernels.kernel_errors import require
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.xla import ragged_paged_attention_xla

IMPLS = ("auto", "reference", "xla", "cpu", "pallas_gpu", "triton", "mosaic_gpu")
GPU_IMPLS = ("pallas_gpu", "triton", "mosaic_gpu")  # need the GPU tiling constraints
# Query tokens per tile and keys per online-softmax step on the xla path. Measured on the
# 2-core CPU (one layer of SmolLM2's geometry, 9 query / 3 KV heads of 64, in a 2048-token
# bucket; ms, 128 x 512 -> 256 x 128): 14 prompts of 80-200 tokens 40.3 -> 20.1, four of
# 512 34.2 -> 22.3, one of 2048 65.5 -> 52.7, two 512-token chunks after 1024 cached keys
# beside 8 decodes 46.5 -> 37.0. Fewer, wider tiles cost less loop overhead; shorter key
# steps waste less past each tile's causal frontier (docs/design/cpu-step-profile.md).
XLA_BLOCK_Q = 256
XLA_BLOCK_K = 128
# Decode-only batches (max_q_len == 1) step through keys in smaller blocks: every tile
# walks to the batch's furthest key, so a smaller block wastes less past each row's
# kv_len (64 decodes, kv 16-768, one CPU core: 8.6 ms with 512, 6.9 ms with 128).
XLA_DECODE_BLOCK_K = 128
# Batch-invariant calls (`AttentionInputs.batch_invariant`): every tile INVARIANT_BLOCK_Q rows
# wide (a decode row too) and keys walked INVARIANT_BLOCK_K at a time from absolute position
# 0 in every bucket, so a row's scores and sums are computed in one order whatever shares
# its tile, its chunk or its step.
INVARIANT_BLOCK_Q = 8
INVARIANT_BLOCK_K = 128
# The implementations with a batch-invariant mode ("auto" means "cpu" in it where that
# kernel runs, else "xla"; "cpu" is invariant by construction; the GPU kernels' mode is
# `gpu_plan.make_gpu_plan(batch_invariant=True)`).
INVARIANT_IMPLS = ("auto", "xla", "cpu", "pallas_gpu", "triton")


def _check_impl(impl: str) -> None:
    require(impl in IMPLS, "impl", f"unknown implementation {impl!r}; expected one of {IMPLS}")


# Options the Pallas GPU kernel implements (k/v scales: FP8 pages; windows; soft-caps; sinks).
PALLAS_GPU_OPTIONS = ("k_scale", "v_scale", "sliding_window", "logit_softcap", "sinks")


def _is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda")


def _gpu_can_tile(head_dim: int, block_size: int) -> bool:
    return (plan_lib.is_pow2(head_dim) and head_dim >= gpu_plan_lib.MIN_DOT
            and plan_lib.is_pow2(block_size))


def _validate_gpu_shapes(inputs: AttentionInputs, impl: str):
    d, page_size = inputs.head_dim, inputs.block_size
    require(plan_lib.is_pow2(d) and d >= gpu_plan_lib.MIN_DOT, "q",
            f'impl="{impl}" needs a power-of-two head dim >= 16, got {d}')
    require(plan_lib.is_pow2(page_size), "k_pages",
            f'impl="{impl}" needs a power-of-two block_size, got {page_size}')


def resolve_impl(impl: str, **shapes) -> str:
    """The implementation a call with these shapes runs: `impl` itself, or what "auto"
    picks (`choose_impl(impl, **shapes).impl`)."""
    _check_impl(impl)
    return impl if impl != "auto" else choose_impl(impl, **shapes).impl


def cpu_kernel_unavailable(*, head_dim: int, block_size: int, num_heads: int,
                           num_kv_heads: int, kv_dtype, platform: str | None = None) -> str | None:
    """Why the compiled CPU kernel ("cpu") cannot run a call of these shapes on `platform`
    (None: the default backend), or None if it can (building it on first use)."""
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return f'impl="cpu" runs on the CPU, and this runs on {platform}'
    reason = cpu_attention.unsupported(head_dim=head_dim, block_size=block_size,
                                       num_heads=num_heads, num_kv_heads=num_kv_heads,
                                       kv_dtype=kv_dtype)
    if reason is not None:
        return f'impl="cpu" does not take {reason}'
    return cpu_build.kernels_unavailable()


def choose_impl(impl: str, *, head_dim: int, block_size: int, max_q_len: int | None,
                plain: bool = True, dtype=jnp.bfloat16, kv_dtype=None, num_heads: int = 1,
                num_kv_heads: int = 1, pallas_gpu_ok: bool | None = None,
                platform: str | None = None,
                options: frozenset[str] | None = None,
                batch_invariant: bool = False) -> backends.Choice:
    """The implementation a call with these shapes runs, `impl` itself or what "auto"
    picks on this machine's default backend (see `backends.choose`), and whether a
    recorded GPU pass vouches for it (`pallas_kernels.verified`).

    Args:
        impl: one of `IMPLS`.
        head_dim, block_size: D and the cache's page size.
        max_q_len: the static chunk bound (1: a decode-only batch); None if unknown.
        plain: no sliding_window, logit_softcap, k/v scales or sinks (the kernels that
            lack them are picked only for plain calls).
        dtype, kv_dtype, num_heads, num_kv_heads: q's and the pages' dtypes (kv_dtype
            defaults to dtype), Hq and Hkv: what the Mosaic GPU kernel takes.
        pallas_gpu_ok: the Pallas GPU kernel implements every option of the call (None:
            only when `plain`).
        platform: where the call runs ("cpu", "gpu", "cuda", ...); None = the default
            backend.
        options: the names of the options the call gives (the shape class's flags); None:
            none when `plain`, else unknown (no record vouches for an unknown class).
        batch_invariant: the call's `AttentionInputs.batch_invariant`: "auto" then picks
            only an implementation whose invariant mode has run ("cpu", else "xla").
    """
    _check_impl(impl)
    kv_dtype = kv_dtype or dtype
    if options is None and plain:
        options = frozenset()
    shape = None if options is None else verified.ShapeClass(
        head_dim=head_dim, page_size=block_size, gqa=max(1, num_heads // num_kv_heads),
        window="sliding_window" in options, softcap="logit_softcap" in options,
        fp8=jnp.dtype(kv_dtype).itemsize == 1, sinks="sinks" in options)
    if impl != "auto":
        return backends.verification(impl, shape)
    on_gpu = _is_gpu(platform or jax.default_backend())
    cpu_ok = not on_gpu and cpu_kernel_unavailable(
        head_dim=head_dim, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, kv_dtype=kv_dtype, platform=platform) is None
    if batch_invariant:
        return backends.Choice(impl="cpu" if cpu_ok else "xla", verified=None,
                               shape_class=shape.key if shape else None)
    mosaic_ok = on_gpu and max_q_len == 1 and backends.mosaic_gpu_unsupported(
        head_dim=head_dim, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dtype=dtype, kv_dtype=kv_dtype) is None
    return backends.choose(on_gpu=on_gpu, can_tile=_gpu_can_tile(head_dim, block_size),
                           decode_only=mosaic_ok, plain=plain, pallas_gpu_ok=pallas_gpu_ok,
                           shape=shape, cpu_ok=cpu_ok)


def resolve_call(impl: str, q, k_pages, **call) -> str:
    """The implementation a call runs: `impl` itself, or what "auto" picks
    (`choose_call(impl, q, k_pages, **call).impl`)."""
    _check_impl(impl)
    return impl if impl != "auto" else choose_call(impl, q, k_pages, **call).impl


def choose_call(impl: str, q, k_pages, *, max_q_len: int | None = None,
                sliding_window=None, logit_softcap=None, k_scale=None, v_scale=None,
                sinks=None, platform: str | None = None) -> backends.Choice:
    """The implementation `ragged_paged_attention(q, k_pages, ..., impl=impl,
    max_q_len=max_q_len, <options>)` runs on `platform`, and whether a recorded GPU pass
    vouches for it: what a caller reports without tracing a call (the engine's trace
    summary, per bucket).

    Args:
        impl: one of `IMPLS`.
        q, k_pages: arrays or `jax.ShapeDtypeStruct`s ([T, Hq, D] and [num_blocks,
            block_size, Hkv, D]; only shapes and dtypes are read).
        max_q_len: as `ragged_paged_attention`'s (None: T).
        sliding_window, logit_softcap, k_scale, v_scale, sinks: only whether each is
            given (not None) matters.
        platform: where the call runs; None = the default backend.

    Returns:
        A `backends.Choice` whose impl is one of `IMPLS` other than "auto".
    """
    values = (sliding_window, logit_softcap, k_scale, v_scale, sinks)  # OPTIONS' order
    given = frozenset(name for name, value in zip(OPTIONS, values, strict=True)
                      if value is not None)
    t = q.shape[0]
    return _choose(impl, q, k_pages, max_q_len=t if max_q_len is None else min(max_q_len, t),
                   options=given, platform=platform)


def resolve_inputs(impl: str, inputs: AttentionInputs, *, platform: str | None = None) -> str:
    """The implementation `paged_attention(inputs, impl=impl)` runs on `platform`: `impl`
    itself, or what "auto" picks (`choose_inputs(impl, inputs, platform=platform).impl`)."""
    _check_impl(impl)
    return impl if impl != "auto" else choose_inputs(impl, inputs, platform=platform).impl


def choose_inputs(impl: str, inputs: AttentionInputs, *,
                  platform: str | None = None) -> backends.Choice:
    """The implementation `paged_attention(inputs, impl=impl)` runs on `platform` (None:
    the default backend), and whether a recorded GPU pass vouches for it; `inputs` may
    hold `jax.ShapeDtypeStruct`s (only shapes, dtypes, the settings and which options are
    given are read: the shape class is `inputs`' head dim, page size, GQA ratio, options
    and page dtype).

    Returns:
        A `backends.Choice` whose impl is one of `IMPLS` other than "auto".
    """
    return _choose(impl, inputs.q, inputs.k_pages, max_q_len=inputs.max_q_len,
                   options=inputs.options(), platform=platform,
                   batch_invariant=inputs.batch_invariant)


def _choose(impl: str, q, k_pages, *, max_q_len: int, options: frozenset[str],
            platform: str | None, batch_invariant: bool = False) -> backends.Choice:
    return choose_impl(impl, head_dim=q.shape[2], block_size=k_pages.shape[1],
                       max_q_len=max_q_len, plain=not options,
                       pallas_gpu_ok=options <= set(PALLAS_GPU_OPTIONS), dtype=q.dtype,
                       kv_dtype=k_pages.dtype, num_heads=q.shape[1],
                       num_kv_heads=k_pages.shape[2], platform=platform, options=options,
                       batch_invariant=batch_invariant)


def impl_unavailable(impl: str, *, interpret: bool = False,
                     platform: str | None = None) -> str | None:
    """Why `ragged_paged_attention(..., impl=impl, interpret=interpret)` cannot run here,
    or None if it can: a package or backend this installation lacks, an interpreter a
    kernel does not have, or (given `platform`) a GPU kernel asked off the GPU.

    Args:
        impl: one of `IMPLS`.
        interpret: run a GPU kernel on the CPU (its interpreter).
        platform: where the call runs ("cpu", "gpu", ...); None: not checked (lowering
            for CUDA on a CPU host, `lowering.lower_for_cuda`, needs no GPU).
    """
    _check_impl(impl)
    if impl == "cpu":
        if platform is not None and platform != "cpu":
            return f'impl="cpu" runs on the CPU, and this runs on {platform}'
        return cpu_build.kernels_unavailable()
    if impl not in GPU_IMPLS:
        return None
    if interpret:
        if impl == "mosaic_gpu":
            return ('impl="mosaic_gpu" has no interpret mode: Mosaic GPU kernels run only on '
                    "a GPU (scripts/gpu_check.sh checks them against the oracle there)")
        missing = [m for m in ("triton", "torch") if importlib.util.find_spec(m) is None]
        if impl == "triton" and missing:
            return (f'impl="triton" with interpret=True runs Triton\'s interpreter, which '
                    f"needs {' and '.join(missing)} (pip install 'arcjax[test]')")
        return None
    if platform is not None and not _is_gpu(platform):
        return (f'impl="{impl}" runs on an NVIDIA GPU, and this runs on {platform} '
                f'(ragged_paged_attention(..., interpret=True) runs it on the CPU; "auto" '
                f"picks xla here)")
    reason = {"pallas_gpu": lambda: (None if backends.pallas_triton_state() != "absent"
                                     else f"jax {jax.__version__} has no Pallas Triton backend"),
              "triton": backends.triton_unavailable,
              "mosaic_gpu": backends.mosaic_gpu_unavailable}[impl]()
    if reason is None:
        return None
    verb = "cannot launch" if impl == "triton" else "cannot be built"
    return f'impl="{impl}" {verb} here: {reason}'


def _cpu(inputs: AttentionInputs) -> jax.Array:
    reason = cpu_kernel_unavailable(
        head_dim=inputs.head_dim, block_size=inputs.block_size, num_heads=inputs.num_heads,
        num_kv_heads=inputs.num_kv_heads, kv_dtype=inputs.k_pages.dtype, platform="cpu")
    require(reason is None, "impl", reason)
    return cpu_attention.ragged_paged_attention_cpu(inputs)


def _pallas_gpu(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan, interpret: bool):
    return pallas_gpu.ragged_paged_attention_pallas_gpu(inputs, plan, interpret=interpret)


def _triton(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan, interpret: bool):
    reason = impl_unavailable("triton", interpret=interpret)
    require(reason is None, "interpret" if interpret else "impl", reason)
    from pallas_kernels import triton_gpu

    return triton_gpu.ragged_paged_attention_triton(inputs, plan, interpret=interpret)


def _mosaic_gpu(inputs: AttentionInputs, plan: gpu_plan_lib.GpuPlan, interpret: bool):
    reason = impl_unavailable("mosaic_gpu", interpret=interpret)
    require(not interpret, "interpret", reason)
    require(inputs.max_q_len == 1, "max_q_len",
            f'impl="mosaic_gpu" serves decode-only batches (max_q_len=1), got {inputs.max_q_len}')
    require(not inputs.options(), "impl",
            'impl="mosaic_gpu" does not support sliding_window, '
            'logit_softcap, k_scale/v_scale or sinks; use impl="triton"')
    require(reason is None, "impl", reason)
    q, k_pages = inputs.q, inputs.k_pages
    reason = backends.mosaic_gpu_unsupported(
        head_dim=inputs.head_dim, block_size=inputs.block_size, num_heads=inputs.num_heads,
        num_kv_heads=inputs.num_kv_heads, dtype=q.dtype, kv_dtype=k_pages.dtype)
    require(reason is None, "q", f'impl="mosaic_gpu": {reason}')
    from pallas_kernels import mosaic_gpu

    return mosaic_gpu.ragged_paged_attention_mosaic_gpu(inputs, plan)


def gpu_plan_for(inputs: AttentionInputs, **tuning) -> gpu_plan_lib.GpuPlan:
    """The GPU kernels' launch plan for `inputs`' shapes (`gpu_plan.make_gpu_plan`;
    `tuning`: its overrides, e.g. block_m, num_splits)."""
    return gpu_plan_lib.make_gpu_plan(
        num_tokens=inputs.num_tokens, num_seqs=inputs.seq_bucket, num_heads=inputs.num_heads,
        num_kv_heads=inputs.num_kv_heads, head_dim=inputs.head_dim,
        page_size=inputs.block_size, max_blocks=inputs.max_blocks, max_q_len=inputs.max_q_len,
        itemsize=inputs.q.dtype.itemsize, **tuning)


_GPU_LAUNCH = {"pallas_gpu": _pallas_gpu, "triton": _triton, "mosaic_gpu": _mosaic_gpu}


def paged_attention(inputs: AttentionInputs, *, impl: str = "auto",
                    interpret: bool = False) -> jax.Array:  # [T, Hq, D]
    """Ragged paged attention of `inputs` (from `AttentionInputs.create`), by `impl`.

    The one dispatch: `ragged_paged_attention` builds its inputs and calls this; the
    decoder calls it with each layer's inputs.

    Args:
        inputs: the call (arrays, options, static settings).
        impl: one of `IMPLS` (see `ragged_paged_attention`). Static.
        interpret: run a GPU kernel on the CPU (see `ragged_paged_attention`). Static.

    Returns:
        The attention output `[T, Hq, D]` in q's dtype.
    """
    if inputs.batch_invariant:
        require(impl in INVARIANT_IMPLS, "impl",
                f"batch_invariant is built for {INVARIANT_IMPLS} (\"auto\" runs cpu, "
                f"else xla), got {impl!r}")
        impl = resolve_inputs(impl, inputs)
        if impl == "cpu":
            return _cpu(inputs)
        if impl in GPU_IMPLS:
            _validate_gpu_shapes(inputs, impl)
            plan = gpu_plan_for(inputs, batch_invariant=True)
            return _GPU_LAUNCH[impl](inputs, plan, interpret)
        tiles = plan_lib.make_plan(
            num_tokens=inputs.num_tokens, num_seqs=inputs.seq_bucket,
            page_size=inputs.block_size, max_blocks=inputs.max_blocks,
            max_q_len=inputs.max_q_len, block_q=INVARIANT_BLOCK_Q, block_k=INVARIANT_BLOCK_K,
            one_width=True)
        return ragged_paged_attention_xla(inputs, tiles)
    impl = resolve_inputs(impl, inputs)
    if impl == "reference":
        return ragged_paged_attention_reference(inputs)
    if impl == "cpu":
        return _cpu(inputs)
    if impl in GPU_IMPLS:
        _validate_gpu_shapes(inputs, impl)
        return _GPU_LAUNCH[impl](inputs, gpu_plan_for(inputs), interpret)
    tiles = plan_lib.make_plan(
        num_tokens=inputs.num_tokens, num_seqs=inputs.seq_bucket, page_size=inputs.block_size,
        max_blocks=inputs.max_blocks, max_q_len=inputs.max_q_len, block_q=XLA_BLOCK_Q,
        block_k=XLA_DECODE_BLOCK_K if inputs.max_q_len == 1 else XLA_BLOCK_K)
    return ragged_paged_attention_xla(inputs, tiles)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
    block_tables: jax.Array,  # [S, max_blocks] int32
    kv_lens: jax.Array,  # [S] int32
    cu_seqlens_q: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array | int,  # scalar int32, traced
    *,
    sm_scale: float | None = None,
    sliding_window: jax.Array | int | None = None,
    logit_softcap: float | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # [Hq]
    impl: str = "auto",
    interpret: bool = False,
    max_q_len: int | None = None,
) -> jax.Array:  # [T, Hq, D]
    """Causal attention of a flat ragged batch of query chunks over a paged KV cache.

    Sequence `s < num_seqs` owns query rows `cu_seqlens_q[s] : cu_seqlens_q[s+1]`;
    row `i` of a chunk of `q_len` rows sits at absolute position
    `kv_lens[s] - q_len + i` and attends keys `0 ..` that position (bottom-right
    causal). Query head `h` reads KV head `h // (Hq // Hkv)`. Rows at and past
    `cu_seqlens_q[num_seqs]` are padding and come out as exact zeros. Page
    contents beyond `kv_lens` (even NaN) never reach the output.

    Args:
        q, k_pages, v_pages, block_tables, kv_lens, cu_seqlens_q: see the shapes.
        num_seqs: how many of the S sequence rows are real; traced, so it never
            causes a recompile.
        sm_scale: softmax scale; defaults to `D ** -0.5`.
        sliding_window: None (full causal), or an integer scalar >= 1, traced or not
            (one executable serves every layer): a row at absolute position p sees
            keys `p - sliding_window < k <= p`.
        logit_softcap: None, or a positive float (static): scores after `sm_scale`
            become `cap * tanh(s / cap)` before masking.
        k_scale, v_scale: None, or float32 scalars (traced or not): the pages hold
            `value / scale` (e.g. float8_e4m3fn pages); attention reads
            `float32(page) * scale`.
        sinks: None, or `[Hq]` floats (traced): each query head's sink logit, one more
            term of every softmax denominator that attends to nothing (gpt-oss); a raw
            logit (not scaled by sm_scale, not soft-capped).
        impl: "reference" (host-side oracle, not for jit), "xla", "cpu" (the
            compiled CPU kernel, `cpu_attention`), "pallas_gpu" (Pallas-Triton),
            "triton" (a Triton kernel through jax_triton), "mosaic_gpu" (decode-only
            batches), or "auto" (`resolve_impl`: a GPU kernel this installation offers
            on a GPU when D and block_size are powers of two, "cpu" on the CPU where it
            builds, xla otherwise). Static.
        interpret: run a GPU kernel on the CPU: Pallas interpret mode for
            "pallas_gpu", Triton's interpreter for "triton" (needs triton and
            torch); "mosaic_gpu" has none. Static.
        max_q_len: static upper bound on any sequence's query length (e.g. the
            token bucket's largest chunk). Defaults to T. Smaller bounds shrink the
            xla path's work; a chunk longer than it gives undefined results.

    Returns:
        The attention output `[T, Hq, D]` in q's dtype.
    """
    _check_impl(impl)
    inputs = AttentionInputs.create(
        q=q, k_pages=k_pages, v_pages=v_pages, block_tables=block_tables, kv_lens=kv_lens,
        cu_seqlens_q=cu_seqlens_q, num_seqs=num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap, k_scale=k_scale,
        v_scale=v_scale, sinks=sinks, max_q_len=max_q_len)
    return paged_attention(inputs, impl=impl, interpret=interpret)
