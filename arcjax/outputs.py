"""What users get back: `RequestOutput` (vLLM's shape: `.outputs`, a list of
`CompletionOutput`, one per sample; `.text` / `.token_ids` are the first's) with its
`RequestMetrics`, and `Logprob` entries; for an embedding request, `PoolingRequestOutput`
(its `PoolingOutput`), and `EmbeddingRequestOutput` (`LLM.embed`'s, vLLM's shape).

What an output carries depends on its request's `SamplingParams.output_kind`
(`RequestOutputKind`): everything so far (CUMULATIVE), what is new since the previous output
(DELTA), or everything, once, at the end (FINAL_ONLY). `delta_text` is always the text new
since the previous output.

NOTE: a cumulative output is built in O(1), not O(tokens so far): its `token_ids`, logprobs
and token times are `Prefix` views, the first n items of the request's append-only lists
(read-only, fixed length, compared and hashed like tuples); no output copies them.

Log-probabilities are RAW (log_softmax of the model's logits before penalties, temperature
and filters; vLLM's default `logprobs_mode`). A position's entry is a dict
{token id: Logprob} holding the chosen token (sampled, or the prompt's next token) and the
top `k` tokens (k = SamplingParams.logprobs / prompt_logprobs), so it has k or k + 1 items.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence

import numpy as np


class Prefix(Sequence):
    """The first `n` items of an append-only list, shared: O(1) to make, read-only, a fixed
    length however the list grows. Equal to any sequence (tuple, list, Prefix) with the
    same items; hashed like the tuple of its items; slicing returns a tuple."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._items[slice(*i.indices(self._n))])
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[i]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (Prefix, tuple, list)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other) -> tuple:
        return tuple(self) + tuple(other)

    def __radd__(self, other) -> tuple:
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return repr(tuple(self))


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: Sequence[float]  # host time each output token became known (all of them)
    finished_time: float | None
    # speculative decoding: draft tokens this request's rows verified, and how many of them
    # were accepted (both 0 without speculation)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None when nothing was drafted)."""
        return (self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens
                else None)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return (None if self.first_scheduled_time is None
                else self.first_scheduled_time - self.arrival_time)

    @property
    def itl(self) -> tuple[float, ...]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return statistics.fmean(self.itl) if len(self.token_times) > 1 else None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float  # natural log of the token's probability (raw model distribution)
    rank: int  # 1 = the most likely token at that position
    decoded_token: str | None = None  # the token's text (None without a tokenizer)


PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion (sample) of a request."""

    index: int  # 0 .. n - 1
    text: str  # all of it, or (DELTA) the text new in this output
    token_ids: Sequence[int]  # all of them, or (DELTA) those new in this output
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (when asked)
    logprobs: Sequence[PositionLogprobs] | None  # one entry per token of `token_ids`, or None
    finish_reason: str | None
    # With the engine's reasoning parser (`arcjax.reasoning`): the thinking and the answer
    # in `text` (markers left out; DELTA: what is new); None: the request is not split, or
    # (cumulative) no such part yet.
    reasoning: str | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str  # generated text so far (stop string excluded); DELTA: the new text
    token_ids: Sequence[int]  # generated token ids so far; DELTA: the new ids
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" | "error" | None while running
    metrics: RequestMetrics
    delta_text: str = ""  # text new since the previous output for this request
    error: str | None = None  # why the request finished with reason "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    outputs: tuple[CompletionOutput, ...] = ()  # the n completions (index order)
    # Per prompt position: None for position 0, and for positions the step did not compute
    # (prefix-cache hits; see WORKSPACE.md); else the position's entry. None if not asked.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclasses.dataclass(frozen=True)
class PoolingOutput:
    """The pooled vector of an embedding request."""

    data: np.ndarray  # [D] float32 (vLLM: a torch tensor)


@dataclasses.dataclass(frozen=True)
class PoolingRequestOutput:
    """The one (final) output of a pooling request (vLLM's shape, plus why it ended)."""

    request_id: str
    outputs: PoolingOutput | None  # None: it did not finish normally (see finish_reason)
    prompt_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None  # "stop" (pooled) | "abort" | "error"
    error: str | None = None  # why it finished with reason "error"
    prompt: str | None = None


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    """An embedding (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "EmbeddingOutput":
        return EmbeddingOutput(pooling_output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(frozen=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    """`LLM.embed`'s output (vLLM's): `outputs.embedding` is the vector."""

    outputs: EmbeddingOutput | None

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        out = request_output.outputs
        return EmbeddingRequestOutput(
            request_output.request_id, None if out is None else EmbeddingOutput.from_base(out),
            request_output.prompt_token_ids, request_output.finished,
            request_output.finish_reason, request_output.error, request_output.prompt)
