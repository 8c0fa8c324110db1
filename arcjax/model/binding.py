"""Between the params pytree and the decoder's module tree (`arcjax.model.layers`).

The params pytree (`arcjax.model.specs.Params`) is what every loader produces, every
optimizer updates and every jitted step takes (donated, sharded, quantized leaves and all):
`{"embed", "layers": {name: [L, ...]}, "final_norm", "lm_head"?}`, one flat dict per layer.
Each parameter of the module tree sits in it at `params_path(path)`: the top-level module's
name, or, for a layer parameter, `("layers", name)` where `name` is the parameter's own
(`wq`, `router`, ...) or its norm's (`attn_norm`, `q_norm`, ...); a model whose first
layers are dense and the rest experts holds the dense ones in `("dense_layers", name)`
([K, ...]) and the rest in `("layers", name)` ([L - K, ...]).

1. `declarations(cfg)`: every parameter as its module declares it (shape, initializer,
   logical axes), read from the module tree built without arrays (`nnx.eval_shape`); what
   `arcjax.model.specs.param_specs`, and so init, loading and shardings, derive from.
2. `bind(cfg, params)`: the module tree holding `params`, inside a traced step: the graph is
   static and the leaves are the step's own arguments, so a module costs trace time only.
"""

from __future__ import annotations

import dataclasses
import functools

from flax import nnx

from arcjax.errors import WeightsError
from arcjax.model.layer_arrays import split_layers
from arcjax.model.layers import Decoder, ExpertWeight, value
from arcjax.model.mla_layers import MLAAttention
from arcjax.model.model_config import ModelConfig

# Names a parameter has inside its module, not in the params pytree (see `params_path`).
ROLE_NAMES = ("scale", "embedding", "kernel")
# The stacks of layer parameters ([layers, ...] each): the dense layers before the expert
# layers of a model that mixes them (`ModelConfig.num_dense_layers`), then every other.
LAYER_STACKS = ("dense_layers", "layers")


def params_path(path: tuple) -> tuple[str, ...]:
    """Where a parameter of the module tree sits in the params pytree:
    ("embed", "embedding") -> ("embed",), ("lm_head", "kernel") -> ("lm_head",),
    ("layers", "attn", "wq") -> ("layers", "wq"),
    ("layers", "attn", "q_norm", "scale") -> ("layers", "q_norm"); a dense layer of a
    model that mixes dense and expert layers sits in ("dense_layers", name)."""
    names = [str(p) for p in path if str(p) not in ROLE_NAMES]
    return (names[0], names[-1]) if names[0] in LAYER_STACKS else (names[0],)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One parameter as its module declares it."""

    path: tuple[str, ...]  # where it sits in the module tree
    key: tuple[str, ...]  # where it sits in the params pytree (`params_path`)
    shape: tuple[int, ...]  # stacked [L, ...] for a layer parameter
    init: str  # `initializer` name
    axes: tuple[str | None, ...]  # logical axis per dimension
    variable: nnx.Variable  # abstract (a ShapeDtypeStruct value)


@functools.lru_cache(maxsize=8)
def _abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, tuple[Declaration, ...]]:
    """The module tree of `cfg` without arrays (`nnx.eval_shape`): its graph and its
    parameters. Cached per config: a pure function of it, which every traced step reads."""
    attention = MLAAttention if cfg.is_mla else None  # None: per-head `Attention`
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0), attention=attention)))
    axes = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    out = tuple(Declaration(path=tuple(map(str, path)), key=params_path(path),
                            shape=tuple(value(var).shape), init=var.get_metadata()["init"],
                            axes=tuple(value(axes[path])), variable=var)
                for path, var in nnx.to_flat_state(state))
    if len({d.key for d in out}) != len(out):
        raise ValueError(f"two parameters of {cfg.architecture} share a params path")
    return graphdef, out


def declarations(cfg: ModelConfig) -> tuple[Declaration, ...]:
    """Every parameter of `cfg`'s decoder, read from its modules."""
    return _abstract(cfg)[1]


def _lookup(params: dict, key: tuple[str, ...]):
    node = params
    for name in key:
        node = node[name]
    return node


def _keys(tree: dict, prefix: tuple = ()) -> set[tuple[str, ...]]:
    out = set()
    for name, node in tree.items():
        if isinstance(node, dict):
            out |= _keys(node, prefix + (name,))
        else:
            out.add(prefix + (name,))
    return out


def bind(cfg: ModelConfig, params: dict) -> Decoder:
    """The decoder of `cfg` holding `params` (the params pytree, arrays or tracers; its
    leaves become the modules' parameter values as they are: quantized weights too).

    Raises:
      WeightsError: `params` lacks a parameter of the model or has one it does not know.
    """
    graphdef, declared = _abstract(cfg)
    given = _keys(params)
    keys = {d.key for d in declared}
    if keys != given:
        missing = ", ".join("/".join(k) for k in sorted(keys - given))
        unknown = ", ".join("/".join(k) for k in sorted(given - keys))
        raise WeightsError("params", f"do not match the {cfg.architecture} decoder: missing "
                                     f"[{missing}], unknown [{unknown}]")
    state = nnx.from_flat_state([(d.path, d.variable.replace(_lookup(params, d.key)))
                                 for d in declared])
    return nnx.merge(graphdef, state)


def split_layer_params(cfg: ModelConfig, params: dict) -> dict:
    """`params` with its layer parameters held one array per layer (`LayerArrays`, for the
    unrolled layer loop: arcjax/model/layer_arrays.py), expert weights stacked as they are."""
    experts = frozenset(d.key for d in declarations(cfg) if isinstance(d.variable, ExpertWeight))
    return split_layers(params, LAYER_STACKS, experts)
