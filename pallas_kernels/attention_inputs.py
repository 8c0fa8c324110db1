"""The inputs of one ragged paged attention call, as one pytree every implementation takes.

`AttentionInputs` holds the arrays (the flat ragged queries, one layer's pages, the batch's
block tables and lengths, and the traced options: the layer's sliding window, the FP8
pages' k/v scales) as pytree leaves, and the static settings (softmax scale, soft-cap,
the chunk bound) as pytree metadata, so it crosses `jax.jit`, `lax.scan` and `shard_map`
whole and a change of a static setting is a new executable, never a silent retrace.

`AttentionInputs.create` is the one validation: it names the offending field in a
`KernelArgumentError`, fills the defaults (`sm_scale = D ** -0.5`, `max_q_len = T`) and
normalizes dtypes (int32 indices and window, float32 scales). It reads only shapes and
dtypes, so it also describes a call without arrays (`jax.ShapeDtypeStruct` fields: what
"auto" resolves, what a tool lowers for CUDA).

The options past plain causal attention:

- `sliding_window` (int32 scalar, may be traced: one value per layer inside the
  decoder's scan): a query at absolute position p sees keys in `(p - window, p]`.
- `logit_softcap` (static float): scores after `sm_scale` become
  `cap * tanh(s / cap)` before masking (Gemma 2).
- `k_scale`, `v_scale` (float32 scalars, may be traced): the pages hold
  `value / scale` (e.g. float8_e4m3fn); attention reads `float32(page) * scale`.
- `sinks` (float32 `[Hq]`, traced: one row per layer inside the decoder's scan): a
  learned logit per query head that joins every softmax denominator (gpt-oss) and
  attends to nothing: row weights are `exp(s_k) / (sum_j exp(s_j) + exp(sink))`. The
  sink is a raw logit (neither scaled by `sm_scale` nor soft-capped); with a window it
  joins the windowed softmax.

Its methods `in_window`, `visible`, `softcap`, `dequantize` and `normalize` are the only
places these semantics are written for the jnp paths; kernels that need the raw values
read the fields.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kernel_errors import KernelArgumentError, require

# The options past plain causal attention (None: not used by the call).
OPTIONS = ("sliding_window", "logit_softcap", "k_scale", "v_scale", "sinks")


def _static():
    return dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AttentionInputs:
    """One ragged paged attention call. Build it with `create` (it validates).

    Sequence `s < num_seqs` owns query rows `cu_seqlens_q[s] : cu_seqlens_q[s+1]`; row `i`
    of a chunk of `q_len` rows sits at absolute position `kv_lens[s] - q_len + i` and
    attends keys `0 ..` that position (bottom-right causal). Query head `h` reads KV head
    `h // (Hq // Hkv)`. Rows at and past `cu_seqlens_q[num_seqs]` are padding.
    """

    q: jax.Array  # [T, Hq, D]
    k_pages: jax.Array  # [num_blocks, block_size, Hkv, D]
    v_pages: jax.Array  # [num_blocks, block_size, Hkv, D]
    block_tables: jax.Array  # [S, max_blocks] int32
    kv_lens: jax.Array  # [S] int32, keys per sequence, this step's included
    cu_seqlens_q: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # [] int32, real sequences (traced: never a recompile)
    sliding_window: jax.Array | None = None  # [] int32
    k_scale: jax.Array | None = None  # [] float32
    v_scale: jax.Array | None = None  # [] float32
    sinks: jax.Array | None = None  # [Hq] float32
    sm_scale: float = _static()
    max_q_len: int = _static()  # bound on any chunk's length, <= T (1: decode-only)
    logit_softcap: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Each row's arithmetic fixed by the row alone (its position, its keys), whatever the
    # bucket, the chunking or the other rows: see `pallas_kernels.api.paged_attention`.
    batch_invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        *,
        q: jax.Array,  # [T, Hq, D]
        k_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
        v_pages: jax.Array,  # [num_blocks, block_size, Hkv, D]
        block_tables: jax.Array,  # [S, max_blocks] integer
        kv_lens: jax.Array,  # [S] integer
        cu_seqlens_q: jax.Array,  # [S + 1] integer
        num_seqs: jax.Array | int,  # [] integer
        sm_scale: float | None = None,
        sliding_window: jax.Array | int | None = None,
        logit_softcap: float | None = None,
        k_scale: jax.Array | float | None = None,
        v_scale: jax.Array | float | None = None,
        sinks: jax.Array | None = None,  # [Hq]
        max_q_len: int | None = None,
        batch_invariant: bool = False,
    ) -> AttentionInputs:
        """Validates one call's inputs and returns them normalized.

        Args:
            q, k_pages, v_pages, block_tables, kv_lens, cu_seqlens_q, num_seqs: see the
                class; arrays, tracers or `jax.ShapeDtypeStruct`s.
            sm_scale: softmax scale (a positive Python number); defaults to `D ** -0.5`.
            sliding_window: None (full causal), or an integer scalar >= 1, traced or not.
            logit_softcap: None, or a positive Python float (static).
            k_scale, v_scale: None, or scalars (traced or not): the pages hold
                `value / scale`.
            sinks: None, or a floating `[Hq]` array (traced or not): each query head's
                sink logit.
            max_q_len: static upper bound on any chunk's length (a positive int;
                defaults to T, clipped to T). A chunk longer than it gives undefined results.
            batch_invariant: compute every row the same way whatever else the call holds
                (static; the xla path only).

        Raises:
            KernelArgumentError: naming the field with the wrong rank, shape, dtype or value.
        """
        _check_arrays(q, k_pages, v_pages, block_tables, kv_lens, cu_seqlens_q, num_seqs)
        _check_options(sliding_window, logit_softcap, k_scale, v_scale)
        t, hq, d = q.shape
        if sinks is not None:
            require(_shape(sinks) == (hq,), "sinks",
                    f"expected one logit per query head, shape ({hq},), got {_shape(sinks)}")
            require(jnp.issubdtype(_dtype(sinks), jnp.floating), "sinks",
                    f"expected a floating dtype, got {_dtype(sinks)}")
        if sm_scale is None:
            sm_scale = d**-0.5
        require(isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)
                and math.isfinite(sm_scale) and sm_scale > 0, "sm_scale",
                f"expected a positive Python float, got {sm_scale!r}")
        if max_q_len is None:
            max_q_len = t
        require(isinstance(max_q_len, int) and max_q_len >= 1, "max_q_len",
                f"expected a positive int, got {max_q_len!r}")
        require(isinstance(batch_invariant, bool), "batch_invariant",
                f"expected a bool, got {batch_invariant!r}")
        i32, f32 = jnp.int32, jnp.float32
        return cls(q=q, k_pages=k_pages, v_pages=v_pages,
                   block_tables=_cast(block_tables, i32), kv_lens=_cast(kv_lens, i32),
                   cu_seqlens_q=_cast(cu_seqlens_q, i32), num_seqs=_cast(num_seqs, i32),
                   sliding_window=_cast(sliding_window, i32), k_scale=_cast(k_scale, f32),
                   v_scale=_cast(v_scale, f32), sinks=_cast(sinks, f32),
                   sm_scale=float(sm_scale),
                   max_q_len=min(max_q_len, t),
                   logit_softcap=None if logit_softcap is None else float(logit_softcap),
                   batch_invariant=batch_invariant)

    # ---- shapes ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """T: query rows (the token bucket)."""
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def block_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def seq_bucket(self) -> int:
        """S: sequence rows of the tables (the sequence bucket)."""
        return self.block_tables.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def options(self) -> frozenset[str]:
        """The names of the options this call uses (`OPTIONS` that are not None)."""
        return frozenset(name for name in OPTIONS if getattr(self, name) is not None)

    # ---- the options' semantics (the jnp paths) -------------------------------------------
    def in_window(self, keys: jax.Array, positions: jax.Array) -> jax.Array:
        """Whether `keys` are not older than the window of a query at `positions`."""
        if self.sliding_window is None:
            return jnp.ones(jnp.broadcast_shapes(jnp.shape(keys), jnp.shape(positions)), bool)
        return keys > positions - self.sliding_window

    def visible(self, keys: jax.Array, positions: jax.Array) -> jax.Array:
        """Whether a query at `positions` may see `keys` (broadcasting): causal and windowed."""
        return (keys <= positions) & self.in_window(keys, positions)

    def softcap(self, scores: jax.Array) -> jax.Array:
        """Soft-capped scores (identity without a cap)."""
        if self.logit_softcap is None:
            return scores
        cap = jnp.float32(self.logit_softcap)
        return cap * jnp.tanh(scores / cap)

    def dequantize(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values as float32 values (scaled when the pages are quantized)."""
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        if self.k_scale is not None:
            k = k * self.k_scale
        if self.v_scale is not None:
            v = v * self.v_scale
        return k, v

    def normalize(self, acc: jax.Array, m: jax.Array, l: jax.Array,
                  sinks: jax.Array | None) -> jax.Array:
        """The softmax-weighted values of an online softmax's state, float32.

        Args:
            acc: [..., D] sum of `exp(s - m) * v`; m: [...] running max of the natural-log
                scores (-inf: no key yet); l: [...] sum of `exp(s - m)`.
            sinks: None, or [...] each row's sink logit (`self.sinks` laid out like m).

        Returns:
            [..., D] `acc / l`, with `exp(sink)` in the denominator when given; rows with
            neither keys nor a sink are 0.
        """
        if sinks is None:
            return acc / jnp.where(l > 0, l, 1)[..., None]
        top = jnp.maximum(m, sinks)  # finite: sinks are
        rescale = jnp.exp(m - top)  # 0 for a row without keys
        den = l * rescale + jnp.exp(sinks - top)
        return acc * (rescale / den)[..., None]


