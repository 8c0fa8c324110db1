"""Per-row sampling on device: penalties, min_tokens, temperature, filters, log-probabilities.

One jitted step samples every row with no host round trip (`sample_step`):
  0. the grammar bitmask (structured outputs): tokens a constrained row's grammar forbids
     get -inf; only when some row is constrained (the others' rows are all ones);
  1. raw log-probabilities (log_softmax of those logits), only when a row asks;
  2. the row's bias (logit_bias, allowed_token_ids, bad words: the bias table), then
     penalties and min_tokens from the token-count table (`penalties.py`), each only when
     a row uses it;
  3. temperature, top-k / top-p / min-p, Gumbel-max draw (greedy rows: argmax);
  4. the sampled tokens are counted into the table (rows that use it).
Each optional stage sits behind a `lax.cond` on "some row needs it", so a greedy batch
pays for an argmax and the predicates only.

NOTE: reproducibility. Row r's random key is `fold_in(key(seed_r), counter_r)` where
`counter_r` is how many tokens that request has generated so far. It depends on
nothing else in the batch, so a seeded request samples the same tokens whatever it
is batched with, and across preemption (which keeps generated tokens). Penalties read
only the row's own table row, so they keep that property.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.model.row_tiles import RowTiles
from arcjax.runtime.penalties import TokenTables, apply_bias, apply_penalties, count_sampled
from arcjax.sampling_params import MAX_LOGPROBS


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
    presence: jax.Array  # [S] float32 presence_penalty
    frequency: jax.Array  # [S] float32 frequency_penalty
    repetition: jax.Array  # [S] float32 repetition_penalty
    min_tokens: jax.Array  # [S] int32
    slot: jax.Array  # [S] int32 row of the token tables (the spare row when unused)
    penalized: jax.Array  # [S] bool: reads and updates its count-table row
    logprobs: jax.Array  # [S] bool: returns log-probabilities
    constrained: jax.Array  # [S] bool: structured output (its bitmask row is not all ones)
    biased: jax.Array  # [S] bool: adds its bias-table row to its logits

    @classmethod
    def build(cls, rows: list[tuple], size: int, spare_slot: int = 0) -> "SamplingBatch":
        """rows: (params, seed, counter[, slot]) per sequence, `slot` None or absent when the
        row uses no token table; padded to `size` with greedy rows."""
        temp = np.zeros(size, np.float32)
        top_k = np.zeros(size, np.int32)
        top_p = np.ones(size, np.float32)
        min_p = np.zeros(size, np.float32)
        seed = np.zeros(size, np.uint32)
        counter = np.zeros(size, np.int32)
        presence = np.zeros(size, np.float32)
        frequency = np.zeros(size, np.float32)
        repetition = np.ones(size, np.float32)
        min_tokens = np.zeros(size, np.int32)
        slot = np.full(size, spare_slot, np.int32)
        penalized = np.zeros(size, bool)
        logprobs = np.zeros(size, bool)
        constrained = np.zeros(size, bool)
        biased = np.zeros(size, bool)
        for i, row in enumerate(rows):
            p, s, c = row[:3]
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            seed[i], counter[i] = s, c
            logprobs[i] = p.logprobs is not None
            # a grammar, or multi-token bad words (the host mask: engine/input_processor.py)
            constrained[i] = p.structured_outputs is not None or bool(p.bad_words)
            if len(row) > 3 and row[3] is not None:
                slot[i] = row[3]
                penalized[i], biased[i] = p.uses_penalty_state, p.uses_token_bias
                presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
                repetition[i], min_tokens[i] = p.repetition_penalty, p.min_tokens
        return cls(temp, top_k, top_p, min_p, seed, counter, presence, frequency, repetition,
                   min_tokens, slot, penalized, logprobs, constrained, biased)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Raw log-probabilities at some positions (rows), K = min(20, V) candidates each."""

    logprob: jax.Array  # [R] float32, of the row's token (sampled, or the next prompt token)
    rank: jax.Array  # [R] int32, 1 = the most likely token
    top_ids: jax.Array  # [R, K] int32, most likely first
    top_logprobs: jax.Array  # [R, K] float32


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """logits [R, V] float32, tokens [R] int32 -> raw log-probabilities of those tokens and
    the top K per row."""
    lse = jax.nn.logsumexp(logits, axis=-1)  # [R]; log_softmax is never materialized
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [R]
    rank = 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32)
    top, top_ids = jax.lax.top_k(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    return TokenLogprobs(chosen - lse, rank, top_ids.astype(jnp.int32), top - lse[:, None])


def empty_logprobs(rows: int, vocab: int) -> TokenLogprobs:
    k = min(MAX_LOGPROBS, vocab)
    return TokenLogprobs(jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32),
                         jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32))


