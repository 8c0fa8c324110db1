"""The scheduler's evolving state, and the two entry points that change it outside a step.

Layout (all frozen; a new state shares every part it did not change with the old one):

  waiting   tuple of Sequence, sorted by key (priority, arrival, ticket): not admitted, or preempted.
  partial   tuple of Partial, key order: admitted, prompt partly computed (mid-prefill).
  decoding  DecodeTable: prompt computed, each decode step feeds the last token. Columns, not
            per-sequence records, because a decode step touches every row: one tuple rebuild per
            column beats one record per row (see scripts/bench_scheduler.py).
  pool      BlockPool: the free KV blocks, and the prefix cache (cached blocks, their reference
            counts, the eviction queue). Running sequences hold the rest.

NOTE: invariants (checked by tests every step):
  * a request id is in exactly one of waiting / partial / decoding (or, overlapped with drafts,
    unfilled.verifying);
  * outside a step (not in_flight) a running sequence owns blocks_for(num_computed) entries per
    KV cache group (scheduler/kv_groups.py), and a
    decoding row has num_computed == len(tokens) + len(generated) - 1 (its last token is unfed);
  * every nesting is of bounded depth (no cons lists): states pickle, print and deep-copy;
  * len(partial) <= max_num_partial_prefills outside a step;
  * running sequences use at most `config.max_loras` LoRA adapters (scheduler/lora_slots.py);
  * with prefix caching, a sequence's block_hashes / a decoding row's hashes are the digests of
    its full blocks' tokens, and a block appears in two live tables only if it is cached (shared,
    never written again); the pool's counts say how many hold it (scheduler/prefix.py).
"""

from __future__ import annotations

import bisect
import dataclasses
from itertools import chain
from typing import NamedTuple

from scheduler.blocks import BlockPool, BlockTable
from scheduler.scheduler_config import SchedulerConfig
from scheduler.prefix import chain_hashes, root_digest
from scheduler.scheduler_errors import DuplicateRequestError, RequestError, RequestTooLargeError
from scheduler.scheduler_errors import UnknownRequestError
from scheduler.request import Finished, Request, RequestId, Sequence, SeqKey

# The value of a token sampled by a step whose results have not been committed yet (overlapped
# scheduling, `commit.advance`). Real token ids are >= 0 (`validate_request`).
PLACEHOLDER = -1


def _key_of(seq: Sequence) -> SeqKey:
    return seq.key


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Partial:
    """A sequence admitted but mid-prefill.

    Attributes:
      seq: the sequence; `seq.tokens` is what the prefill computes.
      computed: tokens of `seq.tokens` whose KV is written (the prefill cursor).
      table: its KV blocks (interleaved by KV cache group: scheduler/kv_groups.py).
      num_cached: prompt tokens its admission found cached when that admission ran no chunk
        (it waited for blocks loaded from the host tier); its first chunk reports them.
    """

    seq: Sequence
    computed: int
    table: BlockTable
    num_cached: int = 0


# Generated tokens are kept per row as `recent` (the newest 1..gen_chunk(block_size) tokens,
# oldest first) plus `older` (a tuple of earlier chunks): a decode appends to `recent` (a copy of
# at most one chunk of ints); when the fed token's position is a multiple of the chunk length,
# `recent` moves to `older` (a copy of its references). Those positions open KV blocks too, so
# `schedule` finds them among the rows it already checks. Nesting depth stays constant however
# long a sequence runs (pickle, repr, ==, deepcopy all work).
MIN_GEN_CHUNK = 16


