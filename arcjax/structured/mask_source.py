"""What decides a request's token bitmask on the host, step by step (`MaskSource`).

A request's host mask is advanced by its committed tokens and asked, each step, for the
bitmask rows of the positions it samples. Three kinds compose:

  `grammar.RequestGrammar`        a structured-output grammar (llguidance fills its rows);
  `reasoning.reasoning_gate.ReasoningGate`
                                  a grammar that starts after the model's reasoning ends;
  `bad_words.BadWordsMask`        vLLM's multi-token bad words (a word's last token is
                                  banned right after the output ends with the rest);

and `MaskStack` holds a grammar (gated or not) with bad words. A source answers
`mask_plan(index, drafts)` with a `MaskPlan`: the llguidance fills to run (in parallel,
`grammar.MaskFiller`), then bits to set, then bits to clear; a row none of them touches
stays all ones.

NOTE: every source follows the committed tokens only, as the grammar does (`accept`, and
`rewind_to` when a failed step is rolled back), so preemption leaves it as it is.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class MaskPlan:
    """What one row's masks need: `fills` (matcher, first position, drafts) for llguidance
    (len(drafts) + 1 masks from that position); then `allow` (position, token) bits set;
    then `ban` (position, token) bits cleared."""

    fills: list[tuple] = dataclasses.field(default_factory=list)
    allow: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    ban: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def extend(self, other: "MaskPlan") -> None:
        self.fills += other.fills
        self.allow += other.allow
        self.ban += other.ban


class MaskSource(abc.ABC):
    """One request's host mask (stepping thread only; see the module docstring)."""

    num_tokens: int  # committed tokens accepted so far

    @abc.abstractmethod
    def accept(self, token: int) -> bool:
        """Advances by one committed token; False if it is refused (the request cannot go
        on)."""

    @abc.abstractmethod
    def rewind_to(self, num_tokens: int) -> None:
        """Back to the state after `num_tokens` accepted tokens."""

    @abc.abstractmethod
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (drafts) are allowed in a row from here (state unchanged)."""

    @abc.abstractmethod
    def mask_plan(self, index: int, drafts: Sequence[int]) -> MaskPlan:
        """The masks of positions index .. index + len(drafts): after the committed tokens,
        then after each draft."""

    @property
    def is_stopped(self) -> bool:
        """True when only EOS may follow (the engine then finishes the request)."""
        return False

    @property
    def error(self) -> str:
        """Why a token was refused ("" when none was)."""
        return ""


class MaskStack(MaskSource):
    """Several sources on one request: a token is allowed when every one allows it."""

    def __init__(self, parts: Sequence[MaskSource]):
        self.parts = tuple(parts)
        self.num_tokens = 0

    def accept(self, token: int) -> bool:
        ok = all([p.accept(token) for p in self.parts])  # every part sees every token
        self.num_tokens += 1
        return ok

    def rewind_to(self, num_tokens: int) -> None:
        for p in self.parts:
            p.rewind_to(num_tokens)
        self.num_tokens = num_tokens

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return min(p.valid_prefix(tokens) for p in self.parts)

    def mask_plan(self, index: int, drafts: Sequence[int]) -> MaskPlan:
        plan = MaskPlan()
        for p in self.parts:
            plan.extend(p.mask_plan(index, drafts))
        return plan

    @property
    def is_stopped(self) -> bool:
        return any(p.is_stopped for p in self.parts)

    @property
    def error(self) -> str:
        return next((p.error for p in self.parts if p.error), "")


def stack(*sources: MaskSource | None) -> MaskSource | None:
    """The sources given (None ones left out) as one: None, the only one, or a stack."""
    present = [s for s in sources if s is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else MaskStack(present)
