"""One spec per array: the parameter tree and the paged KV cache, described once.

Every weight is declared by the `flax.nnx` module that uses it (`arcjax.model.layers`)
with its shape, initializer and logical axes (`layers`, `embed`, `heads`, `kv_heads`,
`mlp`, `vocab`, `expert`, `moe_mlp`, ...); `param_specs` reads them into a tree of
`ParamSpec`s shaped like the params. The cache is declared here (`cache_specs`).
Initialization, loading, export and cache allocation all derive from these trees; a mesh
that maps logical axes to devices derives shardings from them too, so no shape is
written twice. Expert weights are stacked `[L, E, ...]`: their `expert` axis is what
expert parallelism splits, `moe_mlp` (each expert's width) what tensor parallelism does.

Params layout: layer weights are stacked on a leading `layers` axis so the layer loop is
a `lax.scan` (compile time flat in depth). Linear weights are stored `[in, out]`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from arcjax.model.model_config import ModelConfig

Params = dict  # {"embed", "layers": {...stacked [L, ...]}, "final_norm", "lm_head"?}
# {"k": [L * num_blocks, block_size, Hkv, D], "v": same, FP8: "k_scale": [L], ...}; latent
# attention: "k" [L * num_blocks, block_size, 1, kv_lora_rank], "v" [..., 1, qk_rope_head_dim]
Cache = dict
CACHE_AXES = ("pages", None, "kv_heads", None)  # logical axes of a cache array
# latent attention's pages: one latent (and rope key) per token shared by every head, so
# never split by head (every device holds them whole under tensor parallelism)
LATENT_CACHE_AXES = ("pages", None, None, None)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One array: its shape, how it is initialized, and the logical name of each axis."""

    shape: tuple[int, ...]
    init: str  # "normal" | "ones" | "zeros"
    axes: tuple[str | None, ...]  # logical axis per dimension (None: never sharded)

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"ParamSpec: {len(self.axes)} axes for shape {self.shape}")


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree as specs (same structure as the params), read from the decoder's
    modules, where each parameter is declared (`arcjax.model.binding.declarations`)."""
    from arcjax.model import binding  # flax: imported where a model is built

    specs: dict = {}
    for d in binding.declarations(cfg):
        *parents, name = d.key
        node = specs
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = ParamSpec(d.shape, d.init, d.axes)
    return specs


def cache_specs(cfg: ModelConfig, num_blocks: int, block_size: int, *,
                scaled: bool = False, num_slots: int | None = None) -> Cache:
    """The paged KV cache as specs; `scaled` (FP8 pages) adds one K and one V scale per
    layer (`k_scale`, `v_scale` [L], replicated). `num_slots`: the layers' pages a block
    holds (`arcjax.model.kv_layout.KVLayout.num_slots`); None = every layer.

    NOTE: slots are flattened into the block axis: slot p's block b is page
    `p * num_blocks + b` (with one table for every layer, slot p is layer p). The layer
    loop then carries the whole cache and addresses a layer by offsetting block tables
    and slots, so K/V writes are in-place scatters into the donated buffer and no layer
    slice is ever copied.

    NOTE: a latent attention model (DeepSeek's MLA, `ModelConfig.is_mla`) caches one
    latent and one rope key per token and layer, shared by every head: its "k" pages hold
    the latents (one "head" of kv_lora_rank) and its "v" pages the rope keys (one of
    qk_rope_head_dim). They are pages like any other (blocks, slots, the host tier, prefix
    caching); only attention reads them differently (`arcjax.model.mla_layers`). Their
    axes (`LATENT_CACHE_AXES`) name no head: a mesh holds them whole on every device.
    """
    slots = cfg.num_layers if num_slots is None else num_slots
    pages = (slots * num_blocks, block_size)
    k_shape, v_shape = page_shapes(cfg, block_size)
    axes = LATENT_CACHE_AXES if cfg.is_mla else CACHE_AXES
    specs = {"k": ParamSpec(pages + k_shape[1:], "zeros", axes),
             "v": ParamSpec(pages + v_shape[1:], "zeros", axes)}
    if not scaled:
        return specs
    scale = ParamSpec((cfg.num_layers,), "ones", (None,))
    return {**specs, "k_scale": scale, "v_scale": scale}


def page_shapes(cfg: ModelConfig, block_size: int) -> tuple[tuple[int, ...], ...]:
    """The shape of one page of "k" and of "v", (block_size, heads, width) each (every
    device's heads): per-head keys and values, or latent attention's latent and rope key
    (see `cache_specs`'s NOTE)."""
    if cfg.mla is not None:
        return (block_size, 1, cfg.mla.kv_lora_rank), (block_size, 1, cfg.mla.qk_rope_head_dim)
    page = (block_size, cfg.num_kv_heads, cfg.head_dim)
    return page, page


def is_scaled(dtype) -> bool:
    """Whether pages of `dtype` are stored scaled (8-bit floats: float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32,
                std: float | None = None) -> Params:
    """Random params: each array drawn by its declared initializer (normal(0, std) weights,
    std None: `layers.NORMAL_STD`; unit norms, zero biases), one key per array in the specs'
    order."""
    from arcjax.model import layers  # flax: imported where a model is built

    std = layers.NORMAL_STD if std is None else std
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [
        layers.initializer(spec.init, std)(k, spec.shape, jnp.float32).astype(dtype)
        for spec, k in zip(leaves, keys)])


def make_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32,
               kv_scales=None, num_slots: int | None = None) -> Cache:
    """A zeroed paged KV cache for every layer (see `cache_specs`). FP8 pages get their
    per-layer scales: `kv_scales` [2, L] (K, V; from the checkpoint), else 1.0."""
    specs = cache_specs(cfg, num_blocks, block_size, scaled=is_scaled(dtype),
                        num_slots=num_slots)
    cache = {k: jnp.zeros(specs[k].shape, dtype) for k in ("k", "v")}
    if "k_scale" in specs:
        scales = (jnp.ones((2, cfg.num_layers), jnp.float32) if kv_scales is None
                  else jnp.asarray(kv_scales, jnp.float32).reshape(2, cfg.num_layers))
        cache |= {"k_scale": scales[0], "v_scale": scales[1]}
    return cache
