"""The mechanics of one step, shared by every policy: decode rows, partial prefills, admissions.

`policies.schedule` decides which of the three phases a step runs; `StepBuilder` runs them in this
order and then assembles the plan:

  1. run_decodes: decode-ready rows in key order, one token each, within the budget and
     max_num_seqs. A row opening a new block takes one from the pool; if the pool is empty the
     lowest-ranked running sequence not yet scheduled (largest key) is preempted, possibly the row
     itself (vLLM's rule).
  2. run_partials: mid-prefill sequences in key order, one chunk each (whole in legacy mode), while
     rows stay within max_num_seqs (it may shrink between steps below the running count). A
     chunk shrinks to the free blocks; if not even a minimal chunk fits, lower-ranked unscheduled
     sequences are preempted, but only when that makes room. A partial is never preempted for
     itself: it waits, holding its blocks.
  3. admit (scheduler/admission.py): waiting sequences in key order, FCFS, after their
     cached prefix (prefix caching), loading what only the host tier holds; a LoRA sequence
     waiting for an adapter slot may be passed (scheduler/lora_slots.py: a drain keeps it
     from starving).
  4. build: draft tokens on the decode rows with what is left (`spec.allocate_drafts`), then the
     plan's columns and the post-schedule state.

NOTE: the builder mutates only its own scratch (lists, counters); every input stays untouched.
NOTE: a cached (shared) block is never written: hits are full blocks before the sequence's
cursor, and its chunks write only blocks taken fresh from the pool.
NOTE: victims always come from the tail of a key-ordered collection, so the decode rows a step
schedules are always a prefix of the (post-preemption) decode table; `commit` relies on it.
NOTE: with `sliding_window` (every layer slides), each running sequence's blocks wholly behind
its window are released before anything is allocated (scheduler/window.py), and admissions
reuse a cached prefix as far as the window needs it; with `kv_cache_groups` the same happens
per sliding group, and every block index takes one block per group (scheduler/kv_groups.py).
"""

from __future__ import annotations

import dataclasses
import heapq
from itertools import compress, repeat
from operator import mod, not_

from scheduler.blocks import BlockTable, blocks_for
from scheduler.admission import Admissions
from scheduler.kv_groups import slide_groups
from scheduler.scheduler_config import SchedulerConfig
from scheduler.step_plan import Engaged, NOTHING_ENGAGED, StepPlan
from scheduler.prefix import chain_hashes, root_digest
from scheduler.request import Sequence, SeqKey
from scheduler.spec import Drafts, allocate_drafts
from scheduler.state import PLACEHOLDER, Partial, SchedulerState, gen_chunk
from scheduler.window import slide

_key_of_seq = lambda seq: seq.key  # noqa: E731
_key_of_partial = lambda part: part.seq.key  # noqa: E731


