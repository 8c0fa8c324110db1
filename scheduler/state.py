"""The scheduler's evolving state, and the two entry points that change it outside a step.

Layout (all frozen; a new state shares every part it did not change with the old one):

  waiting   tuple of Sequence, sorted by key (priority, arrival, ticket): not admitted, or preempted.
  partial   tuple of Partial, key order: admitted, prompt partly computed (mid-prefill).
  decoding  DecodeTable: prompt computed, each decode step feeds the last token. Columns, not
            per-sequence records, because a decode step touches every row: one tuple rebuild per
            column beats one record per row (see scripts/bench_scheduler.py).
  pool      BlockPool: the free KV blocks. Running sequences own the rest.

NOTE: invariants (checked by tests every step):
  * a request id is in exactly one of waiting / partial / decoding;
  * outside a step (not in_flight) a running sequence owns blocks_for(num_computed) blocks, and a
    decoding row has num_computed == len(tokens) + len(generated) - 1 (its last token is unfed);
  * len(partial) <= max_num_partial_prefills outside a step.
"""

from __future__ import annotations

import bisect
import dataclasses
from itertools import chain

from scheduler.blocks import BlockPool, BlockTable
from scheduler.config import SchedulerConfig
from scheduler.errors import DuplicateRequestError, RequestError, RequestTooLargeError
from scheduler.errors import UnknownRequestError
from scheduler.request import Request, RequestId, Sequence, SeqKey, TokenStack, stack_to_tuple


