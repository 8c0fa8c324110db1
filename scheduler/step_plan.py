"""What `schedule` returns: the step's rows as columns, the knobs that engaged, the next state.

Rows are ordered: first the decode rows (each samples), then the prefill chunks. A decode row has
length 1 + its draft tokens (speculative decoding, `spec_token_ids`): it feeds its newest token and
then the drafts, and samples at each of those positions (`sample_counts`).
The columns are what the engine builds its arrays from (`token_ids[T]`, `cu_seqlens_q[S+1]`,
`kv_lens[S]`, `block_tables[S, max_blocks]`); `chunks` is the same data as one record per row.
Token ids are views: the plan keeps references to the sequences' token tuples and slices them
only when `token_ids`, `row_token_ids` or `chunks` is read.
"""

from __future__ import annotations

import dataclasses
import itertools
from itertools import chain
from operator import itemgetter

from scheduler.blocks import BlockTable
from scheduler.kv_groups import group_tables
from scheduler.metrics import step_kind
from scheduler.request import RequestId
from scheduler.state import SchedulerState


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """One row of a step: `length` tokens of one sequence starting at position `start`.

    Attributes:
      request_id: the sequence.
      start: position of the chunk's first token (= its num_computed_tokens before the step).
      length: tokens in the chunk; 1 for a decode.
      samples: whether this row samples a token (decode rows and final prefill chunks only).
      token_ids: the chunk's tokens.
      block_table: the sequence's KV blocks, allocated for start + length tokens.
      num_cached: tokens served from the prefix cache (positions 0 .. num_cached - 1, already in
        shared blocks) if the sequence was admitted this step, else 0.
      spec_token_ids: draft tokens verified by this (decode) row: the last len() of `token_ids`.
    """

    request_id: RequestId
    start: int
    length: int
    samples: bool
    token_ids: tuple[int, ...]
    block_table: BlockTable
    num_cached: int = 0
    spec_token_ids: tuple[int, ...] = ()

    @property
    def kv_len(self) -> int:
        """Keys this row attends over, its own tokens included."""
        return self.start + self.length


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Engaged:
    """What each knob did this step; zero / False / () means it did not engage.

    Attributes:
      cap_deferred: prefill_max_seqs was reached; this many waiting sequences stayed waiting.
      floor_held: prefill work waited for the decode floor (prefill_floor_steps, or the decode turn
        of "alternate").
      budget_full_at: max_num_batched_tokens stopped or shortened work; the step's token count.
      seqs_full: max_num_seqs stopped admissions or decode rows.
      decodes_deferred: decode-ready sequences that got no token this step.
      preempted: ids preempted (recompute) for KV blocks, in preemption order.
      tile_trimmed: chunks shortened to a multiple of chunk_tile.
      long_prefill_capped: chunks capped by long_prefill_token_threshold.
      partial_limit: max_num_partial_prefills stopped an admission.
      partials_held: mid-prefill sequences that got no chunk (budget or blocks); admissions then
        wait too, so a later arrival never takes the room an earlier prompt needs.
      block_limited: KV blocks (watermark included) stopped or shortened a prefill chunk or admission.
      oversize_prompt: legacy whole-prompt prefill ran one lone prompt longer than the budget.
      drafts_trimmed: decode rows whose draft tokens the budget or the KV blocks (watermark
        kept) shortened or dropped.
      lora_deferred: waiting sequences of LoRA adapters passed over: no adapter slot was
        free, or their adapter drains to free one (scheduler/lora_slots.py).
    """

    cap_deferred: int = 0
    floor_held: bool = False
    budget_full_at: int = 0
    seqs_full: bool = False
    decodes_deferred: int = 0
    preempted: tuple[RequestId, ...] = ()
    tile_trimmed: int = 0
    long_prefill_capped: int = 0
    partial_limit: bool = False
    partials_held: int = 0
    block_limited: bool = False
    oversize_prompt: bool = False
    drafts_trimmed: int = 0
    lora_deferred: int = 0

    def as_dict(self) -> dict[str, object]:
        """Every knob and its detail (JSON-friendly: tuples become lists)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    def active(self) -> tuple[str, ...]:
        """Names of the knobs that engaged, for counting in a trace."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))


