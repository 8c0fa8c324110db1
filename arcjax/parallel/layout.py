"""Tensor parallelism: a mesh, logical-axis rules, and shardings derived from the specs.

1. `check_tensor_parallel(cfg, tp)` refuses head counts that do not split (EngineConfigError
   naming `tensor_parallel_size`).
2. `TensorParallel.create(cfg, tp)` builds a one-axis mesh ("tp") over the first `tp`
   devices (of every process) and the rules mapping logical axes to it:
     heads, kv_heads, mlp -> "tp"; vocab -> "tp" when divisible, else replicated;
     embed, layers, pages and unnamed axes -> replicated.
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
attention and `write_kv` run under `shard_map` over the KV-head axis (`attention_map`), so
a Pallas kernel, which GSPMD cannot partition, sees exactly the single-device problem on
its heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arcjax.errors import EngineConfigError
from arcjax.model.config import ModelConfig
from arcjax.model.specs import cache_specs, is_spec, param_specs

TP_AXIS = "tp"
# Logical axes split over the tensor axis; every other logical axis is replicated.
TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab")


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raises EngineConfigError unless the model splits over `tp` devices.

    Requires num_heads % tp == 0, num_kv_heads % tp == 0 or tp % num_kv_heads == 0 (then KV
    heads are replicated), intermediate_size % tp == 0. The vocabulary is split when
    vocab_size % tp == 0 and replicated otherwise (never padded).
    """
    field = "tensor_parallel_size"
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise EngineConfigError(field, f"must be an int >= 1, got {tp!r}", limit=1)
    if cfg.num_heads % tp:
        raise EngineConfigError(field, f"{tp} does not divide the model's {cfg.num_heads} "
                                       "attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise EngineConfigError(field, f"{tp} must divide the model's {cfg.num_kv_heads} KV "
                                       "heads or be a multiple of them")
    if cfg.intermediate_size % tp:
        raise EngineConfigError(field, f"{tp} does not divide the model's intermediate_size "
                                       f"{cfg.intermediate_size}")


def logical_rules(cfg: ModelConfig, tp: int) -> tuple[tuple[str, str], ...]:
    """(logical axis, mesh axis) pairs for `cfg` over `tp` devices (checked first)."""
    check_tensor_parallel(cfg, tp)
    axes = [a for a in TENSOR_AXES if a != "vocab" or cfg.vocab_size % tp == 0]
    return tuple((a, TP_AXIS) for a in axes)


def kv_repeat(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is stored (1 unless tp exceeds the KV heads)."""
    return max(1, tp // cfg.num_kv_heads)


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model as `tp` devices hold it: KV heads repeated `kv_repeat` times."""
    return cfg.with_kv_repeat(kv_repeat(cfg, tp))


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ("tp") mesh over the first `tp` of `devices` (default: all devices of all
    processes, in jax.devices() order)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise EngineConfigError("tensor_parallel_size", f"{tp} exceeds the {len(devices)} "
                                f"available devices", limit=len(devices))
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A mesh plus the logical-axis rules (hashable: a jit static argument).

    Attributes:
      mesh: the device mesh (one axis, "tp").
      rules: (logical axis, mesh axis) pairs; a logical axis not listed is replicated.
    """

    mesh: Mesh
    rules: tuple[tuple[str, str], ...]

    @classmethod
    def create(cls, cfg: ModelConfig, tp: int,
               devices: Sequence[jax.Device] | None = None) -> "TensorParallel":
        """Rules for `cfg` over a fresh `tp`-device mesh. `cfg` is the original model
        config (before `sharded_config`)."""
        return cls(make_mesh(tp, devices), logical_rules(cfg, tp))

    @property
    def size(self) -> int:
        return self.mesh.size

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

    def param_shardings(self, cfg: ModelConfig):
        """Shardings of the params of `cfg` (the sharded config)."""
        return self.shardings(param_specs(cfg))

    def make_cache(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype):
        """A zeroed paged KV cache created directly in its shards (sharded by KV head)."""
        specs = cache_specs(cfg, num_blocks, block_size)
        shardings = self.shardings(specs)

        def zeros():
            return jax.tree.map(lambda s: jnp.zeros(s.shape, dtype), specs, is_leaf=is_spec)

        return jax.jit(zeros, out_shardings=shardings)()

    def put_replicated(self, tree):
        """Host arrays -> global arrays replicated on the mesh (every process passes the
        same values; each places only its own devices' copies)."""
        sharding = self.replicated

        def put(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, tree)

    def attention_map(self, fn, q_axes, kv_axes, cache_axes, num_rest: int):
        """`fn(q, k, v, k_cache, v_cache, *rest) -> (out, k_cache, v_cache)` under shard_map:
        q/out split by heads, k/v by kv_heads, caches by their spec's axes, `rest` (tables,
        lengths, slots) replicated. Per device it is exactly the single-device computation
        on that device's heads."""
        q, kv, cache = self.pspec(q_axes), self.pspec(kv_axes), self.pspec(cache_axes)
        return jax.shard_map(fn, mesh=self.mesh,
                             in_specs=(q, kv, kv, cache, cache) + (PartitionSpec(),) * num_rest,
                             out_specs=(q, cache, cache), check_vma=False)


def per_device_bytes(tree) -> dict[str, int]:
    """Bytes each device holds of a tree of arrays (addressable shards only)."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            key = str(shard.device)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out