def logprobs_if(need: jax.Array, logits: jax.Array, tokens: jax.Array,
                rows: RowTiles | None = None) -> TokenLogprobs:
    """`token_logprobs` when `need` (a traced bool), else zeros (a greedy step skips it);
    over fixed row tiles with `rows` (batch-invariant mode)."""
    def compute():
        if rows is None:
            return token_logprobs(logits, tokens)
        return rows.map(token_logprobs, logits, tokens)

    return jax.lax.cond(need, compute, lambda: empty_logprobs(*logits.shape))


def sample_rows(logits: jax.Array, sp: SamplingBatch, rows: RowTiles | None) -> jax.Array:
    """`sample`, or with `rows` (batch-invariant mode) `sample` of each row alone: its
    optional stages (the filter's fast path or bisection, whether noise is drawn) then
    follow the row, never its neighbours."""
    if rows is None:
        return sample(logits, sp)
    return rows.with_tile(1).map(sample, logits, sp)


_BISECT_STEPS = 40  # halvings of [-1, max prob]: the boundary to ~1e-12 of the top prob
_CANDIDATES = 64  # the fast path finds the top-k / top-p boundary among this many tokens


def _filter_mask(scaled: jax.Array, sp: SamplingBatch, rows: jax.Array,
                 weight: jax.Array | None = None) -> jax.Array:
    """Tokens kept by top-k, top-p and min-p, in vocabulary order. scaled: [S, V]; rows:
    [S] bool, the rows that filter (the others may get any mask); weight: exp(scaled -
    row max), if the caller has it.

    No full sort (an [S, V] sort costs ~60x a greedy step's sampling on CPU): top-k and
    top-p keep exactly the tokens whose probability is at least a threshold c (the smallest
    p_t with count(p > p_t) < k and mass(p > p_t) < top_p; both tests are monotone in p).
    Fast path: when every filtering row's boundary lies among its top `_CANDIDATES` tokens
    (top_k <= 64, or those tokens hold top_p of the mass), c is read off `lax.top_k`.
    Otherwise a bisection on c (one count and one masked sum over [S, V] per halving).
    Tokens tied with the boundary token are all kept (a stable sort would keep lower ids
    first). min-p is a direct threshold.
    """
    if weight is None:
        weight = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    total = jnp.sum(weight, axis=-1, keepdims=True)  # [S, 1]
    probs = weight / total  # [S, V]
    pmax = 1.0 / total[:, 0]  # [S]: the top token's weight is 1
    k = sp.top_k
    kc = min(_CANDIDATES, scaled.shape[-1])
    top, _ = jax.lax.top_k(probs, kc)  # [S, kc], best first
    mass = jnp.cumsum(top, axis=-1)
    ok = ((k[:, None] == 0) | (jnp.arange(kc)[None, :] < k[:, None])) & (mass - top < sp.top_p[:, None])
    n_kept = jnp.sum(ok, axis=-1)  # >= 1: the top token is always kept
    unbounded = (k == 0) & (sp.top_p >= 1)  # min-p only: no top-k/top-p threshold
    fits = ((k > 0) & (k <= kc)) | (mass[:, -1] >= sp.top_p) | unbounded | ~rows

    def fast():
        c = jnp.take_along_axis(top, (n_kept - 1)[:, None], axis=-1)  # [S, 1]
        return probs >= jnp.where(unbounded[:, None], 0.0, c)

    def bisect():
        def kept(x):  # [S] -> [S]: would a token of probability x be kept?
            above = probs > x[:, None]
            ok_k = (k == 0) | (jnp.sum(above, axis=-1) < k)
            return ok_k & (jnp.sum(jnp.where(above, probs, 0.0), axis=-1) < sp.top_p)

        def halve(_, bounds):
            lo, hi = bounds  # kept(hi) holds, kept(lo) does not (or lo = -1: all kept)
            mid = 0.5 * (lo + hi)
            ok = kept(mid)
            return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

        lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, halve, (jnp.full_like(pmax, -1.0), pmax))
        return probs > lo[:, None]

    keep = jax.lax.cond(jnp.all(fits), fast, bisect)
    keep &= probs >= sp.min_p[:, None] * pmax[:, None]
    return keep | ~rows[:, None]  # rows that do not filter keep every token