def _key_of(seq: Sequence) -> SeqKey:
    return seq.key


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Partial:
    """A sequence admitted but mid-prefill.

    Attributes:
      seq: the sequence; `seq.tokens` is what the prefill computes.
      computed: tokens of `seq.tokens` whose KV is written (the prefill cursor).
      table: its KV blocks.
    """

    seq: Sequence
    computed: int
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
      gens: tokens generated since admission, newest first; never empty (the final prefill chunk
        sampled one), and the newest is the token the next decode feeds.
      tables: KV block tables.
    """

    seqs: tuple[Sequence, ...] = ()
    ids: tuple[RequestId, ...] = ()
    keys: tuple[SeqKey, ...] = ()
    limits: tuple[int, ...] = ()
    computed: tuple[int, ...] = ()
    gens: tuple[TokenStack, ...] = ()
    tables: tuple[BlockTable, ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def outputs(self, row: int) -> tuple[int, ...]:
        """All outputs of a row so far (kept across preemptions, then generated since)."""
        return self.seqs[row].kept_outputs() + stack_to_tuple(self.gens[row])

    def inserted(self, rows: list[tuple[Sequence, int, TokenStack, BlockTable]]) -> "DecodeTable":
        """Adds (sequence, computed, gens, table) rows at their key positions."""
        if not rows:
            return self
        rows = sorted(rows, key=lambda row: row[0].key)
        if self.keys and rows[0][0].key < self.keys[-1]:  # rare (priorities): full re-sort
            old = zip(self.seqs, self.computed, self.gens, self.tables)
            return DecodeTable().inserted(list(old) + rows)
        seqs = tuple(row[0] for row in rows)
        return DecodeTable(
            seqs=self.seqs + seqs,
            ids=self.ids + tuple(seq.request_id for seq in seqs),
            keys=self.keys + tuple(seq.key for seq in seqs),
            limits=self.limits + tuple(seq.limit for seq in seqs),
            computed=self.computed + tuple(row[1] for row in rows),
            gens=self.gens + tuple(row[2] for row in rows),
            tables=self.tables + tuple(row[3] for row in rows),
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
                           gens=cut(self.gens), tables=cut(self.tables))

    def with_progress(self, computed: tuple[int, ...], gens: tuple[TokenStack, ...],
                      tables: tuple[BlockTable, ...]) -> "DecodeTable":
        """Same rows, new cursors, generated tokens and tables."""
        return DecodeTable(seqs=self.seqs, ids=self.ids, keys=self.keys, limits=self.limits,
                           computed=computed, gens=gens, tables=tables)


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
      in_flight: a plan was made from this state and awaits `commit`.
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

    @classmethod
    def empty(cls, config: SchedulerConfig) -> "SchedulerState":
        """A state with no requests and every block free."""
        return cls(config=config, pool=BlockPool.full(config.num_blocks))

    @property
    def num_running(self) -> int:
        return len(self.partial) + len(self.decoding)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.partial or len(self.decoding))

    def request_ids(self) -> tuple[RequestId, ...]:
        """Ids of every request held, waiting first, then mid-prefill, then decoding."""
        return (tuple(s.request_id for s in self.waiting)
                + tuple(p.seq.request_id for p in self.partial) + self.decoding.ids)

    def owned_blocks(self) -> dict[RequestId, BlockTable]:
        """Block table of every running sequence."""
        owned = {p.seq.request_id: p.table for p in self.partial}
        owned.update(zip(self.decoding.ids, self.decoding.tables))
        return owned

    def num_computed(self, request_id: RequestId) -> int:
        """The prefill/decode cursor of a request (0 while waiting)."""
        for p in self.partial:
            if p.seq.request_id == request_id:
                return p.computed
        if request_id in self.decoding.ids:
            return self.decoding.computed[self.decoding.ids.index(request_id)]
        if any(s.request_id == request_id for s in self.waiting):
            return 0
        raise UnknownRequestError(request_id)


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
    for token in prompt:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise RequestError("prompt_token_ids", f"token ids must be ints >= 0, got {token!r}")
    max_tokens = request.max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens", f"must be an int >= 1, got {max_tokens!r}", limit=1)
    if not isinstance(request.priority, int) or isinstance(request.priority, bool):
        raise RequestError("priority", f"must be an int, got {request.priority!r}")
    if not isinstance(request.arrival_time, (int, float)) or request.arrival_time != request.arrival_time:
        raise RequestError("arrival_time", f"must be a number, got {request.arrival_time!r}")
    limit = config.max_request_tokens
    if len(prompt) + max_tokens > limit:
        raise RequestTooLargeError(
            "max_tokens",
            f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) can never fit in the KV cache: "
            f"the limit is {limit} tokens ((num_blocks - watermark_blocks) * block_size + 1)",
            limit=limit,
        )


def _validate(request: Request, state: SchedulerState) -> None:
    validate_request(request, state.config)
    rid = request.request_id
    if rid in state.request_ids():
        raise DuplicateRequestError("request_id", f"{rid!r} is already waiting or running")


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """Queues a request behind every waiting request of its priority that arrived no later.

    Raises:
      RequestError (a ValueError; subclasses DuplicateRequestError, RequestTooLargeError): empty
        prompt, max_tokens < 1, a duplicate id, or a request that can never fit in the cache.
    """
    _validate(request, state)
    key = (request.priority, float(request.arrival_time), state.next_ticket)
    seq = Sequence(request=request, key=key, tokens=request.prompt_token_ids)
    i = bisect.bisect_right(state.waiting, key, key=_key_of)
    return dataclasses.replace(state, waiting=state.waiting[:i] + (seq,) + state.waiting[i:],
                               next_ticket=state.next_ticket + 1)


def abort(state: SchedulerState, request_id: RequestId) -> SchedulerState:
    """Removes a request, waiting or running, and frees every block it held.

    Allowed while a plan is in flight: `commit` then skips the aborted sequence's rows.

    Raises:
      UnknownRequestError (a KeyError): the id is neither waiting nor running.
    """
    for i, seq in enumerate(state.waiting):
        if seq.request_id == request_id:
            return dataclasses.replace(state, waiting=state.waiting[:i] + state.waiting[i + 1:])
    for i, part in enumerate(state.partial):
        if part.seq.request_id == request_id:
            return dataclasses.replace(state, partial=state.partial[:i] + state.partial[i + 1:],
                                       pool=state.pool.give(part.table))
    dec = state.decoding
    if request_id in dec.ids:
        row = dec.ids.index(request_id)
        return dataclasses.replace(state, decoding=dec.without({row}),
                                   pool=state.pool.give(dec.tables[row]))
    raise UnknownRequestError(request_id)