class StepBuilder(Admissions):
    """Scratch space for one `schedule` call; never escapes it. Phase 3 (admissions) is
    `Admissions`, scheduler/admission.py."""

    def __init__(self, state: SchedulerState, config: SchedulerConfig, drafts: Drafts = None):
        self.state = state
        self.config = config
        self.drafts = drafts  # proposed draft tokens by request id, or None
        self.dec = state.decoding
        self.partial = list(state.partial)  # key order; entries get their allocated tables
        self.pool = state.pool
        self.budget = config.max_num_batched_tokens
        self.num_decode_rows = 0
        self.opening: list[int] = []  # decode rows whose token opens a KV block
        self.prefill_rows: list[tuple[Partial, int]] = []  # (sequence after allocation, length)
        self.cached: list[int] = []  # per prefill row: tokens served from the cache (admissions)
        self.admitted: list[Partial] = []
        self.waiting_from = 0  # state.waiting[waiting_from:] is still waiting
        self.passed: list[Sequence] = []  # before waiting_from, passed over for an adapter slot
        self.lora_drain = state.lora_drain
        self.preempted: list[Sequence] = []
        self.preempted_unfilled: list = []  # of them, ids whose newest token is a placeholder
        self.partials_after = len(state.partial)  # mid-prefill once this step commits
        self.engaged: dict[str, object] = {}
        self.slid = False  # a sliding window released blocks of some partial prefill
        self.groups = config.num_kv_groups  # blocks per block index (scheduler/kv_groups.py)
        self.loads: list[tuple[int, int]] = []  # (host slot, device block) this plan loads
        self.loading: list[Sequence] = []  # admitted, waiting for loads until the next step
        self.loading_blocks: set[int] = set()  # device blocks this plan loads
        if self.groups > 1:
            self.dec, self.pool, self.slid = slide_groups(
                self.dec, self.partial, self.pool, config.group_windows, config.block_size)
        elif config.sliding_window is not None:
            self.dec, self.pool, self.slid = slide(self.dec, self.partial, self.pool,
                                                   config.sliding_window, config.block_size)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _note(self, knob: str, value: object = True) -> None:
        self.engaged[knob] = value

    def _count(self, knob: str) -> None:
        self.engaged[knob] = self.engaged.get(knob, 0) + 1

    def hold_for_floor(self) -> None:
        """Records that prefill work waits for the decode floor this step (engaged.floor_held)."""
        self._note("floor_held")

    @property
    def num_rows(self) -> int:
        return self.num_decode_rows + len(self.prefill_rows)

    @property
    def num_tokens(self) -> int:
        return self.config.max_num_batched_tokens - self.budget

    def _size(self, remaining: int, by_blocks: int) -> tuple[int, tuple[str, ...]]:
        """Chunk length for a sequence with `remaining` prompt tokens (0 = no progress possible).

        Bounded by the budget, long_prefill_token_threshold and `by_blocks`; a non-final chunk is
        cut down to a multiple of chunk_tile. Also returns the knobs that shortened it, for
        `_use` to record once the chunk is actually scheduled.
        """
        threshold = self.config.long_prefill_token_threshold or remaining
        n = min(remaining, self.budget, threshold, by_blocks)
        if n == remaining:
            return n, ()
        if n == by_blocks and by_blocks < min(self.budget, threshold):
            reasons = ("block_limited",)
        elif n == threshold and threshold < self.budget:
            reasons = ("long_prefill_capped",)
        else:
            reasons = ("budget_full_at",)
        trimmed = n - n % self.config.chunk_tile
        if trimmed != n and trimmed:
            reasons += ("tile_trimmed",)
        return trimmed, reasons

    def _use(self, reasons: tuple[str, ...]) -> None:
        """Records the knobs that shaped a scheduled chunk (or stopped one)."""
        for knob in reasons:
            if knob in ("long_prefill_capped", "tile_trimmed"):
                self._count(knob)
            else:
                self._note(knob)

    def _whole(self, remaining: int, by_blocks: int) -> int:
        """Legacy whole-prompt chunk: all `remaining` tokens, or 0 if the blocks cannot hold them.

        Called only when the prompt fits the budget or is the step's first row: a lone prompt
        longer than the budget runs alone (legacy prefill cannot split it).
        """
        if remaining > by_blocks:
            self._note("block_limited")
            return 0
        if remaining > self.budget:
            self._note("oversize_prompt")
        return remaining

    def _tokens_by_blocks(self, computed: int, table_len: int, free: int) -> int:
        """Tokens a sequence can still schedule with its table's blocks plus `free` more (a
        block index takes one block per KV cache group)."""
        G = self.groups
        return (table_len // G + free // G) * self.config.block_size - computed

    # ---- preemption --------------------------------------------------------------------------

    def _lowest_victim(self, key: SeqKey, dec_from: int, partial_from: int) -> str | None:
        """Which collection holds the lowest-ranked unscheduled sequence ranked below `key`.

        Candidates are decode rows >= dec_from and partials >= partial_from; both collections are
        key-ordered, so only their last entries compete. Returns "decode", "partial" or None.
        """
        best, where = key, None
        if len(self.dec) > dec_from and self.dec.keys[-1] > best:
            best, where = self.dec.keys[-1], "decode"
        if len(self.partial) > partial_from and self.partial[-1].seq.key > best:
            where = "partial"
        return where

    def _preempt(self, where: str) -> None:
        """Preempts the last sequence of `where` by recompute: blocks freed, back to waiting."""
        if where == "decode":
            dec = self.dec
            seq = dec.seqs[-1]
            kept = seq.tokens + dec.generated(len(dec) - 1)
            if kept[-1] == PLACEHOLDER:  # overlapped: `commit` of the advanced step fills it
                self.preempted_unfilled.append(seq.request_id)
            hashes = dec.hashes[-1]
            if self.pool.cache is not None:  # digests of the kept tokens' full blocks
                parent = hashes[-1] if hashes else root_digest(seq.request.adapter)
                hashes += chain_hashes(kept, self.config.block_size, parent, len(hashes))
            self.preempted.append(Sequence(request=seq.request, key=seq.key, tokens=kept,
                                           block_hashes=hashes, cached_tokens=seq.cached_tokens))
            self.pool = self.pool.give(dec.tables[-1])
            self.dec = dec.without({len(dec) - 1})
        else:
            part = self.partial.pop()
            self.preempted.append(part.seq)
            self.pool = self.pool.give(part.table)
            self.partials_after -= 1

    def _reclaimable(self, key: SeqKey, dec_from: int, partial_from: int) -> int:
        """Blocks that preempting every unscheduled sequence ranked below `key` would free (a
        shared cached block only if all its holders are among them)."""
        dec = self.dec
        tables = [dec.tables[i] for i in range(dec_from, len(dec)) if dec.keys[i] > key]
        tables += [p.table for p in self.partial[partial_from:] if p.seq.key > key]
        return self.pool.releasable(tables)

    # ---- 1. decodes --------------------------------------------------------------------------

    def run_decodes(self) -> None:
        """Schedules decode rows: a key-order prefix of the decode table, one token each."""
        dec = self.dec
        n = min(len(dec), self.budget, self.config.max_num_seqs)
        bs = self.config.block_size
        computed = dec.computed
        # rows whose token opens a block (computed % bs == 0), iterated at C speed
        opening = list(compress(range(n), map(not_, map(mod, computed[:n], repeat(bs, n)))))
        self.opening = opening
        G = self.groups
        if len(opening) * G <= self.pool.num_free:
            if opening:
                blocks, self.pool = self.pool.take(len(opening) * G)
                tables = list(dec.tables)
                if G == 1:
                    for row, block in zip(opening, blocks):
                        tables[row] += (block,)
                else:  # one block per group, interleaved (scheduler/kv_groups.py)
                    for j, row in enumerate(opening):
                        tables[row] += blocks[j * G:(j + 1) * G]
                self.dec = dec.with_progress(tables=tuple(tables))
        else:
            n = self._decodes_under_pressure(n, opening)
        self.num_decode_rows = n
        self.budget -= n
        deferred = len(self.dec) - n
        if deferred:
            self._note("decodes_deferred", deferred)
            if n == self.config.max_num_seqs:
                self._note("seqs_full")
            elif self.budget == 0:
                self._note("budget_full_at")

    def _decodes_under_pressure(self, n: int, opening: list[int]) -> int:
        """Allocates one block index per opening row, preempting when the pool runs dry;
        returns rows."""
        for row in opening:
            if row >= n:
                break
            while self.pool.num_free < self.groups:
                where = self._lowest_victim(self.dec.keys[row], row + 1, 0)
                if where is None:  # the row itself ranks lowest: it is the last decode row
                    self._preempt("decode")
                    return row
                self._preempt(where)
                n = min(n, len(self.dec))
            block, self.pool = self.pool.take(self.groups)
            dec = self.dec
            tables = dec.tables[:row] + (dec.tables[row] + block,) + dec.tables[row + 1:]
            self.dec = dec.with_progress(tables=tables)
        return n

    # ---- 2. partial prefills -----------------------------------------------------------------

    def run_partials(self, whole: bool) -> None:
        """Continues mid-prefill sequences in key order: chunks (or whole remainders, legacy)."""
        j = 0
        while j < len(self.partial):
            part = self.partial[j]
            if self.num_rows >= self.config.max_num_seqs:  # max_num_seqs shrank between steps
                self._note("seqs_full")
                self._count("partials_held")
                j += 1
                continue
            n = self._partial_chunk(j, part, whole)
            if n:
                table = self._grow(part.table, part.computed + n)
                cached = part.num_cached  # an admission that waited for its loads reports them
                part = Partial(seq=part.seq, computed=part.computed, table=table)
                self.partial[j] = part
                self._add_prefill_row(part, n, cached)
                if part.computed + n == len(part.seq.tokens):
                    self.partials_after -= 1
            else:
                self._count("partials_held")
            j += 1

    def _partial_chunk(self, j: int, part: Partial, whole: bool) -> int:
        """Chunk length for partial j, preempting lower-ranked sequences if it cannot move at all."""
        remaining = len(part.seq.tokens) - part.computed
        if whole:
            if remaining > self.budget and self.num_rows:
                self._note("budget_full_at")
                return 0
            minimal = remaining
        else:
            n, reasons = self._size(remaining, remaining)
            if not n:
                self._use(reasons)
                return 0
            minimal = min(remaining, self.config.chunk_tile)
        G = self.groups
        need = (blocks_for(part.computed + minimal, self.config.block_size)
                - len(part.table) // G) * G
        if need > self.pool.num_free:
            key = part.seq.key
            if self.pool.num_free + self._reclaimable(key, self.num_decode_rows, j + 1) < need:
                self._note("block_limited")
                return 0
            while self.pool.num_free < need:
                self._preempt(self._lowest_victim(key, self.num_decode_rows, j + 1))
        by_blocks = self._tokens_by_blocks(part.computed, len(part.table), self.pool.num_free)
        if whole:
            return self._whole(remaining, by_blocks)
        n, reasons = self._size(remaining, by_blocks)
        self._use(reasons)
        return n

    def _grow(self, table: BlockTable, num_tokens: int) -> BlockTable:
        """`table` extended to hold `num_tokens` (the blocks must be free)."""
        need = blocks_for(num_tokens, self.config.block_size) * self.groups - len(table)
        if need <= 0:
            return table
        blocks, self.pool = self.pool.take(need)
        return table + blocks

    def _add_prefill_row(self, part: Partial, n: int, cached: int = 0) -> None:
        self.prefill_rows.append((part, n))
        self.cached.append(cached)
        self.budget -= n

    def _decode_flush(self) -> tuple[int, ...]:
        """Decode rows whose fed position ends a generated-token chunk (a subset of `opening`)."""
        chunk, computed = gen_chunk(self.config.block_size), self.dec.computed
        k = self.num_decode_rows
        return tuple(i for i in self.opening if i < k and not computed[i] % chunk)

    # ---- 4. the plan -------------------------------------------------------------------------

    def build(self) -> StepPlan:
        """Attaches draft tokens, then assembles the plan and the post-schedule state."""
        spec = ()
        if self.drafts and self.num_decode_rows:
            self.dec, self.pool, spec, used, trimmed = allocate_drafts(
                self.dec, self.num_decode_rows, self.drafts, self.pool, self.budget, self.config)
            self.budget -= used
            if trimmed:
                self._note("drafts_trimmed", trimmed)
        state, dec, k = self.state, self.dec, self.num_decode_rows
        rows = self.prefill_rows
        if rows:
            since = 0
        elif k:
            since = state.decode_steps_since_prefill + 1
        else:
            since = state.decode_steps_since_prefill
        if rows or self.slid or self.admitted or len(self.partial) != len(state.partial):
            partial = tuple(heapq.merge(self.partial, self.admitted, key=_key_of_partial))
        else:  # no chunk ran, nobody was preempted: the partial prefills are unchanged
            partial = state.partial
        waiting = state.waiting[self.waiting_from:]
        if self.passed:  # each passed sequence ranks before every one not reached
            waiting = tuple(self.passed) + waiting
        if self.preempted:
            preempted = sorted(self.preempted, key=_key_of_seq)
            waiting = tuple(heapq.merge(preempted, waiting, key=_key_of_seq))
        unfilled = state.unfilled
        if self.preempted_unfilled:
            unfilled = dataclasses.replace(unfilled, preempted=unfilled.preempted + tuple(
                self.preempted_unfilled))
        pool, stores = self.pool, self.pool.stores
        if pool.host is not None and (stores or self.loads):
            pool = dataclasses.replace(pool, stores=(), host=pool.host.unpinned(
                [slot for slot, _ in self.loads]))
        new_state = SchedulerState(
            config=state.config, waiting=waiting, partial=partial, decoding=dec, pool=pool,
            step=state.step + 1, decode_steps_since_prefill=since,
            next_ticket=state.next_ticket, in_flight=bool(k or rows or self.loads),
            unfilled=unfilled, held=state.held, lora_drain=self.lora_drain)
        preempted_ids = tuple(seq.request_id for seq in self.preempted)
        if preempted_ids:
            self._note("preempted", preempted_ids)
        engaged = self.engaged
        if "budget_full_at" in engaged:
            engaged["budget_full_at"] = self.num_tokens
        # prefill rows as columns: ids, starts, lengths, samples, tables, token sources; a
        # pooling sequence's final chunk samples nothing
        parts = [part for part, _ in rows]
        finals = tuple(part.computed + n == len(part.seq.tokens) and not part.seq.request.pooling
                       for part, n in rows)
        return StepPlan(
            state=new_state,
            request_ids=dec.ids[:k] + tuple(part.seq.request.request_id for part in parts),
            starts=dec.computed[:k] + tuple(part.computed for part in parts),
            lengths=(tuple(1 + len(d) for d in spec) if spec else (1,) * k) + tuple(
                n for _, n in rows),
            samples=(True,) * k + finals,
            block_tables=dec.tables[:k] + tuple(part.table for part in parts),
            num_cached=(0,) * k + tuple(self.cached),
            num_decode_rows=k,
            num_sampled=k + finals.count(True),
            num_tokens=self.num_tokens,
            preempted=preempted_ids,
            engaged=Engaged(**engaged) if engaged else NOTHING_ENGAGED,
            spec_token_ids=spec,
            _decode_recent=dec.recent[:k],
            _decode_flush=self._decode_flush(),
            _prefill_sources=tuple(part.seq.tokens for part in parts),
            kv_stores=stores,
            kv_loads=tuple(self.loads),
            loading=tuple(seq.request_id for seq in self.loading),
        )
