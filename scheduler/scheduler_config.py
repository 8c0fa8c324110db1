"""Static scheduler settings: one frozen, keyword-only dataclass, validated when built."""

from __future__ import annotations

import dataclasses
import os

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
    ("max_loras", 1),
)


# The fields that describe the device's KV cache and adapter slots: they cannot change
# between steps (`SchedulerConfig.same_cache`).
GEOMETRY_FIELDS = ("num_blocks", "block_size", "enable_prefix_caching", "sliding_window",
                   "max_loras")


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
        with a global layer (they read every key).
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
    def max_request_tokens(self) -> int:
        """Largest prompt + max_tokens a request may have: its KV must fit outside the watermark.

        The last sampled token is never fed back, so a request computes at most
        prompt + max_tokens - 1 positions.
        """
        return (self.num_blocks - self.watermark_blocks) * self.block_size + 1

    def same_cache(self, other: "SchedulerConfig") -> bool:
        """Whether `other` describes the same KV cache and adapter slots (knobs may differ
        between steps)."""
        return all(getattr(self, f) == getattr(other, f) for f in GEOMETRY_FIELDS)