def _shape(x) -> tuple[int, ...]:
    """The shape of an array, tracer, ShapeDtypeStruct or Python scalar."""
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def _cast(x, dtype):
    """`x` as `dtype` (None stays None; an array-like of that dtype, a ShapeDtypeStruct
    included, is returned as it is)."""
    if x is None or (hasattr(x, "shape") and _dtype(x) == dtype):
        return x
    return jnp.asarray(x, dtype)


def _check_arrays(q, k_pages, v_pages, block_tables, kv_lens, cu_seqlens_q, num_seqs) -> None:
    q_shape, k_shape = _shape(q), _shape(k_pages)
    require(len(q_shape) == 3, "q", f"expected rank 3 [T, Hq, D], got shape {q_shape}")
    require(len(k_shape) == 4, "k_pages",
            f"expected rank 4 [num_blocks, block_size, Hkv, D], got shape {k_shape}")
    require(_shape(v_pages) == k_shape, "v_pages",
            f"shape {_shape(v_pages)} differs from k_pages {k_shape}")
    _, hq, d = q_shape
    hkv = k_shape[2]
    require(k_shape[3] == d, "k_pages", f"head dim {k_shape[3]} differs from q's {d}")
    require(hq % hkv == 0, "k_pages",
            f"query heads Hq={hq} are not a multiple of KV heads Hkv={hkv}")
    tables_shape = _shape(block_tables)
    require(len(tables_shape) == 2, "block_tables",
            f"expected rank 2 [S, max_blocks], got shape {tables_shape}")
    s = tables_shape[0]
    require(_shape(kv_lens) == (s,), "kv_lens", f"expected shape ({s},), got {_shape(kv_lens)}")
    require(_shape(cu_seqlens_q) == (s + 1,), "cu_seqlens_q",
            f"expected shape ({s + 1},), got {_shape(cu_seqlens_q)}")
    require(_shape(num_seqs) == (), "num_seqs",
            f"expected a scalar, got shape {_shape(num_seqs)}")
    for name, x in (("block_tables", block_tables), ("kv_lens", kv_lens),
                    ("cu_seqlens_q", cu_seqlens_q)):
        require(jnp.issubdtype(_dtype(x), jnp.integer), name,
                f"expected an integer dtype, got {_dtype(x)}")


def _check_options(sliding_window, logit_softcap, k_scale, v_scale) -> None:
    if sliding_window is not None:
        require(_shape(sliding_window) == (), "sliding_window",
                f"expected a scalar, got shape {_shape(sliding_window)}")
        require(jnp.issubdtype(_dtype(sliding_window), jnp.integer),
                "sliding_window", f"expected an integer, got {sliding_window!r}")
        if isinstance(sliding_window, int):
            require(sliding_window >= 1, "sliding_window",
                    f"expected a window of at least 1 key, got {sliding_window}")
    if logit_softcap is not None:
        require(isinstance(logit_softcap, (int, float)) and logit_softcap > 0,
                "logit_softcap", f"expected a positive Python float, got {logit_softcap!r}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            require(_shape(scale) == (), name, f"expected a scalar, got shape {_shape(scale)}")
