"""Engine-side state of one request: what the scheduler must not know.

Text, sampling params, stop conditions, incremental detokenization, timings, logprobs and
what has been handed out so far (the cursors that make DELTA outputs); for an embedding
request, its pooled sums (`pooled_state.py`). The scheduler owns
the token ids it plans with, the cursors and the KV blocks. `engine/output_processor.py`
changes a request as tokens arrive and builds its outputs; the core finishes it.
"""

from __future__ import annotations

import dataclasses

from arcjax.outputs import PositionLogprobs
from arcjax.engine.pooled_state import PooledState
from arcjax.engine.tokenizer import IncrementalDetokenizer, StreamingDetokenizer
from arcjax.lora.adapter_cache import AdapterRef
from arcjax.reasoning.model_reasoning import RequestReasoning
from arcjax.sampling_params import SamplingParams
from arcjax.structured.mask_source import MaskSource

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"


@dataclasses.dataclass(eq=False)
class RequestState:
    """One request as the engine tracks it (mutable; owned by the stepping thread).

    NOTE: `token_ids`, `token_times` and `logprobs` only grow, except that a failed step
    removes what it appended before anything was handed out (`restore`): outputs share them
    as `Prefix` views.
    """

    request_id: str
    prompt: str | None
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival: float
    detok: StreamingDetokenizer | IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    token_times: list[float] = dataclasses.field(default_factory=list)
    first_scheduled: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # why a request finished with reason "error"
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    sink: object = None  # callable receiving this request's outputs, or None
    index: int = 0  # completion index within its parent (n > 1)
    parent_id: str | None = None  # the user's request id when this is one of n samples
    logprobs: list[PositionLogprobs] | None = None  # per generated token, when asked
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # when asked
    emitted_tokens: int = 0  # tokens already handed out
    emitted_len: int = 0  # chars of `text` already handed out
    prompt_logprobs_sent: bool = False  # (DELTA outputs carry them once)
    stop_hold: int = 0  # chars held back while they may begin a stop string
    num_draft_tokens: int = 0  # speculative decoding: draft tokens its rows verified
    num_accepted_tokens: int = 0  # of them, accepted
    # the host mask (structured outputs' grammar, behind the reasoning gate, and
    # multi-token bad words): advanced by each token
    grammar: MaskSource | None = None
    banned_ids: tuple[int, ...] = ()  # one-token bad words (-inf in the bias row)
    reasoning: RequestReasoning | None = None  # splits the text into reasoning and content
    adapter: AdapterRef | None = None  # its LoRA adapter, pinned until it is released
    # a pooling (embedding) request: its pooled sums (`params` is then a neutral
    # SamplingParams: its one row samples nothing); None for a generation request
    pooling: PooledState | None = None

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
        # with include_stop_str_in_output whatever is emitted precedes the stop's end
        self.stop_hold = 0 if self.params.include_stop_str_in_output else max(
            (len(s) for s in self.params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self) -> tuple:
        """What a step's commit path may change (appending tokens, finishing, counting
        drafts), in O(1): for rolling a failed step back."""
        return (len(self.token_ids), len(self.token_times), self.text, self.finish_reason,
                self.error, self.finished_time, self.detok.snapshot() if self.detok else None,
                self.cumulative_logprob, self.grammar.num_tokens if self.grammar else None,
                self.num_draft_tokens, self.num_accepted_tokens)

    def restore(self, snap: tuple) -> None:
        (n_tokens, n_times, self.text, self.finish_reason, self.error, self.finished_time,
         detok, self.cumulative_logprob, grammar_tokens, self.num_draft_tokens,
         self.num_accepted_tokens) = snap
        del self.token_ids[n_tokens:]
        del self.token_times[n_times:]
        if self.logprobs is not None:
            del self.logprobs[n_tokens:]
        if self.detok is not None:
            self.detok.restore(detok)
        if self.grammar is not None:
            self.grammar.rewind_to(grammar_tokens)

    def finish(self, reason: str, now: float, error: str | None = None) -> None:
        """Marks the request finished (the first reason wins) and flushes held-back text."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
        self.finished_time = now
        if self.detok is not None and self.finish_reason == FINISH_LENGTH:
            self.text += self.detok.flush()
