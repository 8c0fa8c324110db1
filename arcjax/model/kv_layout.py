"""How the layers share the paged KV cache: KV cache groups by attention type (vLLM's hybrid
layout).

Layers are grouped by their attention window (full attention, or one group per distinct
sliding window W). Every group holds the same number of layers P (the cache's slots), so one
block of the pool (P layers' pages of block_size positions) serves any group:

  * layer l writes and reads slot `layer_slot[l]` through the block tables of group
    `layer_group[l]`; its page for block b is `layer_slot[l] * num_blocks + b` of the flat
    cache `[P * num_blocks, block_size, Hkv, D]` (`arcjax.model.specs.cache_specs`);
  * a block the scheduler gives group g is used by g's layers only, so a sliding group's
    block released behind its window is memory every other group can take
    (scheduler/kv_groups.py).

A model whose layers all share one window (or an engine built with
`disable_hybrid_kv_cache_manager`) is one group of L layers: slot l is layer l, the
single-table layout. P is the layer count of the smallest type (vLLM's choice), or of the
largest when they differ by less than a quarter; a type of n layers forms ceil(n / P) groups,
the last one padded with unused slots (their pages hold nothing).
"""

from __future__ import annotations

import dataclasses

from arcjax.model.model_config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Which group and slot each layer uses.

    Attributes:
      group_windows: each group's attention window; None = full attention.
      layer_group: per layer, its group.
      layer_slot: per layer, its slot (which of the P pages of a block it owns).
      num_slots: P, layers' pages per block.
    """

    group_windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def hybrid(self) -> bool:
        """Several groups (their tables differ)."""
        return len(self.group_windows) > 1

    @property
    def scheduler_groups(self) -> tuple[int | None, ...]:
        """`SchedulerConfig.kv_cache_groups`: () for one group (its window goes to
        `SchedulerConfig.sliding_window`)."""
        return self.group_windows if self.hybrid else ()

    @property
    def sliding_window(self) -> int | None:
        """The one group's window (`SchedulerConfig.sliding_window`); None when hybrid."""
        return None if self.hybrid else self.group_windows[0]


def kv_layout(cfg: ModelConfig, *, hybrid: bool = True) -> KVLayout:
    """The KV layout of `cfg` (module docstring); `hybrid=False` keeps one table for every
    layer (sliding layers then hold every block, as full ones do)."""
    L = cfg.num_layers
    windows = [cfg.sliding_window if s else None for s in cfg.sliding_layers] or [None] * L
    types = list(dict.fromkeys(windows))  # in order of first appearance
    if not hybrid or len(types) == 1:
        window = types[0] if len(types) == 1 else None
        return KVLayout(group_windows=(window,), layer_group=(0,) * L,
                        layer_slot=tuple(range(L)), num_slots=L)
    counts = [windows.count(t) for t in types]
    slots = min(counts)
    if max(counts) < 1.25 * min(counts):
        slots = max(counts)
    first_group, group_windows = {}, []
    for t, n in zip(types, counts):
        first_group[t] = len(group_windows)
        group_windows += [t] * -(-n // slots)
    seen = dict.fromkeys(types, 0)
    layer_group, layer_slot = [], []
    for w in windows:
        j = seen[w]
        seen[w] += 1
        layer_group.append(first_group[w] + j // slots)
        layer_slot.append(j % slots)
    return KVLayout(group_windows=tuple(group_windows), layer_group=tuple(layer_group),
                    layer_slot=tuple(layer_slot), num_slots=slots)
