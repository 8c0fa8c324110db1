"""Speculative decoding in the engine core: drafts before each plan, tokens per row after.

  1. `Speculator.drafts(state, requests)`: before planning, when the step starts with at most
     `disable_by_batch_size` running requests, the proposer (n-gram on the host, or the
     draft model) drafts up to k tokens for every decode-ready row from the tokens known then
     (overlapped scheduling: a row whose newest token is still on the device is `pending`).
     The planner fits them in what the step leaves (scheduler/spec.py). A request with
     structured outputs keeps the drafts its grammar accepts (`RequestGrammar.valid_prefix`;
     with its newest token in flight, all of them: see `drafts`).
  2. The jitted step verifies them (runtime/verification.py); `row_tokens` reads what
     each row yielded: 1 + its accepted drafts.
  3. The core appends them one by one (`OutputProcessor.append`: a stop cuts the row
     there), commits each row's kept tokens, records the step's draft / accepted counts in
     its trace record (`SpecCounts.of`) and adds them to each request when it applies the
     step.
"""

from __future__ import annotations

import dataclasses

import scheduler
from arcjax.spec_decode.speculative_config import ProposalRow, Proposer, SpeculativeConfig


@dataclasses.dataclass
class SpecCounts:
    """One step's speculative decoding counts (the trace record's `spec_*` fields)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, plan: scheduler.StepPlan, rows: dict[int, list[int]]) -> "SpecCounts":
        """The counts of `rows` (plan row -> the tokens it yielded) of a collected step."""
        counts = cls()
        for i, tokens in rows.items():
            drafts = plan.row_spec_token_ids(i)
            if drafts:
                counts.add(len(drafts), len(tokens) - 1)
        return counts

    def add(self, num_drafts: int, accepted: int) -> None:
        """A row that verified `num_drafts` drafts and accepted `accepted` of them."""
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += accepted
        self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def record_fields(self) -> dict:
        return dict(spec_drafts=self.drafts, spec_draft_tokens=self.draft_tokens,
                    spec_accepted_tokens=self.accepted_tokens,
                    spec_accepted_per_pos=tuple(self.accepted_per_pos))


class Speculator:
    """The proposer and its switch (stepping thread)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens

    def drafts(self, state: scheduler.SchedulerState, requests: dict) -> dict | None:
        """Draft tokens by request id for the next plan, or None (no decode-ready row, or
        more running requests than `disable_by_batch_size`)."""
        dec = state.decoding
        cutoff = self.config.disable_by_batch_size
        if not len(dec) or (cutoff is not None and state.num_running > cutoff):
            return None
        rows = []
        for rid, recent in zip(dec.ids, dec.recent):
            req = requests.get(rid)
            if req is None or req.finished:  # stopped on the host, leaving at the next fill
                continue
            pending = 1 if recent[-1] == scheduler.PLACEHOLDER else 0
            rows.append(ProposalRow(rid, req.prompt_ids + tuple(req.token_ids), pending))
        proposals = self.proposer.propose(rows, self.k)
        out = {}
        for row, d in zip(rows, proposals):
            grammar = requests[row.request_id].grammar
            if d and grammar is not None and not row.pending:
                # structured outputs: the drafts the grammar accepts. A row whose newest
                # token is in flight keeps its drafts: its masks are filled once that token
                # is committed, up to its first draft the grammar refuses (which the target,
                # masked, can never match: it is rejected there).
                d = tuple(d)[:grammar.valid_prefix(d)]
            if d:
                out[row.request_id] = d
        return out

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def reset(self) -> None:
        """After a failed step: the proposer forgets what it keeps (a draft model's KV)."""
        self.proposer.reset()


def row_tokens(out, plan, row: int, width: int) -> list[int]:
    """The tokens a sampling row yielded (`out`: the collected StepOutput; `width`: the
    bucket's sample width); one unless the row verified drafts."""
    if not plan.row_spec_token_ids(row):
        return [int(out.tokens[row * width])]
    return [int(t) for t in out.row_tokens(row, width)]
