"""One spec per array: the parameter tree and the paged KV cache, described once.

Every weight and the cache are declared here with shape, initializer and logical axes
(`layers`, `embed`, `heads`, `kv_heads`, `mlp`, `vocab`, `expert`, `moe_mlp`, ...).
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
Cache = dict  # {"k": [L * num_blocks, block_size, Hkv, D], "v": same, FP8: "k_scale": [L], ...}
CACHE_AXES = ("pages", None, "kv_heads", None)  # logical axes of a cache array


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
    """The parameter tree as specs (same structure as the params)."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def s(shape, init, *axes):
        return ParamSpec(tuple(shape), init, tuple(axes))

    # (1 + w) RMSNorms (Gemma) start at zero: every norm starts as the identity scale.
    norm = "zeros" if cfg.norm_unit_offset else "ones"
    layers = {
        "attn_norm": s((L, H), norm, "layers", "embed"),
        "wq": s((L, H, q_dim), "normal", "layers", "embed", "heads"),
        "wk": s((L, H, kv_dim), "normal", "layers", "embed", "kv_heads"),
        "wv": s((L, H, kv_dim), "normal", "layers", "embed", "kv_heads"),
        "wo": s((L, q_dim, H), "normal", "layers", "heads", "embed"),
        "mlp_norm": s((L, H), norm, "layers", "embed"),
    }
    if cfg.is_moe:
        E, Im, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        layers |= {"router": s((L, H, E), "normal", "layers", "embed", None),
                   "we_gate": s((L, E, H, Im), "normal", "layers", "expert", "embed", "moe_mlp"),
                   "we_up": s((L, E, H, Im), "normal", "layers", "expert", "embed", "moe_mlp"),
                   "we_down": s((L, E, Im, H), "normal", "layers", "expert", "moe_mlp", "embed")}
        if Is:
            layers |= {"ws_gate": s((L, H, Is), "normal", "layers", "embed", "mlp"),
                       "ws_up": s((L, H, Is), "normal", "layers", "embed", "mlp"),
                       "ws_down": s((L, Is, H), "normal", "layers", "mlp", "embed"),
                       "ws_router": s((L, H, 1), "normal", "layers", "embed", None)}
    else:
        layers |= {"w_gate": s((L, H, I), "normal", "layers", "embed", "mlp"),
                   "w_up": s((L, H, I), "normal", "layers", "embed", "mlp"),
                   "w_down": s((L, I, H), "normal", "layers", "mlp", "embed")}
    if cfg.sandwich_norms:
        layers |= {"post_attn_norm": s((L, H), norm, "layers", "embed"),
                   "post_mlp_norm": s((L, H), norm, "layers", "embed")}
    if cfg.qkv_bias:
        layers |= {"bq": s((L, q_dim), "zeros", "layers", "heads"),
                   "bk": s((L, kv_dim), "zeros", "layers", "kv_heads"),
                   "bv": s((L, kv_dim), "zeros", "layers", "kv_heads")}
    if cfg.o_bias:
        layers["bo"] = s((L, H), "zeros", "layers", "embed")
    if cfg.qk_norm:
        layers |= {"q_norm": s((L, cfg.head_dim), norm, "layers", None),
                   "k_norm": s((L, cfg.head_dim), norm, "layers", None)}
    specs = {"embed": s((V, H), "normal", "vocab", "embed"), "layers": layers,
             "final_norm": s((H,), norm, "embed")}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = s((H, V), "normal", "embed", "vocab")
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
    """
    slots = cfg.num_layers if num_slots is None else num_slots
    shape = (slots * num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    spec = ParamSpec(shape, "zeros", CACHE_AXES)
    if not scaled:
        return {"k": spec, "v": spec}
    scale = ParamSpec((cfg.num_layers,), "ones", (None,))
    return {"k": spec, "v": spec, "k_scale": scale, "v_scale": scale}


def is_scaled(dtype) -> bool:
    """Whether pages of `dtype` are stored scaled (8-bit floats: float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random params (normal(0, std) weights, unit norms, zero biases)."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init == "normal":
            out.append((std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype))
        else:
            out.append(jnp.full(spec.shape, 1.0 if spec.init == "ones" else 0.0, dtype))
    return jax.tree.unflatten(treedef, out)


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
