"""Presence / frequency / repetition penalties and min_tokens, from a device-resident table.

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
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PROMPT_BIT, STOP_BIT, COUNT_SHIFT = 1, 2, 2


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


@functools.partial(jax.jit, donate_argnames=("counts",))
def _set_row(counts, slot, row):
    return counts.at[slot].set(row)


def table_row(vocab: int, prompt: Sequence[int], outputs: Sequence[int],
              stop_ids: Iterable[int]) -> np.ndarray:
    """One slot's initial contents (host)."""
    row = np.zeros(vocab, np.int32)
    np.add.at(row, np.asarray(outputs, np.int64), 1 << COUNT_SHIFT)
    row[np.asarray(prompt, np.int64)] |= PROMPT_BIT
    stop = np.asarray(list(stop_ids), np.int64)
    row[stop[stop < vocab]] |= STOP_BIT
    return row


class TokenCounts:
    """The device table plus which request owns which slot (host bookkeeping; used by the
    stepping thread only)."""

    def __init__(self, num_slots: int, vocab: int):
        self.num_slots, self.vocab = num_slots, vocab
        self.spare = num_slots
        self.table = jnp.zeros((num_slots + 1, vocab), jnp.int32)
        self._slot_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * num_slots
        self.writes = 0  # host -> device row writes (admissions, re-acquisitions)

    def slot(self, rid: str, busy: set, prompt: Sequence[int], outputs: Sequence[int],
             stop_ids: Iterable[int]) -> int:
        """The slot of `rid`, acquiring and filling one if it has none. `busy`: requests in
        the current step, whose slots must not be taken."""
        s = self._slot_of.get(rid)
        if s is not None:
            return s
        s = next((i for i, o in enumerate(self._owner) if o is None), None)
        if s is None:  # a preempted request's slot: it is rebuilt when it runs again
            s = next(i for i, o in enumerate(self._owner) if o not in busy)
            del self._slot_of[self._owner[s]]
        self._owner[s] = rid
        self._slot_of[rid] = s
        self.table = _set_row(self.table, np.int32(s),
                              table_row(self.vocab, prompt, outputs, stop_ids))
        self.writes += 1
        return s

    def release(self, rid: str) -> None:
        s = self._slot_of.pop(rid, None)
        if s is not None:
            self._owner[s] = None

    def reset(self) -> None:
        """Forgets every slot (after a failed step: the table may have been consumed)."""
        self._slot_of.clear()
        self._owner = [None] * self.num_slots
        self.table = jnp.zeros((self.num_slots + 1, self.vocab), jnp.int32)
