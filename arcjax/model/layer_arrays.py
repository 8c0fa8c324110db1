"""Layer parameters held one array per layer: the CPU's layer loop without weight copies.

The params pytree stacks every layer parameter `[L, ...]`, so the layer loop is one
`lax.scan` (compile time flat in depth). XLA:CPU runs a scan over stacked weights by
copying each layer's slice out of the stack before its matmul (a `dynamic-slice` fusion
per weight and layer: 53% of a lone SmolLM2 decode step, docs/design/cpu-step-profile.md);
a static slice of a stacked argument is worse (the slice fuses into the dot's operand,
which then leaves XLA's matmul kernel). An array that is an argument of its own is read in
place. So where some bucket unrolls (`unrolled_max_tokens`: on the CPU, for one device and
a model without experts, the buckets of at most AUTO_UNROLLED_TOKENS rows), the runner holds
each layer parameter as a `LayerArrays` of L arrays (`split_layers`), and those buckets'
steps run the layers one after the other in Python (`Decoder.scan_layers(unrolled=True)`):
one copy of the layer per layer in the program, so compile time grows with depth. The other
buckets scan, picking each layer's arrays by index (`select_layer`: one copy per layer, as
a scan's slice of a stack is, which many rows amortize).

Expert weights (`ExpertWeight`, `[L, E, ...]`) stay stacked: the layer scan hands them
whole to every layer either way (arcjax/model/layers.py's NOTE).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax

LAYER_LOOPS = ("auto", "scan", "unrolled")
AUTO_UNROLLED_TOKENS = 64  # "auto" on the CPU: buckets of at most this many rows unroll


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerArrays:
    """One layer parameter as L separate values (arrays, or quantized / packed weights
    whose leaves are one layer's), in layer order: what a stacked `[L, ...]` leaf is under
    the unrolled layer loop."""

    layers: tuple  # L values, layer l's [...] each

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int):
        return self.layers[index]


def is_layer_arrays(x) -> bool:
    return isinstance(x, LayerArrays)


def unrolled_max_tokens(layer_loop: str, *, platform: str, meshed: bool,
                        experts: bool) -> int:
    """The largest bucket (in token rows) whose steps run the layers unrolled; 0 = none
    (the layer parameters then stay stacked). "scan": 0; "unrolled": every bucket;
    "auto": on the CPU for one device and a model without experts, buckets of at most
    `AUTO_UNROLLED_TOKENS` rows (the other steps, whose matmuls amortize the slice copies
    over many rows, scan: compile time stays flat in depth there), elsewhere 0
    (accelerators read a scanned slice in place; a mesh shards the stacks; a mixture of
    experts reads its stacked experts by layer, which the unrolled loop would turn into
    static slices). The batch-invariant mode unrolls as well: its row tiles compute a row
    alike under either loop (arcjax/model/row_tiles.py)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if layer_loop == "auto":
        return AUTO_UNROLLED_TOKENS if platform == "cpu" and not meshed and not experts else 0
    return sys.maxsize if layer_loop == "unrolled" else 0


def bucket_layer_loop(max_tokens: int, tokens: int) -> str:
    """The layer loop of a bucket of `tokens` rows under `unrolled_max_tokens`'s bound."""
    return "unrolled" if tokens <= max_tokens else "scan"


def split_layers(params: dict, stacks: tuple[str, ...], whole: frozenset) -> dict:
    """`params` with each stacked layer parameter of `stacks` (the params' layer stacks,
    `binding.LAYER_STACKS`) as a `LayerArrays`, except the (stack, name) keys in `whole`
    (expert weights). Already split stacks stay as they are."""
    out = dict(params)
    for stack in stacks:
        if stack not in params:
            continue
        layer = {}
        for name, w in params[stack].items():
            if (stack, name) in whole or is_layer_arrays(w):
                layer[name] = w
                continue
            count = jax.tree.leaves(w)[0].shape[0]
            layer[name] = LayerArrays(tuple(jax.tree.map(lambda a, i=i: a[i], w)
                                            for i in range(count)))
        out[stack] = layer
    return out


def layer_slice(state, index: int):
    """Layer `index`'s values of a tree whose split parameters are `LayerArrays` (other
    leaves as they are)."""
    return jax.tree.map(lambda v: v[index] if is_layer_arrays(v) else v, state,
                        is_leaf=is_layer_arrays)


def select_layer(state, index: jax.Array):
    """Layer `index`'s values (index traced: [] int32) of a tree whose split parameters are
    `LayerArrays`, picked by a `lax.switch` over the layers: a scan over split parameters
    (XLA:CPU copies the picked arrays, as it copies a scan's slice of a stack; stacking
    them again inside the step would copy every layer in every step)."""
    count = len(jax.tree.leaves(state, is_leaf=is_layer_arrays)[0])
    return jax.lax.switch(index, [functools.partial(layer_slice, state, i)
                                  for i in range(count)])


def split_state(state) -> bool:
    """Whether a layer stack's state holds its parameters split (`LayerArrays`); raises
    ValueError when only some are."""
    leaves = jax.tree.leaves(state, is_leaf=is_layer_arrays)
    split = [is_layer_arrays(v) for v in leaves]
    if any(split) and not all(split):
        raise ValueError("a layer stack holds some parameters split (LayerArrays) and "
                         "others stacked")
    return bool(split) and all(split)
