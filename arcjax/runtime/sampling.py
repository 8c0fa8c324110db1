"""Sampling parameters (validated on the host) and per-row sampling on device.

NOTE: reproducibility. Row r's random key is `fold_in(key(seed_r), counter_r)` where
`counter_r` is how many tokens that request has generated so far. It depends on
nothing else in the batch, so a seeded request samples the same tokens whatever it
is batched with, and across preemption (which keeps generated tokens).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.errors import SamplingParamsError


INT32_MAX = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return _is_int(x) or (isinstance(x, (float, np.floating)) and not isinstance(x, bool))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and meanings).

    Every field is checked when the object is built: a wrong type or an out-of-range value
    raises `SamplingParamsError` whose `.field` names it (bool is not accepted as an int,
    floats must be finite, integers must fit the device's int32 arrays; `top_k` larger than
    the vocabulary simply keeps every token). `stop` may be a string, a sequence of
    strings, or None (no stop strings).
    """

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
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
            stop_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise SamplingParamsError("stop", "stop and stop_token_ids must be sequences") from None
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) if _is_int(t) else t
                                                         for t in stop_ids))
        self._check_int("max_tokens", 1, INT32_MAX)
        self._check_float("temperature", 0.0, None)
        self._check_int("top_k", 0, INT32_MAX)
        self._check_float("top_p", 0.0, 1.0, low_open=True)
        self._check_float("min_p", 0.0, 1.0)
        if self.seed is not None:
            self._check_int("seed", 0, 2**32 - 1)
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", f"stop strings must be str, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise SamplingParamsError("stop_token_ids",
                                          f"token ids must be ints >= 0, got {t!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise SamplingParamsError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")

    def _check_int(self, name: str, low: int, high: int) -> None:
        value = getattr(self, name)
        if not _is_int(value):
            raise SamplingParamsError(name, f"must be an int, got {value!r}")
        if not low <= value <= high:
            raise SamplingParamsError(name, f"must be in [{low}, {high}], got {value}",
                                      limit=low if value < low else high)
        object.__setattr__(self, name, int(value))

    def _check_float(self, name: str, low: float, high: float | None,
                     low_open: bool = False) -> None:
        value = getattr(self, name)
        if not _is_number(value) or not math.isfinite(value):
            raise SamplingParamsError(name, f"must be a finite number, got {value!r}")
        bad_low = value <= low if low_open else value < low
        if bad_low or (high is not None and value > high):
            span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
            raise SamplingParamsError(name, f"must be in {span}, got {value}",
                                      limit=low if bad_low else high)
        object.__setattr__(self, name, float(value))


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
