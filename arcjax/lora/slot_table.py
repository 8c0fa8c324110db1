"""The device slots of LoRA adapters: stacked A/B buffers, and which adapter each slot holds.

One pair of buffers per target projection, declared once (`lora_specs`):
A [L, S, in, r] and B [L, S, r, out], S = max_loras + 1 slots of rank r = max_lora_rank, in
the compute dtype (quantized base weights leave them alone). Slot 0 is the base model's and
stays zero; slots 1..max_loras hold adapters (a smaller rank padded with zeros, the scale
folded into B, projections an adapter does not target zero). Under tensor parallelism the
buffers split like their base weight: a column-parallel projection (q/k/v, gate/up: output
split) splits B's out, a row-parallel one (o, down: input split) splits A's in; KV heads
repeated for tensor parallelism are repeated in B of k/v the same way.

`SlotTable.assign(needed, keep, weights)` (the engine, before each step with adapter rows)
makes every adapter of the step resident: an adapter already in a slot stays; another
takes a free slot, else the least recently used slot whose adapter neither this step nor a
running sequence needs (the scheduler's slot constraint guarantees one). Writing a slot is
one jitted update of every buffer (a new buffer: a step still in flight keeps reading the
old one), and counts as a swap (`swaps`, `load_seconds`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.model.lora_delta import LoRAWeights
from arcjax.lora.peft_adapter import PeftAdapter
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import ParamSpec

# params key -> (logical axis of its input, of its output), as the base weight's spec says.
PROJECTION_AXES = {"wq": ("embed", "heads"), "wk": ("embed", "kv_heads"),
                   "wv": ("embed", "kv_heads"), "wo": ("heads", "embed"),
                   "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"),
                   "w_down": ("mlp", "embed")}


def projection_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection a slot holds on `cfg` (the config the device runs:
    KV heads repeated under tensor parallelism); no MLP projections for experts."""
    H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {"wq": (H, q), "wk": (H, kv), "wv": (H, kv), "wo": (q, H)}
    if not cfg.is_moe:
        I = cfg.intermediate_size
        dims |= {"w_gate": (H, I), "w_up": (H, I), "w_down": (I, H)}
    return dims


def lora_specs(cfg: ModelConfig, num_slots: int, rank: int) -> dict[str, dict[str, ParamSpec]]:
    """The slot buffers as specs: per projection {"a": [L, S, in, r], "b": [L, S, r, out]}."""
    L = cfg.num_layers
    out = {}
    for key, (d_in, d_out) in projection_dims(cfg).items():
        in_axis, out_axis = PROJECTION_AXES[key]
        out[key] = {"a": ParamSpec((L, num_slots, d_in, rank), "zeros",
                                   ("layers", None, in_axis, None)),
                    "b": ParamSpec((L, num_slots, rank, d_out), "zeros",
                                   ("layers", None, None, out_axis))}
    return out


def _set_slot(buffers, slot, values):
    """`buffers` with slot `slot` of every array replaced by `values` (same tree, no slot
    axis). Jitted per table (its shardings); not donated: a step in flight may still read
    the old buffers."""
    return jax.tree.map(lambda buf, v: buf.at[:, slot].set(v.astype(buf.dtype)), buffers, values)


