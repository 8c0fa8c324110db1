"""Static scheduler settings: one frozen, keyword-only dataclass, validated when built."""

from __future__ import annotations

import dataclasses
import os

from scheduler.blocks import blocks_for
from scheduler.scheduler_errors import ConfigError

POLICIES = ("prefill_first", "alternate", "token_budget")

# Environment variables read by `SchedulerConfig.from_env`, and the field each one fills.
ENV_FIELDS = {
    "ARC_PREFILL_MAX_SEQS": "prefill_max_seqs",
    "ARC_PREFILL_FLOOR_STEPS": "prefill_floor_steps",
}

# (field, smallest allowed value) for every integer field.
_INT_MINIMUMS = (
    ("max_num_batched_tokens", 1),
    ("max_num_seqs", 1),
    ("prefill_max_seqs", 0),
    ("prefill_floor_steps", 0),
    ("chunk_tile", 1),
    ("long_prefill_token_threshold", 0),
    ("max_num_partial_prefills", 1),
    ("block_size", 1),
    ("num_blocks", 1),
    ("watermark_blocks", 0),
    ("num_host_blocks", 0),
    ("max_loras", 1),
)

# Cache groups are told apart by one byte in their prefix-cache keys (scheduler/prefix.py).
MAX_KV_CACHE_GROUPS = 255


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """How the planner chooses each step's chunks.

    Attributes:
      policy: "prefill_first" (legacy: a step is prefill-only or decode-only, prompts whole),
        "alternate" (chunked prefill steps alternate with decode steps) or "token_budget"
        (stall-free: decodes first, then prefill chunks fill the rest of the budget, same step).
      max_num_batched_tokens: tokens per step. Legacy whole-prompt prefill may exceed it for one
        lone prompt that is longer than the budget (that step holds only that prompt).
      max_num_seqs: sequences running at once (decoding or mid-prefill); also bounds rows per step.
      prefill_max_seqs: new admissions (waiting -> running) per step; 0 = unlimited.
      prefill_floor_steps: while any sequence is decoding, at least this many steps with decode rows
        and no prefill run between two steps with prefill; 0 = off. "alternate" always uses >= 1.
      chunk_tile: every non-final prefill chunk is a multiple of it (matrix-multiply tile).
      long_prefill_token_threshold: most tokens one sequence's chunk may take per step; 0 = off.
      max_num_partial_prefills: sequences left mid-prefill (prompt partly computed) at once.
      block_size: tokens per KV block.
      num_blocks: KV blocks in the cache.
      watermark_blocks: admitting a new sequence keeps this many blocks free (vLLM semantics);
        running sequences may still grow into them.
      enable_prefix_caching: full KV blocks are cached by content hash and shared between
        sequences with the same prefix (scheduler/prefix.py). Part of the cache geometry: it
        cannot change between steps. False gives exactly the plans of a scheduler without it.
      sliding_window: None, or the window W of a model whose every layer slides (a query at
        position p reads keys (p - W, p]): blocks wholly behind a running sequence's window go
        back to the pool (scheduler/window.py). Part of the cache geometry. None for models
        with a global layer (they read every key), and whenever `kv_cache_groups` is set.
      kv_cache_groups: () for one KV cache group (every layer shares one block table, with
        `sliding_window`); else the attention window of each group, None for full attention
        (a hybrid model: Gemma 2/3). Each running sequence then holds one block table per
        group over the one pool; a sliding group releases the blocks behind its window
        (scheduler/kv_groups.py). Part of the cache geometry.
      num_host_blocks: blocks of the host-memory tier (0 = off; needs prefix caching): a cached
        block the device evicts is copied there instead of being dropped, and a prefix hit on
        it is loaded back (scheduler/host_tier.py). Part of the cache geometry.
      max_loras: LoRA adapters (`Request.adapter`) running at once: the device's adapter
        slots (scheduler/lora_slots.py). Part of the cache geometry (the slots are).
    """

    policy: str = "token_budget"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefill_max_seqs: int = 0
    prefill_floor_steps: int = 0
    chunk_tile: int = 128
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    block_size: int = 16
    num_blocks: int = 4096
    watermark_blocks: int = 0
    enable_prefix_caching: bool = True
    sliding_window: int | None = None
    kv_cache_groups: tuple[int | None, ...] = ()
    num_host_blocks: int = 0
    max_loras: int = 1

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError("enable_prefix_caching",
                              f"must be a bool, got {self.enable_prefix_caching!r}")
        for field, minimum in _INT_MINIMUMS:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(field, f"must be an int, got {value!r}")
            if value < minimum:
                raise ConfigError(field, f"must be >= {minimum}, got {value}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):
            raise ConfigError("sliding_window", f"must be None or an int >= 1, got {window!r}")
        self._check_groups()
        if self.num_host_blocks and not self.enable_prefix_caching:
            raise ConfigError("num_host_blocks", "the host tier keeps evicted prefix-cache "
                              "blocks: it needs enable_prefix_caching=True")
        # NOTE: a non-final chunk must hold at least one tile, else a prompt longer than what is
        # left of the budget could never make progress (liveness).
        if self.max_num_batched_tokens < self.chunk_tile:
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be >= chunk_tile ({self.chunk_tile}), got {self.max_num_batched_tokens}",
            )
        threshold = self.long_prefill_token_threshold
        if threshold and threshold < self.chunk_tile:
            raise ConfigError(
                "long_prefill_token_threshold",
                f"must be 0 (off) or >= chunk_tile ({self.chunk_tile}), got {threshold}",
            )
        if self.watermark_blocks >= self.num_blocks:
            raise ConfigError(
                "watermark_blocks",
                f"must be < num_blocks ({self.num_blocks}), got {self.watermark_blocks}",
            )

    def _check_groups(self) -> None:
        groups = self.kv_cache_groups
        if not isinstance(groups, tuple):
            raise ConfigError("kv_cache_groups", f"must be a tuple, got {groups!r}")
        if not groups:
            return
        if len(groups) > MAX_KV_CACHE_GROUPS:
            raise ConfigError("kv_cache_groups", f"at most {MAX_KV_CACHE_GROUPS} groups, got "
                              f"{len(groups)}", limit=MAX_KV_CACHE_GROUPS)
        for window in groups:
            if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                       or window < 1):
                raise ConfigError("kv_cache_groups",
                                  f"each window must be None or an int >= 1, got {window!r}")
        if self.sliding_window is not None:
            raise ConfigError("sliding_window", "must be None when kv_cache_groups is set "
                              "(the groups carry the windows)")

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The attention window of every KV cache group (None: full attention)."""
        return self.kv_cache_groups or (self.sliding_window,)

    @property
    def num_kv_groups(self) -> int:
        """Block tables per running sequence (one per KV cache group)."""
        return len(self.kv_cache_groups) or 1

    @classmethod
    def from_env(cls, **overrides) -> "SchedulerConfig":
        """Builds a config from `ARC_PREFILL_MAX_SEQS` / `ARC_PREFILL_FLOOR_STEPS`, then `overrides`.

        An unset or empty variable keeps the default; explicit keyword overrides win over the
        environment. A value that is not an integer raises `ConfigError` naming the field.
        """
        values = {}
        for name, field in ENV_FIELDS.items():
            raw = os.environ.get(name, "").strip()
            if not raw:
                continue
            try:
                values[field] = int(raw)
            except ValueError:
                raise ConfigError(field, f"env {name}={raw!r} is not an integer") from None
        values.update(overrides)
        return cls(**values)

    @property
    def max_request_tokens(self) -> int | None:
        """Largest prompt + max_tokens a request may have: the most KV blocks it ever holds at
        once must fit outside the watermark; None when no length reaches that (every group
        slides and chunks are bounded).

        The last sampled token is never fed back, so a request computes at most
        prompt + max_tokens - 1 positions. Without a sliding window it holds one block per
        block_size positions in every group; a sliding group holds at most the blocks of its
        window plus one chunk (scheduler/kv_groups.py, `peak_blocks`).
        """
        if self.sliding_window is None and not self.kv_cache_groups:
            return (self.num_blocks - self.watermark_blocks) * self.block_size + 1
        return max_request_tokens(self)

    def same_cache(self, other: "SchedulerConfig") -> bool:
        """Whether `other` describes the same KV cache and adapter slots (knobs may differ
        between steps)."""
        return all(getattr(self, f) == getattr(other, f) for f in GEOMETRY_FIELDS)


# The fields that describe the device's KV cache and adapter slots: equal in every config a
# state is scheduled with (`SchedulerConfig.same_cache`).
GEOMETRY_FIELDS = ("num_blocks", "block_size", "enable_prefix_caching", "sliding_window",
                   "kv_cache_groups", "num_host_blocks", "max_loras")


def peak_blocks(config: SchedulerConfig, positions: int) -> int:
    """The most blocks a request computing `positions` positions can need at once, alone.

    A full-attention group holds one block per block_size positions. A sliding group of
    window W holds, while a chunk of q tokens runs from cursor c, the blocks of positions
    c - W + 1 .. c + q - 1: at most blocks_for(W + q + block_size - 2) (the worst offset of c
    in its block), where q is the smallest chunk the planner shrinks to (chunk_tile; decodes
    are 1) under the chunked policies, and the whole remainder under "prefill_first".
    """
    bs = config.block_size
    full = blocks_for(positions, bs)
    if config.policy == "prefill_first":  # whole prompts: a chunk may span every position
        return full * config.num_kv_groups
    return sum(full if w is None else min(full, blocks_for(w + config.chunk_tile + bs - 2, bs))
               for w in config.group_windows)


def max_request_tokens(config: SchedulerConfig) -> int | None:
    """`SchedulerConfig.max_request_tokens` with a sliding window: the largest length whose peak
    fits, by bisection over block counts (the peak never shrinks as a request grows)."""
    room, bs = config.num_blocks - config.watermark_blocks, config.block_size
    if peak_blocks(config, room * bs + 1) <= room:  # past room * bs only windows can fit
        return None
    lo, hi = 0, room  # lo * bs positions fit, (hi + 1) * bs do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_blocks(config, mid * bs) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo * bs + 1
