"""Bucket shapes: every jitted step shape is enumerated here from the config.

A step of t tokens over n sequences runs in bucket (T, S, max_q_len):
- mixed/prefill steps: T = the smallest rung of the token ladder >= t (multiples of
  the tile: doubling up to 8 tiles, then steps of 4 tiles), S = the smallest power of
  two >= n (from 8), max_q_len = T;
- decode-only steps (every chunk has length 1): T = S, max_q_len = 1, so a decode
  step never pays for a prefill-sized tile; S also has the rungs 1, 2 and 4, so one
  or a few decoding requests are not padded to 8 rows (a lone request's step is ~20%
  cheaper on a CPU in a 1-row bucket than in an 8-row one).
- speculative decoding (`spec_width` W = 1 + num_speculative_tokens > 1): a step whose
  decode rows verify draft tokens samples at W positions per sequence (`sample_width`):
  verification buckets (S * W, S, W) for steps whose rows are all at most W tokens long
  (decodes with drafts), on the decode rungs; mixed (T, S, T) ones otherwise.
The engine warms exactly `all_buckets(...)`; tests assert nothing else compiles.
"""

from __future__ import annotations

import bisect
import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    tokens: int  # T
    seqs: int  # S
    max_q_len: int  # static bound on a chunk's length in this bucket (1: decode-only)
    sample_width: int = 1  # W: positions sampled per sequence (R = S * W logits rows)

    @property
    def num_samples(self) -> int:
        """R: logits rows the step computes and samples."""
        return self.seqs * self.sample_width


def token_ladder(tile: int, max_tokens: int) -> tuple[int, ...]:
    """Multiples of `tile` covering 1..max_tokens: doubling, then linear steps."""
    top = -(-max_tokens // tile) * tile
    rungs, b = [], tile
    while b < top and b < 8 * tile:
        rungs.append(b)
        b *= 2
    while b < top:
        rungs.append(b)
        b += 4 * tile
    rungs.append(top)
    return tuple(sorted(set(rungs)))


def seq_ladder(max_seqs: int) -> tuple[int, ...]:
    rungs, b = [8], 8
    while b < max_seqs:
        b *= 2
        rungs.append(b)
    return tuple(rungs)


def pad_to_bucket(n: int, ladder: tuple[int, ...]) -> int:
    """The smallest rung >= n."""
    i = bisect.bisect_left(ladder, n)
    if i == len(ladder):
        raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")
    return ladder[i]


SMALL_DECODE_RUNGS = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class BucketSet:
    token_rungs: tuple[int, ...]
    seq_rungs: tuple[int, ...]
    spec_width: int = 1  # 1 + num_speculative_tokens; 1 = no speculative decoding

    @property
    def decode_rungs(self) -> tuple[int, ...]:
        """Row counts of decode-only buckets: the small rungs, then the seq ladder."""
        return tuple(r for r in SMALL_DECODE_RUNGS if r < self.seq_rungs[0]) + self.seq_rungs

    @classmethod
    def create(cls, *, tile: int, max_tokens: int, max_seqs: int,
               spec_width: int = 1) -> "BucketSet":
        return cls(token_ladder(tile, max_tokens), seq_ladder(max_seqs), spec_width)

    def select_spec(self, num_tokens: int, num_seqs: int, max_len: int) -> Bucket:
        """The bucket of a step with draft tokens; `max_len`: its longest row."""
        w = self.spec_width
        if max_len <= w:
            s = pad_to_bucket(num_seqs, self.decode_rungs)
            return Bucket(s * w, s, w, w)
        s = pad_to_bucket(num_seqs, self.seq_rungs)
        t = pad_to_bucket(num_tokens, self.token_rungs)
        return Bucket(t, s, t, w)

    def select(self, num_tokens: int, num_seqs: int, decode_only: bool) -> Bucket:
        if decode_only:
            s = pad_to_bucket(num_seqs, self.decode_rungs)
            return Bucket(s, s, 1)
        s = pad_to_bucket(num_seqs, self.seq_rungs)
        t = pad_to_bucket(num_tokens, self.token_rungs)
        return Bucket(t, s, t)

    def all(self) -> tuple[Bucket, ...]:
        """Every bucket a step can select (pairs no step can reach are left out)."""
        out = [Bucket(s, s, 1) for s in self.decode_rungs]
        for t in self.token_rungs:
            for s in self.seq_rungs:
                if s == self.seq_rungs[0] or s // 2 < t:  # some n in (s/2, s] fits t
                    out.append(Bucket(t, s, t))
        if self.spec_width > 1:
            w = self.spec_width
            out += [Bucket(s * w, s, w, w) for s in self.decode_rungs]
            out += [Bucket(b.tokens, b.seqs, b.tokens, w) for b in out
                    if b.sample_width == 1 and b.max_q_len > 1 and b.tokens > w]
        return tuple(sorted(out))
