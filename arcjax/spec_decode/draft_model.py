"""Draft-model proposals: a smaller model with the target's vocabulary drafts greedily.

The draft model has its own paged KV cache and its own compiled steps (a `ModelRunner` over
its params): one slot per request being drafted for, slot s owning the fixed block range
[s * P, (s + 1) * P) (P blocks hold max_model_len + k + 1 positions), slots reused least
recently used first. The scheduler's blocks are never touched.

One `propose` call for a batch of rows:
  1. Each slot remembers the tokens whose KV it holds (`fed`); the longest common prefix with
     the row's known tokens is still valid (rejected drafts and wrong guesses are not), so
     the row feeds only what follows it: after a verification, typically its newest one or
     two tokens; after its prompt, the whole prompt (chunked to the token budget per pass).
  2. The logits after the last known token give the first draft (greedy); k - 1 one-token
     passes give the others (plus one per `pending` token, whose guess comes first).
Drafts are deterministic (argmax), so the target verifies them with the point-mass rejection
sampler (verification.py): outputs are exact whatever the draft model is.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from arcjax.runtime.batching import PreparedStep, build_batch
from arcjax.runtime.buckets import BucketSet
from arcjax.runtime.executable_cache import ExecutableCache
from arcjax.runtime.runner import ModelRunner
from arcjax.runtime.sampling import SamplingBatch
from arcjax.sampling_params import SamplingParams
from arcjax.spec_decode.speculative_config import ProposalRow

_GREEDY = SamplingParams(temperature=0.0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class DraftModelProposer:
    """Greedy drafts from a draft model (vLLM's "draft_model" method); see the module doc."""

    def __init__(self, cfg, params, *, num_slots: int, max_model_len: int, max_drafts: int,
                 block_size: int, token_budget: int, tile: int, dtype, attn_impl: str,
                 executables: ExecutableCache | None = None):
        self.per_slot = -(-(max_model_len + max_drafts + 1) // block_size)
        self.budget = token_budget
        self.runner = ModelRunner(
            cfg, params, num_blocks=num_slots * self.per_slot, block_size=block_size,
            max_blocks_per_seq=self.per_slot, dtype=dtype, attn_impl=attn_impl,
            buckets=BucketSet.create(tile=tile, max_tokens=token_budget, max_seqs=num_slots),
            executables=executables)
        self.num_slots = num_slots
        self.fed: list[list[int]] = [[] for _ in range(num_slots)]  # KV each slot holds
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU first
        self.passes = 0  # draft model steps run (for benchmarks)

    def release(self, request_id: str) -> None:
        """Frees the request's slot."""
        self._slots.pop(request_id, None)

    def reset(self) -> None:
        """Forgets every slot's KV (rebuilding the cache if a failed call consumed it)."""
        self._slots.clear()
        self.fed = [[] for _ in range(self.num_slots)]
        if self.runner.cache_lost():
            self.runner.reset_cache()

    def _slot(self, rid: str, busy: set) -> int:
        slot = self._slots.get(rid)
        if slot is not None:
            self._slots.move_to_end(rid)
            return slot
        taken = set(self._slots.values())
        slot = next((s for s in range(self.num_slots) if s not in taken), None)
        if slot is None:  # evict the least recently used request not in this batch
            victim = next(r for r in self._slots if r not in busy)
            slot = self._slots.pop(victim)
        self._slots[rid] = slot
        self.fed[slot] = []
        return slot

    def _table(self, slot: int, num_tokens: int) -> tuple[int, ...]:
        first = slot * self.per_slot
        return tuple(range(first, first + -(-num_tokens // self.runner.block_size)))

    def _run(self, chunks: list[tuple[int, int, Sequence[int]]]) -> list[int]:
        """One draft step over (slot, start, tokens) chunks; the greedy token after each."""
        runner = self.runner
        starts = [start for _, start, _ in chunks]
        lengths = [len(tokens) for _, _, tokens in chunks]
        tables = [self._table(slot, start + n) for (slot, start, _), n in zip(chunks, lengths)]
        bucket = runner.buckets.select(sum(lengths), len(chunks), max(lengths) == 1)
        batch = build_batch([t for _, _, tokens in chunks for t in tokens], starts, lengths,
                            tables, bucket=bucket, max_blocks=self.per_slot,
                            block_size=runner.block_size, num_blocks=runner.num_blocks)
        sampling = SamplingBatch.build([(_GREEDY, 0, 0)] * len(chunks), bucket.seqs,
                                       runner.counts.spare)
        out = runner.run(PreparedStep(bucket, batch, sampling))
        self.passes += 1
        for (slot, start, tokens) in chunks:
            del self.fed[slot][start:]
            self.fed[slot].extend(tokens)
        return [int(t) for t in out.tokens[:len(chunks)]]

    def propose(self, rows: Sequence[ProposalRow], k: int) -> list[tuple[int, ...]]:
        """k greedy drafts per row (after its `pending` guesses); see the module docstring.
        Rows beyond the slots get none."""
        rows = list(rows)
        if not rows:
            return []
        spare = [()] * max(0, len(rows) - self.num_slots)
        rows = rows[:self.num_slots]
        busy = {row.request_id for row in rows}
        slots = [self._slot(row.request_id, busy) for row in rows]
        # 1. catch up: feed each row's known tokens after its valid prefix, budget per pass
        todo = {}
        for i, (row, slot) in enumerate(zip(rows, slots)):
            valid = min(_common_prefix(self.fed[slot], row.tokens), len(row.tokens) - 1)
            todo[i] = valid
        nxt = [0] * len(rows)
        while todo:
            chunks, owners, room = [], [], self.budget
            for i, start in list(todo.items()):
                if room == 0:
                    break
                tokens = rows[i].tokens[start:start + room]
                chunks.append((slots[i], start, tokens))
                owners.append(i)
                room -= len(tokens)
            for i, token, (_, start, tokens) in zip(owners, self._run(chunks), chunks):
                if start + len(tokens) == len(rows[i].tokens):
                    nxt[i] = token
                    del todo[i]
                else:
                    todo[i] = start + len(tokens)
        # 2. one token per pass: the pending guesses, then the drafts
        out = [[t] for t in nxt]
        for _ in range(max(row.pending for row in rows) + k - 1):
            live = [i for i, row in enumerate(rows) if len(out[i]) < row.pending + k]
            chunks = [(slots[i], len(rows[i].tokens) + len(out[i]) - 1, [out[i][-1]])
                      for i in live]
            for i, token in zip(live, self._run(chunks)):
                out[i].append(token)
        return [tuple(o[row.pending:]) for o, row in zip(out, rows)] + spare