NOTHING_ENGAGED = Engaged()
_newest_token = itemgetter(-1)
NO_DRAFTS: tuple = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """One engine step.

    Attributes:
      state: the state after planning (blocks allocated, preemptions and admissions applied,
        cursors not yet advanced); pass it to `commit` with the step's results. An empty plan
        leaves nothing in flight: its state may be scheduled again directly.
      request_ids, starts, lengths, samples, block_tables: one entry per row, in row order.
      num_cached: per row, prompt tokens skipped because the prefix cache held them (rows admitted
        this step; 0 otherwise). Such a row starts at num_cached.
      num_decode_rows: the first rows that are decodes.
      num_sampled: rows that sample (decode rows and final prefill chunks).
      num_tokens: tokens in the step (sum of lengths).
      spec_token_ids: per decode row, the draft tokens it verifies (() for none); `()` as a
        whole when no row has any. A row with d drafts has length 1 + d and samples at each of
        its 1 + d positions; `commit` takes 1 .. 1 + d tokens for it (what it accepted).
      preempted: ids preempted this step (back to the front of the waiting queue).
      engaged: what each knob did.
      _decode_recent, _prefill_sources: where the rows' token ids come from (shared with the
        state, so planning copies no tokens); read them through `token_ids`, `row_token_ids`
        or `chunks`.
      _decode_flush: decode rows whose generated tokens `commit` moves to `older` (found while
        planning, among the rows that open a KV block).
      kv_stores: host tier (scheduler/host_tier.py): (device block, host slot) of every cached
        block this plan evicts whose KV moves to the host; the runner copies them out before
        the step runs (the step may overwrite them).
      kv_loads: (host slot, device block) of every block this plan loads back; the runner
        copies them in after launching the step and before the next step runs.
      loading: requests admitted by this plan that run no chunk until the next step, when the
        blocks they wait for (loaded, or shared with a load) hold their KV.
    """

    state: SchedulerState
    request_ids: tuple[RequestId, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    samples: tuple[bool, ...]
    block_tables: tuple[BlockTable, ...]
    num_cached: tuple[int, ...]
    num_decode_rows: int
    num_sampled: int
    num_tokens: int
    preempted: tuple[RequestId, ...]
    engaged: Engaged
    spec_token_ids: tuple[tuple[int, ...], ...]
    _decode_recent: tuple[tuple[int, ...], ...]
    _decode_flush: tuple[int, ...]
    _prefill_sources: tuple[tuple[int, ...], ...]
    kv_stores: tuple[tuple[int, int], ...] = ()
    kv_loads: tuple[tuple[int, int], ...] = ()
    loading: tuple[RequestId, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decode rows (their drafts included)."""
        return self.num_decode_rows + self.num_spec_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens the step verifies (0 without speculation)."""
        return sum(map(len, self.spec_token_ids))

    def row_spec_token_ids(self, row: int) -> tuple[int, ...]:
        """The draft tokens row `row` verifies (() for prefill rows and plain decodes)."""
        return self.spec_token_ids[row] if row < len(self.spec_token_ids) else NO_DRAFTS

    @property
    def sample_counts(self) -> tuple[int, ...]:
        """Per row, the positions it samples at: 1 + drafts for a decode row, 1 for a final
        prefill chunk, 0 for a non-final one. They are the row's last positions."""
        counts = tuple(map(int, self.samples))
        if not self.spec_token_ids:
            return counts
        k = len(self.spec_token_ids)
        return tuple(1 + len(d) for d in self.spec_token_ids) + counts[k:]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the prefix cache saved this step (sum of num_cached)."""
        return sum(self.num_cached)

    @property
    def is_empty(self) -> bool:
        """No row runs and no block moves: nothing for the engine to execute."""
        return not self.request_ids and not self.kv_loads and not self.kv_stores

    @property
    def moves_only(self) -> bool:
        """No row runs but blocks move (loads for requests that wait for them)."""
        return not self.request_ids and bool(self.kv_loads or self.kv_stores)

    def group_block_tables(self, num_groups: int) -> tuple[tuple[BlockTable, ...], ...]:
        """Per KV cache group, every row's table (`kv_groups.group_tables` of each row)."""
        if num_groups == 1:
            return (self.block_tables,)
        rows = [group_tables(t, num_groups) for t in self.block_tables]
        return tuple(tuple(row[g] for row in rows) for g in range(num_groups))

    @property
    def kind(self) -> str:
        """"prompt" (prefill only), "mixed", "decode" (decode only) or "idle": metrics.step_kind."""
        return step_kind(self.num_prefill_tokens, self.num_decode_rows)

    @property
    def decode_only(self) -> bool:
        """Every row has length 1 and there is at least one row.

        A final prefill chunk of length 1 counts: to the kernels it is the same one-query row as a
        decode (its `kind` may still say "mixed" or "prompt").
        """
        return bool(self.request_ids) and self.num_tokens == len(self.request_ids)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Prefix sums of row lengths: row i's tokens are token_ids[cu[i]:cu[i + 1]]."""
        return (0,) + tuple(itertools.accumulate(self.lengths))

    @property
    def kv_lens(self) -> tuple[int, ...]:
        """Keys each row attends over, its own tokens included."""
        return tuple(s + n for s, n in zip(self.starts, self.lengths))

    def row_token_ids(self, row: int) -> tuple[int, ...]:
        """The tokens row `row` feeds to the model."""
        k = self.num_decode_rows
        if row < k:
            return (self._decode_recent[row][-1],) + self.row_spec_token_ids(row)
        start = self.starts[row]
        return self._prefill_sources[row - k][start:start + self.lengths[row]]

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every row's tokens, concatenated in row order (built on each access)."""
        k = self.num_decode_rows
        if self.spec_token_ids:
            decodes = chain.from_iterable(
                ((recent[-1],) + drafts) for recent, drafts in zip(
                    self._decode_recent, self.spec_token_ids))
        else:
            decodes = map(_newest_token, self._decode_recent)
        return tuple(chain(
            decodes,
            *(tokens[start:start + n] for tokens, start, n in zip(
                self._prefill_sources, self.starts[k:], self.lengths[k:]))))

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The rows as records (built on each access; the columns are the fast path)."""
        return tuple(
            Chunk(request_id=rid, start=start, length=length, samples=samples,
                  token_ids=self.row_token_ids(i), block_table=table, num_cached=cached,
                  spec_token_ids=self.row_spec_token_ids(i))
            for i, (rid, start, length, samples, table, cached) in enumerate(zip(
                self.request_ids, self.starts, self.lengths, self.samples, self.block_tables,
                self.num_cached))
        )
