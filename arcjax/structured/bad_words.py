"""vLLM's bad words: which token ids a request's `bad_words` ban, and the host mask that
bans the last token of a multi-token word (`BadWordsMask`, a `MaskSource`).

`bad_word_ids(words, encode)` tokenizes each word as vLLM does: as written (leading
spaces stripped) and with one leading space, keeping the second only when it is a
different tokenization of the same length. A one-token result is banned at every
position (the request's bias row: -inf on the device, `runtime/penalties.py`); a longer
one, [t1 .. tk], bans tk whenever the output so far ends with t1 .. tk-1 (the output's
tokens only, as vLLM), which needs the newest token: the host mask, step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from arcjax.structured.mask_source import MaskPlan, MaskSource


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]
                 ) -> list[tuple[int, ...]]:
    """The token sequences `words` ban (`encode`: text -> ids, no special tokens)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


class BadWordsMask(MaskSource):
    """The multi-token bad words of one request (see the module docstring)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = tuple(tuple(s) for s in sequences if len(s) > 1)
        self.longest = max((len(s) for s in self.sequences), default=1)
        self.tokens: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def banned(self, tail: Sequence[int]) -> set[int]:
        """The tokens banned next after an output ending with `tail`."""
        out = set()
        for seq in self.sequences:
            k = len(seq) - 1
            if len(tail) >= k and tuple(tail[len(tail) - k:]) == seq[:-1]:
                out.add(seq[-1])
        return out

    def accept(self, token: int) -> bool:
        self.tokens.append(int(token))
        return True  # the mask made a banned token impossible

    def rewind_to(self, num_tokens: int) -> None:
        del self.tokens[num_tokens:]

    def _tails(self, drafts: Sequence[int]):
        tail = self.tokens[-(self.longest - 1):] if self.longest > 1 else []
        for j in range(len(drafts) + 1):
            yield j, tail + [int(t) for t in drafts[:j]]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        for j, tail in self._tails(tokens):
            if j < len(tokens) and int(tokens[j]) in self.banned(tail):
                return j
        return len(tokens)

    def mask_plan(self, index: int, drafts: Sequence[int]) -> MaskPlan:
        return MaskPlan(ban=[(index + j, t) for j, tail in self._tails(drafts)
                             for t in sorted(self.banned(tail))])
