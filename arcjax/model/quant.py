"""Quantized weights: FP8 (e4m3) or INT8 values on the device, scales beside them.

A quantized linear weight is a `QuantizedWeight`: `values [..., in, out]` (float8_e4m3fn
or int8) and `scale [..., ceil(in / bi), ceil(out / bo)]` float32, one scale per block of
`block = (bi, bo)` rows and columns; `w = values * scale` (broadcast over each block).
The three layouts FP8 checkpoints use are all blocks:

- per tensor: block (in, out), scale [1, 1];
- per output channel: block (in, 1), scale [1, out];
- 128 x 128 blocks (DeepSeek-V3, Qwen3-FP8): block (128, 128).

It is a pytree (values and scale are leaves, `block` is static), so layer stacks scan,
shard and donate like any array. The decoder calls `dense(w, dtype)` for every linear
weight: a plain array is cast, a quantized one is dequantized there, inside the jitted
step (XLA fuses the scale multiply into the matmul's operand); nothing is dequantized on
the host. The stacked expert weights of a mixture of experts ([L, E, in, out], one scale
per expert and output channel) are read by (layer, expert) through `dense_at`, inside the
grouped GEMMs. Embeddings, norms, biases, routers and the LM head stay in the compute
dtype (as FP8 checkpoints on the Hub keep them).

Packed low-bit weights (`arcjax.model.packed.PackedWeight`: GGUF's quant types, AWQ, GPTQ,
compressed-tensors W4A16; `arcjax.model.mxfp4_weight.Mxfp4Weight`: gpt-oss's MXFP4
experts, both `PACKED`) go through the same three functions (`dense`, `dense_at`, the
specs); a GGUF file's embedding and LM head stay packed too (`embedding_rows` gathers
the step's token rows, `tied_head` is the tied LM head).

`quantize(w, "fp8" | "int8")` quantizes a float weight (symmetric): int8 per output
channel (scale = max|w| / 127); fp8 per output channel and block of 32 input rows, each
block's scale searched for the least rounding error (see `quantize`): what
`quantization=` applies at load.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from arcjax.model.layer_arrays import LayerArrays
from arcjax.model.mxfp4_weight import Mxfp4Weight
from arcjax.model.packed import PackedWeight

FP8 = jnp.float8_e4m3fn
FORMATS = {"fp8": (FP8, 448.0), "int8": (jnp.int8, 127.0)}  # format -> (dtype, max |q|)
FP8_BLOCK_ROWS = 32  # input rows per FP8 weight scale (and one scale per output channel)
SCALE_CANDIDATES = 32  # FP8 block scales tried, spread over one octave
# Layer weights that may be stored quantized (the linear projections): attention, the dense
# MLP, the stacked experts [L, E, in, out] and Qwen2-MoE's shared expert. A model has a
# subset of them (a mixture of experts has no w_gate).
PACKED = (PackedWeight, Mxfp4Weight)  # the packed kinds: one protocol (map_arrays, leaf_axes)
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                  "we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down",
                  "wq_a", "wq_b", "wkv_a", "wkv_b")  # the last four: latent attention's


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale"],
                   meta_fields=["block"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight stored quantized (see the module docstring)."""

    values: jax.Array  # [..., in, out] float8_e4m3fn | int8
    scale: jax.Array  # [..., ceil(in / bi), ceil(out / bo)] float32
    block: tuple[int, int]  # (bi, bo): rows x columns one scale covers

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def dequantize(self, dtype) -> jax.Array:
        """values * scale, in `dtype` (float32 math). [..., in, out]"""
        n_in, n_out = self.values.shape[-2:]
        scale = self.scale.astype(jnp.float32)
        if scale.shape[-2] > 1:
            scale = jnp.repeat(scale, self.block[0], axis=-2)[..., :n_in, :]
        if scale.shape[-1] > 1:
            scale = jnp.repeat(scale, self.block[1], axis=-1)[..., :n_out]
        return (self.values.astype(jnp.float32) * scale).astype(dtype)


def dense(w, dtype) -> jax.Array:
    """A linear weight in `dtype`: cast, or dequantized when stored quantized or packed."""
    if isinstance(w, (QuantizedWeight, *PACKED)):
        return w.dequantize(dtype)
    return w.astype(dtype)