class SlotTable:
    """The slot buffers on the device and the adapter in each slot (engine thread only).

    Args:
      cfg: the model as the device holds it.
      max_loras: slots for adapters (slot 0, the base model's, comes on top).
      rank: every slot's rank (`max_lora_rank`).
      dtype: the compute dtype.
      parallel: an `arcjax.parallel.TensorParallel`, or None (one device).
    """

    def __init__(self, cfg: ModelConfig, *, max_loras: int, rank: int, dtype, parallel=None):
        self.cfg, self.rank, self.dtype = cfg, rank, jnp.dtype(dtype)
        self.num_slots = max_loras + 1
        self.specs = lora_specs(cfg, self.num_slots, rank)
        self._parallel = parallel
        # every buffer's sharding, from its spec's logical axes (None: one device)
        self.shardings = None if parallel is None else parallel.shardings(self.specs)
        placed = {} if parallel is None else {"out_shardings": self.shardings}
        self._set_slot = jax.jit(_set_slot, **placed)
        self._zeros = jax.jit(lambda: jax.tree.map(
            lambda spec: jnp.zeros(spec.shape, self.dtype), self.specs,
            is_leaf=lambda x: isinstance(x, ParamSpec)), **placed)
        self.buffers = self._zeros()
        self.slot_of: dict[int, int] = {}  # adapter key -> slot
        self._holder: list[int | None] = [None] * self.num_slots  # slot -> adapter key
        self._recent: OrderedDict[int, None] = OrderedDict()  # keys, least recent first
        self.swaps = 0  # adapters written into a slot
        self.load_seconds = 0.0  # host time spent writing them (dispatch, copies)

    def reset(self) -> None:
        """Every slot empty (the device state was lost)."""
        self.buffers = self._zeros()
        self.slot_of.clear()
        self._holder = [None] * self.num_slots
        self._recent.clear()

    def assign(self, needed: Iterable[int], keep: Collection[int],
               weights: Callable[[int], PeftAdapter]) -> dict[int, int]:
        """Makes every adapter key of `needed` resident; returns key -> slot for them.

        Args:
          needed: the adapter keys of this step's rows.
          keep: keys of adapters running sequences use (not evicted for this step).
          weights: the host weights of a key (`AdapterCache.weights`).

        Raises:
          RuntimeError: no slot can be freed (more adapters than slots: the scheduler's
            constraint was broken).
        """
        needed = list(dict.fromkeys(needed))
        for key in needed:
            if key in self.slot_of:
                self._recent.move_to_end(key)
                continue
            slot = self._free_slot(set(needed) | set(keep))
            self._write(slot, key, weights(key))
        return {key: self.slot_of[key] for key in needed}

    def _free_slot(self, protected: set[int]) -> int:
        for slot in range(1, self.num_slots):
            if self._holder[slot] is None:
                return slot
        victim = next((key for key in self._recent if key not in protected), None)
        if victim is None:
            raise RuntimeError(f"no LoRA slot to free: {self.num_slots - 1} slots, all held by "
                               "adapters this step or a running sequence needs")
        slot = self.slot_of.pop(victim)
        del self._recent[victim]
        self._holder[slot] = None
        return slot

    def _write(self, slot: int, key: int, adapter: PeftAdapter) -> None:
        t0 = time.perf_counter()
        values = {name: self._host_values(name, adapter) for name in self.specs}
        if self._parallel is not None:
            values = {name: {part: jax.device_put(v, self._parallel.sharding(
                self.specs[name][part].axes[:1] + self.specs[name][part].axes[2:]))
                for part, v in pair.items()} for name, pair in values.items()}
        self.buffers = self._set_slot(self.buffers, np.int32(slot), values)
        self.slot_of[key] = slot
        self._holder[slot] = key
        self._recent[key] = None
        self.swaps += 1
        self.load_seconds += time.perf_counter() - t0

    def _host_values(self, name: str, adapter: PeftAdapter) -> dict[str, np.ndarray]:
        """One projection's A [L, in, rank] and B [L, rank, out] for a slot, in the buffer's
        shapes: zeros if the adapter does not target it, its rank padded, KV heads repeated."""
        L, _, d_in, rank = self.specs[name]["a"].shape
        d_out = self.specs[name]["b"].shape[-1]
        a = np.zeros((L, d_in, rank), np.float32)
        b = np.zeros((L, rank, d_out), np.float32)
        if name in adapter.weights:
            wa, wb = adapter.weights[name]  # [L, in, r], [L, r, out]
            r = wa.shape[-1]
            a[:, :, :r] = wa
            repeat = d_out // wb.shape[-1]  # KV heads stored `repeat` times
            if repeat > 1:
                head = self.cfg.head_dim
                wb = np.repeat(wb.reshape(L, r, -1, 1, head), repeat, axis=3).reshape(L, r, -1)
            b[:, :r] = wb
        return {"a": a, "b": b}

    def step_weights(self, token_slots: np.ndarray) -> LoRAWeights:
        """The step input: every slot's buffers and each token's slot ([T] int32)."""
        slots = (token_slots if self._parallel is None  # numpy goes straight to the call
                 else self._parallel.put_replicated(token_slots))
        return LoRAWeights(slots=slots, a={k: v["a"] for k, v in self.buffers.items()},
                           b={k: v["b"] for k, v in self.buffers.items()})


def token_slots(row_slots: Iterable[int], lengths: Iterable[int], tokens: int) -> np.ndarray:
    """Each token's slot: row i's slot repeated over its `lengths[i]` tokens, padding rows
    (up to `tokens`) in slot 0."""
    out = np.zeros(tokens, np.int32)
    per_token = np.repeat(np.fromiter(row_slots, np.int32), np.fromiter(lengths, np.int64))
    out[:len(per_token)] = per_token
    return out