def sample(logits: jax.Array, sp: SamplingBatch) -> jax.Array:
    """logits [S, V] float32 -> token ids [S] int32; temperature 0 rows are greedy.

    Random rows draw by an exponential race, `argmax_i p_i / E_i` with E_i ~ Exp(1): the
    Gumbel-max trick with one log per token instead of two (3x cheaper on CPU), same
    distribution. The noise is indexed by vocabulary id, so a row's draw is the same
    whether or not the filter path ran for the batch. The filter runs only when some row
    uses top-k/top-p/min-p, the noise only when some row samples at all. (No penalties
    here: `sample_step` applies them first.)
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    random_row = sp.temperature > 0
    filtered_row = random_row & ((sp.top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0))

    def draw(_):
        scaled = logits / jnp.where(random_row, sp.temperature, 1.0)[:, None]
        weight = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # [S, V]
        keep = jax.lax.cond(jnp.any(filtered_row),
                            lambda: _filter_mask(scaled, sp, filtered_row, weight),
                            lambda: jnp.ones(scaled.shape, bool))
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(
            sp.seed, sp.counter)
        # E = -log(u), u in [tiny, 1): E > 0 always (jax.random.exponential can return 0)
        noise = -jnp.log(jax.vmap(lambda k: jax.random.uniform(
            k, scaled.shape[-1:], minval=jnp.finfo(jnp.float32).tiny))(keys))  # [S, V]
        return jnp.argmax(jnp.where(keep, weight / noise, -1.0), axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(random_row), draw, lambda _: greedy, None)
    return jnp.where(random_row, drawn, greedy)


def bitmask_words(vocab: int) -> int:
    """int32 words of one row's packed token bitmask."""
    return (vocab + 31) // 32


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [S, V] with -inf wherever the packed bitmask [S, ceil(V / 32)] int32 has a 0
    bit (bit t % 32 of word t // 32: llguidance's layout)."""
    rows, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0  # [S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def adjust_logits(logits: jax.Array, sp: SamplingBatch, tables: TokenTables,
                  pending: Callable[[], jax.Array] | None = None) -> jax.Array:
    """The biases, then the penalties and min_tokens, each only when some row uses it.
    `pending`: builds `apply_penalties`' pending counts (speculative verification), inside
    the penalties' branch only."""
    logits = jax.lax.cond(jnp.any(sp.biased), lambda: apply_bias(logits, tables.bias, sp),
                          lambda: logits)
    return jax.lax.cond(
        jnp.any(sp.penalized),
        lambda: apply_penalties(logits, tables.counts, sp, pending() if pending else None),
        lambda: logits)


def sample_step(logits: jax.Array, sp: SamplingBatch, tables: TokenTables,
                bitmask: jax.Array | None = None, rows: RowTiles | None = None):
    """The step's sampling. logits [S, V] float32; tables: the token tables (`penalties.py`,
    donated by the caller); bitmask: [S, ceil(V / 32)] int32, the tokens each row may sample
    (all ones for rows without structured outputs), or None (no row is constrained: known
    when tracing); rows: None, or the live rows' fixed tiles (batch-invariant mode:
    `sample_rows`, `logprobs_if`).

    Returns:
      (tokens [S] int32, TokenLogprobs of the sampled tokens (zeros unless some row asked),
       the updated tables).
    """
    if bitmask is not None:
        logits = jax.lax.cond(jnp.any(sp.constrained),
                              lambda: apply_bitmask(logits, bitmask), lambda: logits)
    tokens = sample_rows(adjust_logits(logits, sp, tables), sp, rows)
    logprobs = logprobs_if(jnp.any(sp.logprobs), logits, tokens, rows)
    counts = count_sampled(tables.counts, sp.slot, tokens, sp.penalized)
    return tokens, logprobs, dataclasses.replace(tables, counts=counts)