def dense_at(w, index: tuple, dtype) -> jax.Array:
    """`w[index]` in `dtype`: one (layer, expert)'s matrix, or one layer's [E, in, out],
    of a stacked weight; a quantized or packed one indexes all its arrays alike (they
    share the values' leading axes) and is dequantized here."""
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(w.values[index], w.scale[index], w.block).dequantize(dtype)
    if isinstance(w, PACKED):
        return w.map_arrays(lambda x: x[index]).dequantize(dtype)
    return w[index].astype(dtype)


def embedding_rows(embed, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` [...] of the embedding table in `dtype`: [..., H]. A packed table
    (stored transposed, [H, V]) unpacks only those tokens' columns."""
    if isinstance(embed, PackedWeight):
        return embed.columns(ids.reshape(-1), dtype).T.reshape(*ids.shape, -1)
    return embed[ids].astype(dtype)


def tied_head(embed):
    """The tied LM head's weight [H, V]: the embedding table transposed (a packed table is
    stored that way, and stays packed: `dense` or the W4A16 kernel reads it)."""
    if isinstance(embed, PackedWeight):
        return embed
    return embed.T


def float_dtype(w, dtype):
    """The float dtype `w` holds its values in: its own, or `dtype` (the compute dtype it
    is dequantized into) for a packed weight."""
    return dtype if isinstance(w, PackedWeight) else w.dtype


def scale_axes(w: QuantizedWeight, axes: tuple) -> tuple:
    """The logical axes of `w.scale` given the values' `axes`: the leading (layer, expert)
    axes alike; scales one column wide (per channel, or per channel and block of rows)
    follow the output axis; per-tensor and wider block scales are not split within a
    matrix, nor along the input axis."""
    per_column = w.block[1] == 1
    return (*axes[:-2], None, axes[-1] if per_column else None)


def weight_axes(w, axes: tuple, degree=None):
    """The logical axes of a weight's arrays given its logical `axes`: `axes` itself for
    a plain array, a tree like `w` for a quantized or packed one (`degree(axis)`: devices
    an axis splits over, which decides whether a packed weight's rows split)."""
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(axes, scale_axes(w, axes), w.block)
    if isinstance(w, PACKED):
        return w.leaf_axes(axes, degree)
    return axes


def quantize(w: jax.Array, fmt: str) -> QuantizedWeight:
    """Symmetric quantization of `w [..., in, out]`: "int8" per output channel (scale
    max|w| / 127); "fp8" (e4m3) per output channel and block of FP8_BLOCK_ROWS input rows,
    each block's scale the one of SCALE_CANDIDATES (max|w| / 448 times 2**(-i / n), one
    octave up: no value saturates) that minimizes the block's squared rounding error.

    NOTE: e4m3's relative rounding step is fixed (3 mantissa bits), so a scale only moves
    where a block's values fall between representable numbers; small blocks and a search
    over that alignment cut the error where per-channel max scaling cannot
    (SmolLM2-135M's perplexity: RESULTS.md, "Packed 4-bit weights").
    """
    if fmt == "int8":
        wf = w.astype(jnp.float32)
        amax = jnp.max(jnp.abs(wf), axis=-2, keepdims=True)  # [..., 1, out]
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        q = jnp.clip(jnp.round(wf / scale), -127.0, 127.0)
        return QuantizedWeight(q.astype(jnp.int8), scale, (w.shape[-2], 1))
    dtype, qmax = FORMATS[fmt]
    n_in, rows = w.shape[-2], FP8_BLOCK_ROWS
    blocks = -(-n_in // rows)
    wf = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (w.ndim - 2) + [(0, blocks * rows - n_in),
                                                                    (0, 0)])
    wb = wf.reshape(*w.shape[:-2], blocks, rows, w.shape[-1])  # [..., G, rows, out]
    amax = jnp.max(jnp.abs(wb), axis=-2, keepdims=True)  # [..., G, 1, out]
    base = jnp.where(amax > 0, amax / qmax, 1.0)

    def rounded(scale):
        return jnp.clip(wb / scale, -qmax, qmax).astype(dtype).astype(jnp.float32) * scale

    def search(i, best):  # best: (scale, squared error) per block
        scale = base * jnp.exp2(i.astype(jnp.float32) / SCALE_CANDIDATES)
        err = jnp.sum((rounded(scale) - wb) ** 2, axis=-2, keepdims=True)
        better = err < best[1]
        return jnp.where(better, scale, best[0]), jnp.where(better, err, best[1])

    first = jnp.sum((rounded(base) - wb) ** 2, axis=-2, keepdims=True)
    scale, _ = jax.lax.fori_loop(1, SCALE_CANDIDATES, search, (base, first))
    q = jnp.clip(wb / scale, -qmax, qmax).astype(dtype).reshape(wf.shape)[..., :n_in, :]
    return QuantizedWeight(q, scale[..., 0, :], (rows, 1))


def quantize_params(params: dict, fmt: str, shardings=None) -> dict:
    """`params` with every layer's linear weights quantized (`quantize`).

    One weight at a time, each dropped once quantized (peak: the float params plus one
    quantized weight). `shardings`: the quantized params' shardings (a tree like
    `quantized_specs` of them), or None for one device.
    """
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        w = layers.get(name)
        if w is None or isinstance(w, (QuantizedWeight, *PACKED)):
            continue
        out = None if shardings is None else shardings["layers"][name]
        layers[name] = jax.jit(quantize, static_argnums=1, out_shardings=out)(w, fmt)
        w.delete()
    return {**params, "layers": layers}


def quantized_specs(specs: dict, params: dict, degree=None) -> dict:
    """The spec tree of `params` where a weight is quantized or packed (in every layer
    stack): a tree like the weight with one spec per array, axes from `weight_axes` (values
    keep the weight's
    axes; scales per `scale_axes`; a packed weight's arrays per `PackedWeight.leaf_axes`
    under `degree`). A packed embedding is stored transposed ([H, V]): its axes too."""

    # NOTE: specs made from the weight's own (dataclasses.replace), so quant does not
    # import specs: specs reads the modules (layers), which import quant.
    def spec_of(w, spec, axes):
        tree = weight_axes(w, axes, degree)
        return jax.tree.map(lambda x, a: dataclasses.replace(
            spec, shape=tuple(x.shape), init="zeros", axes=tuple(a)), w, tree)

    out = dict(specs)
    for stack, tree in params.items():  # the layer stacks: "layers", DeepSeek's "dense_layers"
        if not isinstance(tree, dict):
            continue
        layers = out[stack] = dict(specs[stack])
        for name, w in tree.items():
            if isinstance(w, (QuantizedWeight, *PACKED)):
                layers[name] = spec_of(w, layers[name], layers[name].axes)
    for name in ("embed", "lm_head"):
        w = params.get(name)
        if isinstance(w, PackedWeight):
            axes = specs[name].axes[::-1] if name == "embed" else specs[name].axes
            out[name] = spec_of(w, specs[name], axes)
    return out


def weight_dtype(params: dict, name: str = "wo") -> str:
    """The storage dtype of layer weight `name` ("float8_e4m3fn", "int8", "bfloat16", or a
    packed format: "q4_1", "awq", "mxfp4", ...); by default the attention output
    projection's (every attention has one): the layer weights'."""
    w = params["layers"][name]
    if isinstance(w, LayerArrays):  # held one array per layer (the unrolled layer loop)
        w = w[0]
    return w.dtype if isinstance(w, PACKED) else str(jnp.dtype(w.dtype))


def storage_dtypes(params: dict, cache: dict) -> dict[str, str]:
    """What the trace summary and /v1/models report: the layer weights' and KV pages'
    storage dtypes, and for a mixture of experts its experts' (`expert_weight_dtype`:
    "mxfp4" for gpt-oss's MXFP4 experts kept packed, the compute dtype when they were
    decoded at load)."""
    out = {"weight_dtype": weight_dtype(params), "kv_cache_dtype": str(cache["k"].dtype)}
    if "we_up" in params["layers"]:
        out["expert_weight_dtype"] = weight_dtype(params, "we_up")
    return out


def param_bytes(params) -> int:
    """Bytes the params occupy (values and scales; all devices' shards counted once)."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
