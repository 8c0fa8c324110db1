"""Tensor and expert parallelism: a mesh, logical-axis rules, shardings derived from the specs.

1. `check_tensor_parallel(cfg, tp, ep)` refuses head counts, widths or expert counts that do
   not split (EngineConfigError naming `tensor_parallel_size` / `expert_parallel_size`).
2. `TensorParallel.create(cfg, tp, ep=1)` builds the mesh over the first max(tp, ep) devices
   (of every process) and the rules mapping logical axes to it. With ep == 1, one axis
   ("tp"):
     heads, kv_heads, mlp, moe_mlp -> "tp"; vocab -> "tp" when divisible, else replicated;
     expert, embed, layers, pages and unnamed axes -> replicated.
   With ep > 1 (a mixture of experts), two axes ("ep", "tp"); attention stays tensor
   parallel over `tp` devices and the experts are split over `ep` devices:
     ep <= tp (the experts split inside the tensor-parallel group, vLLM's layout): mesh
       (ep, tp / ep); heads, kv_heads, mlp, vocab -> ("ep", "tp"); expert -> "ep";
       moe_mlp -> "tp" (each expert's width splits over what is left).
     ep > tp: mesh (ep / tp, tp); heads, kv_heads, mlp, vocab -> "tp" (attention replicated
       over "ep"); expert -> ("ep", "tp"); moe_mlp -> replicated.
3. `sharded_config(cfg, tp)` is the model as the devices see it: when the model has fewer
   KV heads than `tp` (tp a multiple of them), each KV head is repeated `tp // Hkv` times so
   every device holds exactly the KV head its query heads read (query head h reads repeated
   head h // (Hq / tp) = original head h // (Hq / Hkv): the same attention). The weights
   loader and the cache use this config; nothing else changes.
4. `tp.shardings(spec_tree)` turns any tree of `ParamSpec`s (params or cache) into
   NamedShardings through the rules: the one place a sharding is derived; never written
   down per array.

NOTE: in the step, matmuls split over the tensor axis follow from the weights' shardings
(GSPMD inserts the all-reduce after wo / w_down and the gather of vocab-sharded logits);
attention and `write_kv` run under `shard_map` over the KV-head axis (`attention_map`, one
`AttentionInputs` split as `ATTENTION_AXES` says), so a Pallas kernel, which GSPMD cannot
partition, sees exactly the single-device problem on its heads. Latent attention (DeepSeek's
MLA, `LATENT_ATTENTION_AXES`): the absorbed queries split by head, the latent pages (one
latent per token, shared by every head) whole on every device; its projections split by
head like any attention's, the latent's own (`wkv_a`) replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arcjax.errors import EngineConfigError
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import (CACHE_AXES, cache_specs, is_scaled, is_spec, make_cache,
                                param_specs)
from pallas_kernels.attention_inputs import AttentionInputs
from pallas_kernels.mla_inputs import MLAInputs

TP_AXIS = "tp"
EP_AXIS = "ep"
# Logical axes split over the tensor axis; every other logical axis is replicated.
TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab")
# How one attention call splits, per field of `AttentionInputs`: queries and their sinks
# (gpt-oss, when given) by head, the pages (the cache) by KV head; every other field
# (tables, lengths, window, scales) is replicated.
ATTENTION_AXES = {"q": (None, "heads", None), "k_pages": CACHE_AXES, "v_pages": CACHE_AXES,
                  "sinks": ("heads",)}
# Latent attention (`pallas_kernels.mla_inputs.MLAInputs`; DeepSeek's MLA): the absorbed
# queries by head, the latent and rope pages [pages, block, D] whole on every device (one
# latent per token, shared by every head: docs/decisions/0025-latent-attention-replicated.md).
LATENT_ATTENTION_AXES = {"q_latent": (None, "heads", None), "q_rope": (None, "heads", None),
                         "latent_pages": ("pages", None, None),
                         "rope_pages": ("pages", None, None)}
# Per kind of attention inputs: (how its fields split, the fields the mapped function's
# three outputs (out, pages, pages) are split like).
ATTENTION_SPLITS = {AttentionInputs: (ATTENTION_AXES, ("q", "k_pages", "v_pages")),
                    MLAInputs: (LATENT_ATTENTION_AXES, ("q_latent", "latent_pages",
                                                        "rope_pages"))}


def _size(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EngineConfigError(field, f"must be an int >= 1, got {value!r}", limit=1)


def check_tensor_parallel(cfg: ModelConfig, tp: int, ep: int = 1) -> None:
    """Raises EngineConfigError unless the model splits over `tp` devices (attention and
    dense MLP) and its experts over `ep`.

    Requires num_heads % tp == 0, num_kv_heads % tp == 0 or tp % num_kv_heads == 0 (then KV
    heads are replicated; latent attention has no KV heads to split), the dense and
    shared-expert widths % tp == 0 (a mixture of experts' dense width only when it has
    dense layers, DeepSeek's `first_k_dense_replace`). The vocabulary is
    split when vocab_size % tp == 0 and replicated otherwise (never padded). With ep > 1:
    a mixture-of-experts model, one of tp and ep a multiple of the other, num_experts %
    ep == 0, and each expert's width divisible by tp / ep when ep < tp.
    """
    field = "tensor_parallel_size"
    _size(field, tp)
    _size("expert_parallel_size", ep)
    if cfg.num_heads % tp:
        raise EngineConfigError(field, f"{tp} does not divide the model's {cfg.num_heads} "
                                       "attention heads")
    # latent attention: one latent per token, shared by every head (replicated, never split)
    if not cfg.is_mla and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise EngineConfigError(field, f"{tp} must divide the model's {cfg.num_kv_heads} KV "
                                       "heads or be a multiple of them")
    widths = ((("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size),)
              if cfg.is_moe else ())
    if not cfg.is_moe or cfg.num_dense_layers:  # a dense model, or DeepSeek's dense layers
        widths += (("intermediate_size", cfg.intermediate_size),)
    for name, width in widths:
        if width % tp:
            raise EngineConfigError(field, f"{tp} does not divide the model's {name} {width}")
    if ep == 1:
        if cfg.is_moe and cfg.moe_intermediate_size % tp:
            raise EngineConfigError(field, f"{tp} does not divide the experts' "
                                           f"moe_intermediate_size {cfg.moe_intermediate_size}")
        return
    field = "expert_parallel_size"
    if not cfg.is_moe:
        raise EngineConfigError(field, f"{ep} needs a mixture-of-experts model; "
                                       f"{cfg.architecture} has no experts", limit=1)
    if max(tp, ep) % min(tp, ep):
        raise EngineConfigError(field, f"{ep} and tensor_parallel_size {tp}: one must be a "
                                       "multiple of the other")
    if cfg.num_experts % ep:
        raise EngineConfigError(field, f"{ep} does not divide the model's {cfg.num_experts} "
                                       "experts")
    if ep < tp and cfg.moe_intermediate_size % (tp // ep):
        raise EngineConfigError(field, f"tensor_parallel_size / {ep} = {tp // ep} does not "
                                       "divide the experts' moe_intermediate_size "
                                       f"{cfg.moe_intermediate_size}")


def logical_rules(cfg: ModelConfig, tp: int, ep: int = 1) -> tuple[tuple[str, object], ...]:
    """(logical axis, mesh axis or axes) pairs for `cfg` over max(tp, ep) devices (checked
    first); see the module docstring."""
    check_tensor_parallel(cfg, tp, ep)
    if ep == 1:
        attn, expert, moe = TP_AXIS, None, TP_AXIS
    elif ep <= tp:
        attn, expert, moe = (EP_AXIS, TP_AXIS), EP_AXIS, TP_AXIS
    else:
        attn, expert, moe = TP_AXIS, (EP_AXIS, TP_AXIS), None
    axes = [a for a in TENSOR_AXES if a != "vocab" or cfg.vocab_size % tp == 0]
    rules = [(a, attn) for a in axes]
    if cfg.is_moe:
        rules += [(name, mesh) for name, mesh in (("expert", expert), ("moe_mlp", moe))
                  if mesh is not None]
    return tuple(rules)


def kv_repeat(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is stored (1 unless tp exceeds the KV heads; 1 for
    latent attention, whose one latent per token every device holds whole)."""
    return 1 if cfg.is_mla else max(1, tp // cfg.num_kv_heads)


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model as `tp` devices hold it: KV heads repeated `kv_repeat` times."""
    return cfg.with_kv_repeat(kv_repeat(cfg, tp))


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None, ep: int = 1) -> Mesh:
    """The mesh over the first max(tp, ep) of `devices` (default: all devices of all
    processes, in jax.devices() order): one axis ("tp") when ep == 1, else ("ep", "tp")
    shaped as the module docstring says."""
    devices = list(jax.devices() if devices is None else devices)
    n = max(tp, ep)
    if n > len(devices):
        field = "tensor_parallel_size" if tp >= ep else "expert_parallel_size"
        raise EngineConfigError(field, f"{n} exceeds the {len(devices)} available devices",
                                limit=len(devices))
    if ep == 1:
        return Mesh(np.array(devices[:tp]), (TP_AXIS,))
    shape = (ep, tp // ep) if ep <= tp else (ep // tp, tp)
    return Mesh(np.array(devices[:n]).reshape(shape), (EP_AXIS, TP_AXIS))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A mesh plus the logical-axis rules (hashable: a jit static argument).

    Attributes:
      mesh: the device mesh (one axis, "tp").
      rules: (logical axis, mesh axis) pairs; a logical axis not listed is replicated.
    """

    mesh: Mesh
    rules: tuple[tuple[str, object], ...]

    @classmethod
    def create(cls, cfg: ModelConfig, tp: int, devices: Sequence[jax.Device] | None = None,
               ep: int = 1) -> "TensorParallel":
        """Rules for `cfg` over a fresh mesh of max(tp, ep) devices. `cfg` is the original
        model config (before `sharded_config`)."""
        rules = logical_rules(cfg, tp, ep)  # the model's refusals first, then the devices'
        return cls(make_mesh(tp, devices, ep), rules)

    @property
    def size(self) -> int:
        """Devices in the mesh."""
        return self.mesh.size

    def degree(self, logical: str) -> int:
        """How many ways the logical axis `logical` is split (1: replicated)."""
        mesh = dict(self.rules).get(logical)
        names = (mesh,) if isinstance(mesh, str) else (mesh or ())
        return int(np.prod([self.mesh.shape[n] for n in names], dtype=np.int64))

    @property
    def tp(self) -> int:
        """The attention's tensor-parallel degree (what `sharded_config` repeats KV heads
        for)."""
        return self.degree("heads")

    def pspec(self, axes: Sequence[str | None]) -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions carry these logical axes."""
        rules = dict(self.rules)
        return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))

    def sharding(self, axes: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.pspec(axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shardings(self, spec_tree):
        """NamedShardings for a tree of ParamSpecs (same structure)."""
        return jax.tree.map(lambda s: self.sharding(s.axes), spec_tree, is_leaf=is_spec)

    def kv_repeat(self, cfg: ModelConfig) -> int:
        """How many times each KV head of `cfg` (the file's config) is stored here (the
        attention's degree, `tp`, which with expert parallelism may be below the mesh's)."""
        return kv_repeat(cfg, self.tp)

    def cache_split(self, cfg: ModelConfig) -> int:
        """How many ways the paged cache of `cfg` (the sharded config) is split, read from
        its specs' axes: by KV head over the attention's devices; 1 for latent attention's
        pages, whole on every device."""
        axes = cache_specs(cfg, 1, 1)["k"].axes
        return int(np.prod([self.degree(a) for a in axes if a is not None], dtype=np.int64))

    def param_shardings(self, cfg: ModelConfig):
        """Shardings of the params of `cfg` (the sharded config)."""
        return self.shardings(param_specs(cfg))

    def make_cache(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
                   kv_scales=None, num_slots: int | None = None):
        """A zeroed paged KV cache created directly in its shards (sharded by KV head);
        FP8 pages' per-layer scales replicated (see `arcjax.model.specs.make_cache`)."""
        specs = cache_specs(cfg, num_blocks, block_size, scaled=is_scaled(dtype),
                            num_slots=num_slots)
        shardings = self.shardings(specs)
        return jax.jit(lambda: make_cache(cfg, num_blocks, block_size, dtype, kv_scales,
                                          num_slots), out_shardings=shardings)()

    def put_replicated(self, tree):
        """Host arrays -> global arrays replicated on the mesh (every process passes the
        same values; each places only its own devices' copies)."""
        sharding = self.replicated

        def put(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, tree)

    def attention_map(self, fn, inputs: AttentionInputs | MLAInputs, *args,
                      args_axes: Sequence[Sequence[str | None]]):
        """Runs `fn(inputs, *args) -> (out, k_pages, v_pages)` under shard_map: each field of
        `inputs` split as `ATTENTION_SPLITS` says for its kind (the rest replicated), each
        of `args` by its entry of `args_axes`, `out` like the query and the pages like the
        cache (per-head `AttentionInputs`: by KV head; latent attention's `MLAInputs`: whole
        on every device). Per device it is exactly the single-device computation on that
        device's heads."""
        field_axes, out_fields = ATTENTION_SPLITS[type(inputs)]
        specs = jax.tree.map(lambda _: PartitionSpec(), inputs)  # the structure of `inputs`
        specs = dataclasses.replace(specs, **{name: self.pspec(axes)
                                              for name, axes in field_axes.items()
                                              if getattr(inputs, name) is not None})
        out = tuple(self.pspec(field_axes[name]) for name in out_fields)
        mapped = jax.shard_map(fn, mesh=self.mesh,
                               in_specs=(specs, *(self.pspec(a) for a in args_axes)),
                               out_specs=out, check_vma=False)
        return mapped(inputs, *args)

    def experts_map(self, fn, weight_axes: Sequence[Sequence[str | None]]):
        """`fn(x, route, *weights) -> (partial_out, stats)` under shard_map: x (tokens) and
        route (the routing) replicated, each weight split by its spec's axes (expert weights
        by "expert" and "moe_mlp"; a quantized weight's entry is a tree of axes, its values'
        and its scales'); `fn` sees its device's experts and width and returns a
        partial sum over them, which is all-reduced (psum over every mesh axis); `stats`
        are the same on every device. `fn` finds its first expert with `local_experts`."""
        names = tuple(self.mesh.axis_names)

        def body(x, route, *weights):
            out, stats = fn(x, route, *weights)
            return jax.lax.psum(out, names), stats

        rep = PartitionSpec()
        return jax.shard_map(body, mesh=self.mesh,
                             in_specs=(rep, rep) + tuple(
                                 jax.tree.map(self.pspec, a, is_leaf=_is_axes)
                                 for a in weight_axes),
                             out_specs=(rep, rep), check_vma=False)

    def expert_offset(self, experts_per_device: int) -> jax.Array:
        """Inside `experts_map`: the first expert this device holds."""
        mesh = dict(self.rules).get("expert")
        if mesh is None:
            return jnp.int32(0)
        return jax.lax.axis_index(mesh) * experts_per_device


def _is_axes(x) -> bool:
    """A leaf of a tree of logical axes: one array's axes (a tuple of names / None)."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def per_device_bytes(tree) -> dict[str, int]:
    """Bytes each device holds of a tree of arrays (addressable shards only)."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            key = str(shard.device)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out

