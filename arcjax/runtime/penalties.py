"""Penalties, min_tokens and per-request logit biases, from device-resident tables.

NOTE: the choice. Each request that uses penalties or min_tokens owns a row ("slot") of one
int32 table `[num_slots + 1, V]` that lives on the device next to the KV cache; the last
row is a spare that rows without penalties point at (never read with a non-neutral
penalty, never written). A table entry packs three things about one token of one request:
  bit 0    PROMPT: the token occurs in the prompt (repetition_penalty)
  bit 1    STOP:   a stop token id or EOS, masked while fewer than min_tokens are generated
  bits 2+  COUNT:  occurrences among the generated tokens (presence/frequency/repetition)
A step gathers its rows' table rows ([S, V], the same size as the logits), applies vLLM's
formulas and scatters +1 into COUNT for each sampled token, all inside the jitted step: no
history is re-read, nothing goes back to the host per token. A slot is written from the
host only when a request first gets one (or lost it to another request while preempted):
one `[V]` row built from its prompt, stop ids and the tokens it generated so far.

Why not a padded per-row bag of seen ids: its width grows with the history, so every step
would re-send (or re-read) whole histories and the bucket would need another dimension.
The table costs (max_num_seqs + 1) * V * 4 bytes (8 seqs x 384 ids here; 256 x 150k = 154 MB
for a large vocabulary) and one [S, V] gather per step that has a penalized row.

NOTE: the bias table. A float32 table of the same shape holds each slot's bias row:
logit_bias values, -inf outside allowed_token_ids and at one-token bad words (docs/decisions/
0013-logit-bias-table.md). A row that uses it (`SamplingBatch.biased`) adds its slot's row to
its logits before penalties; like the counts, it is written from the host only when a
request gets its slot. `TokenTables` carries both tables as one pytree through the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PROMPT_BIT, STOP_BIT, COUNT_SHIFT = 1, 2, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenTables:
    """The device tables, one row per slot plus the spare (donated through every step)."""

    counts: jax.Array  # [slots + 1, V] int32: PROMPT / STOP bits and output counts
    bias: jax.Array  # [slots + 1, V] float32: added to a biased row's logits

    @classmethod
    def unbiased(cls, counts) -> "TokenTables":
        """`counts` with a bias table of zeros (no row biased)."""
        return cls(counts, jnp.zeros(jnp.shape(counts), jnp.float32))


def apply_bias(logits: jax.Array, bias: jax.Array, sp) -> jax.Array:
    """logits [S, V] plus each biased row's slot row of `bias` [slots + 1, V]."""
    return jnp.where(sp.biased[:, None], logits + bias[sp.slot], logits)


def apply_penalties(logits: jax.Array, counts: jax.Array, sp,
                    pending: jax.Array | None = None) -> jax.Array:
    """vLLM's penalties, then the min_tokens mask. logits [S, V]; sp: a SamplingBatch;
    pending: None, or [S, V] occurrences to count as generated on top of the table's
    (speculative decoding: the drafts before a verified position)."""
    rows = counts[sp.slot]  # [S, V] int32
    if pending is not None:
        rows = rows + (pending << COUNT_SHIFT)
    n = (rows >> COUNT_SHIFT).astype(jnp.float32)  # occurrences in the output
    seen = ((rows & PROMPT_BIT) != 0) | (n > 0)
    rep = sp.repetition[:, None]
    lg = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    lg = lg - sp.frequency[:, None] * n - sp.presence[:, None] * (n > 0)
    banned = ((rows & STOP_BIT) != 0) & (sp.counter < sp.min_tokens)[:, None]
    return jnp.where(banned, -jnp.inf, lg)


def count_sampled(counts: jax.Array, slot: jax.Array, tokens: jax.Array,
                  penalized: jax.Array) -> jax.Array:
    """Adds each penalized row's sampled token to its COUNT."""
    return counts.at[slot, tokens].add(jnp.where(penalized, 1 << COUNT_SHIFT, 0))


@functools.partial(jax.jit, donate_argnames=("tables",))
def _set_rows(tables: TokenTables, slot, counts_row, bias_row) -> TokenTables:
    return TokenTables(tables.counts.at[slot].set(counts_row),
                       tables.bias.at[slot].set(bias_row))


def table_row(vocab: int, prompt: Sequence[int], outputs: Sequence[int],
              stop_ids: Iterable[int]) -> np.ndarray:
    """One slot's initial contents (host)."""
    row = np.zeros(vocab, np.int32)
    np.add.at(row, np.asarray(outputs, np.int64), 1 << COUNT_SHIFT)
    row[np.asarray(prompt, np.int64)] |= PROMPT_BIT
    stop = np.asarray(list(stop_ids), np.int64)
    row[stop[stop < vocab]] |= STOP_BIT
    return row


def bias_row(vocab: int, logit_bias: Mapping[int, float] | None = None,
             allowed: Sequence[int] | None = None, banned: Iterable[int] = ()) -> np.ndarray:
    """One slot's bias row (host): `logit_bias` at its ids, -inf outside `allowed` (None:
    nothing outside) and at `banned`. Ids must be in the vocabulary (the engine checks)."""
    row = np.zeros(vocab, np.float32)
    if allowed is not None:
        row[:] = -np.inf
        row[np.asarray(allowed, np.int64)] = 0.0
    for token, value in (logit_bias or {}).items():
        row[token] += value
    row[np.asarray(list(banned), np.int64)] = -np.inf
    return row


class TokenCounts:
    """The device tables (`table`, a `TokenTables`) plus which request owns which slot (host
    bookkeeping; used by the stepping thread only)."""

    def __init__(self, num_slots: int, vocab: int):
        self.num_slots, self.vocab = num_slots, vocab
        self.spare = num_slots
        self.table = self._empty()
        self._slot_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * num_slots
        self.writes = 0  # host -> device row writes (admissions, re-acquisitions)

    def _empty(self) -> TokenTables:
        shape = (self.num_slots + 1, self.vocab)
        return TokenTables(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32))

    def slot(self, rid: str, busy: set, prompt: Sequence[int], outputs: Sequence[int],
             stop_ids: Iterable[int], bias: np.ndarray | None = None) -> int:
        """The slot of `rid`, acquiring and filling one if it has none. `busy`: requests in
        the current step, whose slots must not be taken; `bias`: its bias row (`bias_row`;
        None: zeros)."""
        s = self._slot_of.get(rid)
        if s is not None:
            return s
        s = next((i for i, o in enumerate(self._owner) if o is None), None)
        if s is None:  # a preempted request's slot: it is rebuilt when it runs again
            s = next(i for i, o in enumerate(self._owner) if o not in busy)
            del self._slot_of[self._owner[s]]
        self._owner[s] = rid
        self._slot_of[rid] = s
        self.table = _set_rows(self.table, np.int32(s),
                               table_row(self.vocab, prompt, outputs, stop_ids),
                               bias if bias is not None else np.zeros(self.vocab, np.float32))
        self.writes += 1
        return s

    def has_slot(self, rid: str) -> bool:
        return rid in self._slot_of

    def release(self, rid: str) -> None:
        s = self._slot_of.pop(rid, None)
        if s is not None:
            self._owner[s] = None

    def reset(self) -> None:
        """Forgets every slot (after a failed step: the table may have been consumed)."""
        self._slot_of.clear()
        self._owner = [None] * self.num_slots
        self.table = self._empty()
