"""Engine-side state of one request: what the scheduler must not know.

Text, sampling params, stop conditions (stop token ids, EOS, stop strings), incremental
detokenization and timings. The scheduler owns the token ids, cursors and KV blocks.
"""

from __future__ import annotations

import dataclasses

from arcjax.engine.outputs import (CompletionOutput, PositionLogprobs, RequestMetrics,
                                   RequestOutput)
from arcjax.engine.tokenizer import IncrementalDetokenizer
from arcjax.runtime.sampling import SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"


@dataclasses.dataclass
class RequestState:
    """One request as the engine tracks it (mutable; owned by the stepping thread)."""

    request_id: str
    prompt: str | None
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival: float
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_len: int = 0  # chars of `text` already returned as delta_text
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

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    def snapshot(self) -> tuple:
        """What `append` may change, in O(1): for rolling a failed step back."""
        return (len(self.token_ids), len(self.token_times), self.text, self.emitted_len,
                self.finish_reason, self.detok.snapshot() if self.detok else None,
                self.cumulative_logprob)

    def restore(self, snap: tuple) -> None:
        (n_tokens, n_times, self.text, self.emitted_len, self.finish_reason, detok,
         self.cumulative_logprob) = snap
        del self.token_ids[n_tokens:]
        del self.token_times[n_times:]
        if self.logprobs is not None:
            del self.logprobs[n_tokens:]
        if self.detok is not None:
            self.detok.restore(detok)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, now: float, eos_token_ids: frozenset,
               logprobs: tuple[float, PositionLogprobs] | None = None) -> bool:
        """Records one sampled token (and, when asked, its raw logprob and position entry);
        returns True if it ends the request with "stop". Before `min_tokens` tokens, stop
        ids and stop strings do not stop it (vLLM; the device masks stop ids then)."""
        self.token_ids.append(token)
        self.token_times.append(now)
        if self.logprobs is not None and logprobs is not None:
            self.cumulative_logprob += logprobs[0]
            self.logprobs.append(logprobs[1])
        p = self.params
        if len(self.token_ids) <= p.min_tokens:
            if self.detok is not None:
                self.text += self.detok.add(token)
            return False
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            if self.detok is not None:  # the stop token's own text is left out (as vLLM)
                self.text += self.detok.flush()
            self.finish_reason = FINISH_STOP
            return True
        if self.detok is not None:
            old_len = len(self.text)
            self.text += self.detok.add(token)
            for s in p.stop:
                cut = self.text.find(s, max(0, old_len - len(s) + 1))
                if cut >= 0:
                    self.text = self.text[:cut]
                    self.emitted_len = min(self.emitted_len, cut)
                    self.finish_reason = FINISH_STOP
                    return True
        return False

    def finish(self, reason: str, now: float, error: str | None = None) -> None:
        """Marks the request finished (the first reason wins) and flushes held-back text."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
        self.finished_time = now
        if self.detok is not None and self.finish_reason == FINISH_LENGTH:
            self.text += self.detok.flush()

    def completion(self, token_ids: tuple[int, ...] | None = None) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text, tuple(self.token_ids) if token_ids is None else token_ids,
            self.cumulative_logprob if self.logprobs is not None else None,
            list(self.logprobs) if self.logprobs is not None else None, self.finish_reason)

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival, self.first_scheduled,
                              self.token_times[0] if self.token_times else None,
                              tuple(self.token_times), self.finished_time)

    def output(self) -> RequestOutput:
        """The request's output now; `delta_text` is the text new since the last call."""
        delta, self.emitted_len = self.text[self.emitted_len:], len(self.text)
        token_ids = tuple(self.token_ids)  # shared with the completion
        out = RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.text,
                            token_ids, self.finished, self.finish_reason,
                            self.metrics(), delta, self.error, self.num_cached_tokens,
                            (self.completion(token_ids),),
                            list(self.prompt_logprobs) if self.prompt_logprobs is not None
                            else None)
        if self.finished:
            self.detok = None  # free the detokenizer's history
        return out