def gen_chunk(block_size: int) -> int:
    """Tokens per `older` chunk: the smallest multiple of block_size >= MIN_GEN_CHUNK."""
    return block_size * -(-MIN_GEN_CHUNK // block_size)


def last_tokens(tokens: tuple[int, ...], older: tuple[tuple[int, ...], ...],
                recent: tuple[int, ...], count: int) -> tuple[int, ...]:
    """The last `count` of tokens + chain(older) + recent, reading only what it needs."""
    parts = [recent]
    have = len(recent)
    j = len(older)
    while have < count and j:
        j -= 1
        parts.append(older[j])
        have += len(older[j])
    if have < count:
        parts.append(tokens[max(0, len(tokens) - (count - have)):])
    return tuple(chain.from_iterable(reversed(parts)))[-count:]


class DecodeRow(NamedTuple):
    """One row being added to a DecodeTable (see its columns)."""

    seq: Sequence
    computed: int
    recent: tuple[int, ...]
    older: tuple[tuple[int, ...], ...]
    hashes: tuple[bytes, ...]
    table: BlockTable


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DecodeTable:
    """Decode-ready sequences as parallel columns; row i of every column is one sequence.

    Rows are in key order (best first), so the most preemptable row is the last.

    Attributes:
      seqs: the sequences.
      ids: their request ids.
      keys: their keys (for ordered insertion).
      limits: num_computed at which each reaches max_tokens.
      computed: num_computed_tokens of each.
      recent: the newest tokens generated since admission, oldest first: 1..gen_chunk(block_size)
        of them (the final prefill chunk sampled one); the last is the token the next decode
        feeds.
      older: the earlier generated tokens, in chunks (each ends at a position that is a multiple
        of gen_chunk(block_size)).
      hashes: prefix-cache hashes of the row's full KV blocks, in order (() with caching off).
      tables: KV block tables.
    """

    seqs: tuple[Sequence, ...] = ()
    ids: tuple[RequestId, ...] = ()
    keys: tuple[SeqKey, ...] = ()
    limits: tuple[int, ...] = ()
    computed: tuple[int, ...] = ()
    recent: tuple[tuple[int, ...], ...] = ()
    older: tuple[tuple[tuple[int, ...], ...], ...] = ()
    hashes: tuple[tuple[bytes, ...], ...] = ()
    tables: tuple[BlockTable, ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def generated(self, row: int) -> tuple[int, ...]:
        """Tokens a row generated since its (re)admission, oldest first."""
        return tuple(chain.from_iterable(self.older[row])) + self.recent[row]

    def last_tokens(self, row: int, count: int) -> tuple[int, ...]:
        """The row's last `count` tokens (of seq.tokens + generated), reading only what it needs."""
        return last_tokens(self.seqs[row].tokens, self.older[row], self.recent[row], count)

    def outputs(self, row: int) -> tuple[int, ...]:
        """All outputs of a row so far (kept across preemptions, then generated since)."""
        return self.seqs[row].kept_outputs() + self.generated(row)

    def row(self, i: int) -> DecodeRow:
        return DecodeRow(self.seqs[i], self.computed[i], self.recent[i], self.older[i],
                         self.hashes[i], self.tables[i])

    def inserted(self, rows: list[DecodeRow]) -> "DecodeTable":
        """Adds rows at their key positions."""
        if not rows:
            return self
        rows = sorted(rows, key=lambda row: row.seq.key)
        if self.keys and rows[0].seq.key < self.keys[-1]:  # rare (priorities): full re-sort
            return DecodeTable().inserted([self.row(i) for i in range(len(self))] + rows)
        seqs = tuple(row.seq for row in rows)
        return DecodeTable(
            seqs=self.seqs + seqs,
            ids=self.ids + tuple(seq.request_id for seq in seqs),
            keys=self.keys + tuple(seq.key for seq in seqs),
            limits=self.limits + tuple(seq.limit for seq in seqs),
            computed=self.computed + tuple(row.computed for row in rows),
            recent=self.recent + tuple(row.recent for row in rows),
            older=self.older + tuple(row.older for row in rows),
            hashes=self.hashes + tuple(row.hashes for row in rows),
            tables=self.tables + tuple(row.table for row in rows),
        )

    def without(self, rows: set[int]) -> "DecodeTable":
        """The table minus `rows` (C-level slices between the removed rows)."""
        if not rows:
            return self
        bounds = [-1, *sorted(rows), len(self.ids)]

        def cut(column: tuple) -> tuple:
            return tuple(chain.from_iterable(
                column[a + 1:b] for a, b in zip(bounds, bounds[1:])))

        return DecodeTable(seqs=cut(self.seqs), ids=cut(self.ids), keys=cut(self.keys),
                           limits=cut(self.limits), computed=cut(self.computed),
                           recent=cut(self.recent), older=cut(self.older),
                           hashes=cut(self.hashes), tables=cut(self.tables))

    def with_progress(self, *, computed: tuple[int, ...] | None = None,
                      recent: tuple[tuple[int, ...], ...] | None = None,
                      older: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
                      hashes: tuple[tuple[bytes, ...], ...] | None = None,
                      tables: tuple[BlockTable, ...] | None = None) -> "DecodeTable":
        """Same rows; the given columns replaced."""
        return DecodeTable(
            seqs=self.seqs, ids=self.ids, keys=self.keys, limits=self.limits,
            computed=self.computed if computed is None else computed,
            recent=self.recent if recent is None else recent,
            older=self.older if older is None else older,
            hashes=self.hashes if hashes is None else hashes,
            tables=self.tables if tables is None else tables)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Unfilled:
    """A step that `advance` folded in with PLACEHOLDER tokens; `commit` of its plan fills them.

    Where the placeholders are: the newest token (`recent[-1]`) of every decode row that sampled
    in that step, the last token of each sequence in `preempted` (sent back to waiting by a later
    plan before the fill), and the last output of each record in `finished`.

    Decode rows that verified draft tokens in that step are not advanced: how many tokens they
    accept is unknown, so they wait in `verifying` (out of the decode table, holding their blocks,
    scheduled by no plan) until the fill applies what they accepted (scheduler/spec.py).

    Attributes:
      step: `plan.state.step` of the advanced plan (what `commit` matches).
      finished: requests that step finished by length; `commit` fills and reports them.
      preempted: ids a later plan preempted while their newest token was a placeholder.
      verifying: decode rows of that step with drafts, as they were planned (cursor before the
        step, table holding the draft positions' blocks).
    """

    step: int
    finished: tuple[Finished, ...] = ()
    preempted: tuple[RequestId, ...] = ()
    verifying: tuple[DecodeRow, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerState:
    """Everything the planner knows between steps.

    Attributes:
      config: the config it was built with; fixes the cache geometry.
      waiting: sequences not running, in key order.
      partial: running sequences mid-prefill, in key order.
      decoding: running, decode-ready sequences.
      pool: free KV blocks.
      step: plans made so far.
      decode_steps_since_prefill: steps with decode rows and no prefill since the last step with
        prefill (the floor counter).
      next_ticket: ticket of the next added request.
      in_flight: a plan was made from this state and awaits `commit` (or `advance`).
      unfilled: None, or the step `advance` folded in whose sampled tokens are still unknown
        (overlapped scheduling: at most one such step; see scheduler/commit.py).
      held: the ids of `request_ids()`, as a set: `add_request`'s duplicate check in O(1)
        (a frozenset copy per change, C speed, instead of walking every queue per call).
      lora_drain: the LoRA adapter whose waiting sequences are held back until its running
        ones finish and free its slot for a slot-blocked one (scheduler/lora_slots.py), or
        None.
    """

    config: SchedulerConfig
    waiting: tuple[Sequence, ...] = ()
    partial: tuple[Partial, ...] = ()
    decoding: DecodeTable = DecodeTable()
    pool: BlockPool
    step: int = 0
    decode_steps_since_prefill: int = 0
    next_ticket: int = 0
    in_flight: bool = False
    unfilled: Unfilled | None = None
    held: frozenset = frozenset()
    lora_drain: int | None = None

    @classmethod
    def empty(cls, config: SchedulerConfig) -> "SchedulerState":
        """A state with no requests and every block free."""
        return cls(config=config, pool=BlockPool.full(
            config.num_blocks, prefix_caching=config.enable_prefix_caching,
            host_blocks=config.num_host_blocks))

    @property
    def verifying(self) -> tuple[DecodeRow, ...]:
        """Decode rows held out of planning until the fill of their drafts' step (overlapped
        scheduling with speculative decoding; see `Unfilled`)."""
        return self.unfilled.verifying if self.unfilled is not None else ()

    @property
    def num_running(self) -> int:
        return len(self.partial) + len(self.decoding) + len(self.verifying)

    def running_adapters(self) -> frozenset[int]:
        """The LoRA adapters (`Request.adapter`) of the running sequences: at most
        `config.max_loras` of them, the ones whose device slots must stay."""
        seqs = (*(p.seq for p in self.partial), *self.decoding.seqs,
                *(row.seq for row in self.verifying))
        return frozenset(s.request.adapter for s in seqs if s.request.adapter is not None)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.partial or len(self.decoding) or self.verifying)

    def request_ids(self) -> tuple[RequestId, ...]:
        """Ids of every request held, waiting first, then mid-prefill, then decoding, then those
        finished by an advanced step whose tokens `commit` has not brought yet."""
        ids = (tuple(s.request_id for s in self.waiting)
               + tuple(p.seq.request_id for p in self.partial) + self.decoding.ids)
        if self.unfilled is not None:
            ids += tuple(f.request_id for f in self.unfilled.finished)
            ids += tuple(row.seq.request_id for row in self.unfilled.verifying)
        return ids

    def owned_blocks(self) -> dict[RequestId, BlockTable]:
        """Block table of every running sequence."""
        owned = {p.seq.request_id: p.table for p in self.partial}
        owned.update(zip(self.decoding.ids, self.decoding.tables))
        owned.update((row.seq.request_id, row.table) for row in self.verifying)
        return owned

    def num_cached(self, request_id: RequestId) -> int:
        """Prompt tokens of a request served from the prefix cache at its first admission (0
        while it waits for that admission, and always with caching off)."""
        for seq in self._sequences():
            if seq.request_id == request_id:
                return seq.cached_tokens or 0
        raise UnknownRequestError(request_id)

    def _sequences(self):
        yield from self.waiting
        yield from (p.seq for p in self.partial)
        yield from self.decoding.seqs
        yield from (row.seq for row in self.verifying)

    def num_computed(self, request_id: RequestId) -> int:
        """The prefill/decode cursor of a request (0 while waiting)."""
        for p in self.partial:
            if p.seq.request_id == request_id:
                return p.computed
        if request_id in self.decoding.ids:
            return self.decoding.computed[self.decoding.ids.index(request_id)]
        if any(s.request_id == request_id for s in self.waiting):
            return 0
        for row in self.verifying:
            if row.seq.request_id == request_id:
                return row.computed
        raise UnknownRequestError(request_id)


_INT_ONLY = frozenset({int})


def validate_request(request: Request, config: SchedulerConfig) -> None:
    """The checks `add_request` makes that do not depend on the state (callers that queue a
    request elsewhere, like the engine's inbox, run them at submission).

    Raises:
      RequestError (RequestTooLargeError for a request that can never fit in the cache).
    """
    rid = request.request_id
    if not isinstance(rid, (int, str)) or isinstance(rid, bool):
        raise RequestError("request_id", f"must be an int or str, got {rid!r}")
    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestError("prompt_token_ids", "must not be empty", limit=1)
    if not (set(map(type, prompt)) <= _INT_ONLY and min(prompt) >= 0):  # C-speed common case
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError("prompt_token_ids",
                                   f"token ids must be ints >= 0, got {token!r}")
    max_tokens = request.max_tokens
    if not isinstance(request.pooling, bool):
        raise RequestError("pooling", f"must be a bool, got {request.pooling!r}")
    if request.pooling:
        if max_tokens != 0 or isinstance(max_tokens, bool):
            raise RequestError("max_tokens", f"must be 0 for a pooling request, got "
                               f"{max_tokens!r}", limit=0)
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens", f"must be an int >= 1, got {max_tokens!r}", limit=1)
    if not isinstance(request.priority, int) or isinstance(request.priority, bool):
        raise RequestError("priority", f"must be an int, got {request.priority!r}")
    adapter = request.adapter
    if adapter is not None and (not isinstance(adapter, int) or isinstance(adapter, bool)
                                or adapter < 0):
        raise RequestError("adapter", f"must be None or an int >= 0, got {adapter!r}")
    if not isinstance(request.arrival_time, (int, float)) or request.arrival_time != request.arrival_time:
        raise RequestError("arrival_time", f"must be a number, got {request.arrival_time!r}")
    limit = config.max_request_tokens
    if limit is not None and len(prompt) + max_tokens > limit:
        raise RequestTooLargeError(
            "max_tokens",
            f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) can never fit in the KV cache: "
            f"the limit is {limit} tokens (its blocks at their peak, every KV cache group "
            f"counted, must fit in num_blocks - watermark_blocks)",
            limit=limit,
        )


def _validate(request: Request, state: SchedulerState) -> None:
    validate_request(request, state.config)
    rid = request.request_id
    if rid in state.held:
        raise DuplicateRequestError("request_id", f"{rid!r} is already waiting or running")


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """Queues a request behind every waiting request of its priority that arrived no later.

    Raises:
      RequestError (a ValueError; subclasses DuplicateRequestError, RequestTooLargeError): empty
        prompt, max_tokens < 1, a duplicate id, or a request that can never fit in the cache.
    """
    _validate(request, state)
    key = (request.priority, float(request.arrival_time), state.next_ticket)
    config = state.config
    hashes = (chain_hashes(request.prompt_token_ids, config.block_size,
                           root_digest(request.adapter))
              if config.enable_prefix_caching and not request.pooling else ())
    seq = Sequence(request=request, key=key, tokens=request.prompt_token_ids, block_hashes=hashes)
    i = bisect.bisect_right(state.waiting, key, key=_key_of)
    return dataclasses.replace(state, waiting=state.waiting[:i] + (seq,) + state.waiting[i:],
                               next_ticket=state.next_ticket + 1,
                               held=state.held | {request.request_id})


def abort(state: SchedulerState, request_id: RequestId) -> SchedulerState:
    """Removes a request, waiting or running, and frees every block it held.

    Allowed while a plan is in flight: `commit` then skips the aborted sequence's rows. A request
    that an advanced step finished (tokens not committed yet) is dropped from that step's records.

    Raises:
      UnknownRequestError (a KeyError): the id is neither waiting nor running.
    """
    if request_id not in state.held:
        raise UnknownRequestError(request_id)
    held = state.held - {request_id}
    for i, seq in enumerate(state.waiting):
        if seq.request_id == request_id:
            return dataclasses.replace(state, waiting=state.waiting[:i] + state.waiting[i + 1:],
                                       held=held)
    for i, part in enumerate(state.partial):
        if part.seq.request_id == request_id:
            return dataclasses.replace(state, partial=state.partial[:i] + state.partial[i + 1:],
                                       pool=state.pool.give(part.table), held=held)
    dec = state.decoding
    if request_id in dec.ids:
        row = dec.ids.index(request_id)
        return dataclasses.replace(state, decoding=dec.without({row}),
                                   pool=state.pool.give(dec.tables[row]), held=held)
    unfilled = state.unfilled
    for i, row in enumerate(unfilled.verifying):
        if row.seq.request_id == request_id:
            return dataclasses.replace(state, unfilled=dataclasses.replace(
                unfilled, verifying=unfilled.verifying[:i] + unfilled.verifying[i + 1:]),
                pool=state.pool.give(row.table), held=held)
    kept = tuple(f for f in unfilled.finished if f.request_id != request_id)
    return dataclasses.replace(state, unfilled=dataclasses.replace(unfilled, finished=kept),
                               held=held)
