"""The per-token LoRA delta of one projection: `B[slot] @ (A[slot] @ x)` for every token.

Each token carries the index of the device slot that holds its adapter (`slots` [T]); slot 0
is the base model's and holds zeros, so a base-model token's delta is zero. The scale
(`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) is folded into B when a slot is written, so
the delta needs no other input. Three implementations of the same product (`IMPLS`):

  "ragged_dot"  tokens sorted by slot (base-model tokens last, so they are computed by no
                group), two `jax.lax.ragged_dot` grouped GEMMs over slots 1..S-1, then
                unsorted: the work follows the adapter tokens.
  "gather"      each token gathers its slot's A and B ([T, in, r], [T, r, out]) and does
                a batched matrix-vector product (punica's BGMV): no sort, but the gathered
                weights scale with T.
  "masked"      every slot at once: x @ A of all slots ([in, S * r], one GEMM), the other
                slots' columns zeroed by a one-hot of the token's slot, then @ B of all
                slots ([S * r, out]): two dense GEMMs, S times the adapter FLOPs, which
                are small beside the base projection's (S * r << out).

"auto" (`resolve_impl`) takes "masked" on the CPU and "ragged_dot" elsewhere
(docs/decisions/0012-lora-delta-choice.md; figures in docs/design/lora.md, from
scripts/bench_lora.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IMPLS = ("ragged_dot", "gather", "masked")
AUTO_IMPL = {"cpu": "masked"}  # platform -> implementation; others: DEFAULT_IMPL
DEFAULT_IMPL = "ragged_dot"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """The LoRA input of one step (`arcjax.lora.slot_table.SlotTable.step_weights`).

    Attributes:
      slots: [T] int32, each token's slot (0: the base model; padding rows too).
      a: params key ("wq", ...) -> [L, S, in, r], every slot's A.
      b: params key -> [L, S, r, out], every slot's B (scale folded in).
    """

    slots: jax.Array
    a: dict
    b: dict

    def layer(self, a: dict, b: dict, impl: str) -> "LayerLoRA":
        """One layer's view, from its slices `a`, `b` of `self.a`, `self.b` (what the layer
        scan hands each layer)."""
        return LayerLoRA(self.slots, a, b, impl)


@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    """One layer's LoRA input inside the layer scan (built while tracing): the token slots,
    per projection A [S, in, r] and B [S, r, out], and the delta's implementation."""

    slots: jax.Array
    a: dict
    b: dict
    impl: str

    def add(self, key: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """`y` (projection `key`'s output for `x` [T, in]: [T, out]) plus every token's
        adapter delta (`y` itself for a projection no slot holds)."""
        if key not in self.a:
            return y
        return y + lora_delta(x, self.a[key], self.b[key], self.slots,
                              impl=self.impl).astype(y.dtype)


def resolve_impl(impl: str, platform: str) -> str:
    """The implementation "auto" stands for on `platform` ("cpu", "gpu", "tpu"), or `impl`."""
    if impl == "auto":
        return AUTO_IMPL.get(platform, DEFAULT_IMPL)
    if impl not in IMPLS:
        raise ValueError(f"LoRA impl must be 'auto' or one of {IMPLS}, got {impl!r}")
    return impl


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *,
               impl: str) -> jax.Array:
    """The LoRA delta of every token of one projection.

    Args:
      x: [T, in] the projection's input.
      a: [S, in, r] every slot's A (slot 0: zeros, the base model).
      b: [S, r, out] every slot's B, scale folded in (slot 0: zeros).
      slots: [T] int32, each token's slot in [0, S).
      impl: one of `IMPLS` (resolved; see `resolve_impl`).

    Returns:
      [T, out] in x's dtype.
    """
    if impl == "masked":
        return _masked(x, a, b, slots)
    if impl == "gather":
        return _gather(x, a, b, slots)
    if impl == "ragged_dot":
        return _ragged(x, a, b, slots)
    raise ValueError(f"LoRA impl must be one of {IMPLS}, got {impl!r}")


def _masked(x, a, b, slots):
    num_slots, d_in, rank = a.shape
    xa = x @ jnp.transpose(a, (1, 0, 2)).reshape(d_in, num_slots * rank)  # [T, S * r]
    keep = jax.nn.one_hot(slots, num_slots, dtype=x.dtype)  # [T, S]
    xa = (xa.reshape(-1, num_slots, rank) * keep[:, :, None]).reshape(-1, num_slots * rank)
    return xa @ b.reshape(num_slots * rank, -1)  # [T, out]


def _gather(x, a, b, slots):
    xa = jnp.einsum("ti,tir->tr", x, a[slots])  # [T, r]
    return jnp.einsum("tr,tro->to", xa, b[slots])  # [T, out]


def _ragged(x, a, b, slots):
    num_slots = a.shape[0]
    # base-model tokens (slot 0) sort last and fall outside every group: ragged_dot gives
    # them zero rows without computing them
    order = jnp.argsort(jnp.where(slots == 0, num_slots, slots), stable=True)  # [T]
    sizes = jnp.bincount(slots, length=num_slots)[1:].astype(jnp.int32)  # [S - 1]
    xa = jax.lax.ragged_dot(x[order], a[1:], sizes)  # [T, r]
    y = jax.lax.ragged_dot(xa, b[1:], sizes)  # [T, out], sorted
    return jnp.zeros_like(y).at[order].set(y)
