"""What every reasoning format implements (`ReasoningParser`) and returns (`Split`).

A reasoning model writes its thinking before its answer, between markers (`<think>` ...
`</think>` for DeepSeek-R1 and Qwen3; harmony's channels for gpt-oss). A parser reads the
text generated so far and says which characters are reasoning, which are content (the
answer), and how far it has decided: `split(text, opening, final) -> Split`.

NOTE: monotone. For a growing text, the reasoning and content a parser returns only grow
(each is a prefix of its next value) and `decided` never moves back, so a stream sends the
differences (`ReasoningStream`) and a whole response parses once: both give the same text
at every token boundary. Text that may still turn out to be a marker (a trailing `</thi`)
is undecided until more text comes or the output ends (`final`).

`opening` is how the prompt left the conversation (`prompt_opening`): "open" (the chat
template opened a think block the output continues), "closed" (the template closed it, as
Qwen3's `enable_thinking: false` does: everything is content) or "none" (no marker in the
prompt: the parser's own rule).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

OPENINGS = ("open", "closed", "none")
PROMPT_TAIL_TOKENS = 32  # the prompt tokens read (decoded) to find its last marker


@dataclasses.dataclass(frozen=True)
class Split:
    """Where a text's reasoning and content are: `segments` are (start, end, is_reasoning)
    character ranges of `text[:decided]` in order (markers belong to none); `decided`:
    characters classified so far (the rest may still be a marker)."""

    segments: tuple[tuple[int, int, bool], ...]
    decided: int

    def parts(self, text: str, start: int = 0, end: int | None = None
              ) -> tuple[str, str, bool, bool]:
        """(reasoning, content, any reasoning range, any content range) of the characters
        in [start, end) (end: `decided`)."""
        end = self.decided if end is None else min(end, self.decided)
        reasoning, content = [], []
        seen_r = seen_c = False
        for a, b, is_reasoning in self.segments:
            seen_r |= is_reasoning
            seen_c |= not is_reasoning
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                (reasoning if is_reasoning else content).append(text[lo:hi])
        return "".join(reasoning), "".join(content), seen_r, seen_c


def held_marker_prefix(text: str, end: int, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text[:end]` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, end), best, -1):
            if text.startswith(marker[:n], end - n):
                best = n
                break
    return best


class ReasoningParser(abc.ABC):
    """Splits generated text into reasoning and content (see the module docstring).

    Attributes:
      name: the `--reasoning-parser` value (vLLM's name for the format).
      start, end: the markers that open and close a think block (text).
      needs_special_tokens: the markers are special tokens, so the text must keep them
        (skip_special_tokens=False); otherwise they decode like ordinary text.
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    needs_special_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def split(self, text: str, opening: str, final: bool) -> Split:
        """Where `text`'s reasoning and content are; `final`: the output has ended (all
        of it is decided)."""

    def opening(self, prompt_tail: str) -> str:
        """How a prompt ending in `prompt_tail` (its last tokens, decoded with special
        tokens) leaves the think block: "open", "closed" or "none"."""
        s, e = prompt_tail.rfind(self.start), prompt_tail.rfind(self.end)
        if s < 0 and e < 0:
            return "none"
        return "open" if s > e else "closed"

    def starts_in_reasoning(self, opening: str) -> bool | None:
        """Whether the output begins inside a think block: True, False, or None when the
        output's first token decides (it may open one itself)."""
        return {"open": True, "closed": False}.get(opening, True)


class ThinkBlockParser(ReasoningParser):
    """`<think>` reasoning `</think>` content: one block at the start of the output, or
    continuing the one the prompt opened. A block never closed is all reasoning (in a
    stream and in a whole response alike)."""

    def split(self, text: str, opening: str, final: bool) -> Split:
        n = len(text)
        everything = Split(((0, n, False),) if n else (), n)
        inside = self.starts_in_reasoning(opening)
        if inside is False:
            return everything
        lead = n - len(text.lstrip())
        if text.startswith(self.start, lead):  # the output opens (or repeats) the block
            pos = lead + len(self.start)
        elif not final and self.start.startswith(text[lead:]):
            return Split((), 0)  # the start marker may still come
        elif inside is None:
            return everything
        else:
            pos = 0
        close = text.find(self.end, pos)
        if close >= 0:
            after = close + len(self.end)
            return Split(((pos, close, True), (after, n, False)), n)
        decided = n if final else max(pos, n - held_marker_prefix(text, n, (self.end,)))
        return Split(((pos, decided, True),), decided)
