"""Sampling parameters (validated on the host) and per-row sampling on device.

NOTE: reproducibility. Row r's random key is `fold_in(key(seed_r), counter_r)` where
`counter_r` is how many tokens that request has generated so far. It depends on
nothing else in the batch, so a seeded request samples the same tokens whatever it
is batched with, and across preemption (which keeps generated tokens).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names the field and the limit."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise SamplingParamsError(f"seed must be in [0, 2**32), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs, padded to the sequence bucket S."""

    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32
    top_p: jax.Array  # [S] float32
    min_p: jax.Array  # [S] float32
    seed: jax.Array  # [S] uint32
    counter: jax.Array  # [S] int32, tokens generated so far by the row's request

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, int]], size: int) -> "SamplingBatch":
        """rows: (params, seed, counter) per sequence; padded to `size` with greedy rows."""
        temp = np.zeros(size, np.float32)
        top_k = np.zeros(size, np.int32)
        top_p = np.ones(size, np.float32)
        min_p = np.zeros(size, np.float32)
        seed = np.zeros(size, np.uint32)
        counter = np.zeros(size, np.int32)
        for i, (p, s, c) in enumerate(rows):
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            seed[i], counter[i] = s, c
        return cls(temp, top_k, top_p, min_p, seed, counter)


def _filter_mask(scaled: jax.Array, sp: SamplingBatch) -> jax.Array:
    """Tokens kept by top-k, top-p and min-p, in vocabulary order. scaled: [S, V]."""
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # [S, V], best first
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    ranks = jnp.arange(scaled.shape[-1])[None, :]
    keep = (sp.top_k[:, None] == 0) | (ranks < sp.top_k[:, None])
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < sp.top_p[:, None]  # mass before token
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]
    rows = jnp.arange(scaled.shape[0])[:, None]
    return jnp.zeros_like(keep).at[rows, order].set(keep)


def sample(logits: jax.Array, sp: SamplingBatch) -> jax.Array:
    """logits [S, V] float32 -> token ids [S] int32; temperature 0 rows are greedy.

    Random rows use the Gumbel-max trick with noise indexed by vocabulary id, so a
    row's draw is the same whether or not the (sorting) filter path ran for the batch.
    The sort runs only when some row uses top-k/top-p/min-p, the noise only when some
    row samples at all.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    random_row = sp.temperature > 0
    filtered_row = random_row & ((sp.top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0))

    def draw(_):
        scaled = logits / jnp.where(random_row, sp.temperature, 1.0)[:, None]
        keep = jax.lax.cond(jnp.any(filtered_row), lambda: _filter_mask(scaled, sp),
                            lambda: jnp.ones(scaled.shape, bool))
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(
            sp.seed, sp.counter)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, scaled.shape[-1:]))(keys)  # [S, V]
        return jnp.argmax(jnp.where(keep, scaled + noise, -jnp.inf), axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(random_row), draw, lambda _: greedy, None)
    return jnp.where(random_row, drawn, greedy)
