"""Structured outputs that start after the reasoning (`ReasoningGate`, a `MaskSource`).

A reasoning model thinks before it answers; a JSON schema, a regex or a tool call
constrains the answer only. The gate wraps the request's grammar and follows the
committed tokens through three states:

  BEFORE  the output may open a think block itself (Qwen3): the first token is the start
          token or the grammar's first token (mask: the grammar's, plus the start token);
  IN      thinking: every token allowed, the grammar untouched, until the output ends
          with the end sequence (`</think>`'s token, or harmony's `<|channel|>final
          <|message|>`);
  AFTER   the grammar, fed every token from there on (is_stopped, errors: the grammar's).

The state is a function of the tokens accepted so far, so a rewind replays them (rare:
a failed step). Draft tokens (speculative decoding) are masked position by position: the
positions up to the one after the end sequence completes are free, the grammar's from
there (one llguidance fill from that position).
"""

from __future__ import annotations

from collections.abc import Sequence

from arcjax.structured.mask_source import MaskPlan, MaskSource

BEFORE, IN, AFTER = "before", "in", "after"


class ReasoningGate(MaskSource):
    """The request's grammar behind its reasoning (see the module docstring).

    Args:
      grammar: the request's grammar (a `MaskSource` that fills llguidance rows).
      end_ids: the token sequence that ends the reasoning (non-empty).
      start_id: the token that opens a think block, for BEFORE; None: no BEFORE state.
      inside: the output starts inside the block (True: IN) or may open one (False:
        BEFORE, which needs `start_id`).
    """

    def __init__(self, grammar: MaskSource, end_ids: Sequence[int], start_id: int | None,
                 inside: bool):
        if not end_ids:
            raise ValueError("the reasoning gate needs a non-empty end sequence")
        if not inside and start_id is None:
            raise ValueError("a gate that may open a block needs the start token")
        self.grammar = grammar
        self.end_ids = tuple(int(t) for t in end_ids)
        self.start_id = start_id
        self.initial = IN if inside else BEFORE
        self.tokens: list[int] = []
        self.state = self.initial
        self.activated_at = None  # tokens before the grammar's first
        self._after_from = None  # tokens from which the state is AFTER

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _next(self, state: str, tokens: Sequence[int], token: int) -> str:
        """The state after `token`, which follows `tokens` (the tokens before it)."""
        if state == BEFORE:
            return IN if token == self.start_id else AFTER
        if state == IN:
            k = len(self.end_ids)
            tail = (list(tokens[-(k - 1):]) if k > 1 else []) + [token]
            return AFTER if tuple(tail[-k:]) == self.end_ids else IN
        return AFTER

    def accept(self, token: int) -> bool:
        token = int(token)
        if self.state == AFTER:
            self.tokens.append(token)
            return self.grammar.accept(token)
        state = self._next(self.state, self.tokens, token)
        self.tokens.append(token)
        if state == AFTER and self.state == BEFORE:  # the grammar's first token
            self.state, self.activated_at = AFTER, len(self.tokens) - 1
            self._after_from = len(self.tokens)
            return self.grammar.accept(token)
        if state == AFTER:
            self.activated_at = self._after_from = len(self.tokens)
        self.state = state
        return True

    def rewind_to(self, num_tokens: int) -> None:
        if self._after_from is not None and num_tokens >= self._after_from:
            self.grammar.rewind_to(num_tokens - self.activated_at)
            del self.tokens[num_tokens:]
            return
        self.grammar.rewind_to(0)
        kept = self.tokens[:num_tokens]
        self.tokens, self.state = [], self.initial
        self.activated_at = self._after_from = None
        for t in kept:  # no grammar token among them: replays the states only
            self.accept(t)

    def _activation(self, drafts: Sequence[int]) -> int | None:
        """From IN: the draft position after which the grammar starts (None: not within
        the drafts)."""
        seen, state = list(self.tokens[-len(self.end_ids):]), IN
        for j, t in enumerate(drafts):
            state = self._next(state, seen, t)
            seen.append(int(t))
            if state == AFTER:
                return j + 1
        return None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        if self.state == AFTER:
            return self.grammar.valid_prefix(tokens)
        if self.state == BEFORE:  # only before the first token, which no draft follows
            return 0
        k = self._activation(tokens)
        return len(tokens) if k is None else k + self.grammar.valid_prefix(tokens[k:])

    def mask_plan(self, index: int, drafts: Sequence[int]) -> MaskPlan:
        if self.state == AFTER:
            return self.grammar.mask_plan(index, drafts)
        if self.state == BEFORE:
            plan = self.grammar.mask_plan(index, ())
            plan.allow.append((index, self.start_id))
            return plan
        k = self._activation(drafts)
        return MaskPlan() if k is None else self.grammar.mask_plan(index + k, drafts[k:])

    @property
    def is_stopped(self) -> bool:
        return self.state == AFTER and self.grammar.is_stopped

    @property
    def error(self) -> str:
        return self.grammar.error
