"""Output processing: sampled tokens into text and stops, then outputs built and delivered.

1. `OutputProcessor.append(rows, ...)` (a step's "append" stage, before the scheduler's
   commit): each row's tokens go to its request one by one through `append_token`, which
   records the token, advances the request's grammar (structured outputs), detokenizes
   it, checks stop token ids, EOS and stop strings (the text is cut before a stop
   string); a grammar that admits no more text stops the request too. A stop cuts the
   row there; a row whose processing fails ends only its request, without this step's
   tokens.
2. `OutputProcessor.deliver(changed)` (after every step, in its `finally`): builds the
   output of every request the step changed, as its `SamplingParams.output_kind` says, and
   hands it to the request's sink or returns it (requests without a sink); a request whose
   final output is out is released. A child of an n > 1 request is reported through its
   group's one output; a pooling request has one output, its final `PoolingRequestOutput`.

With a reasoning parser (`RequestState.reasoning`), every output also carries the split of
its text into `reasoning` and `content`; text that may still be a marker is held back like
text that may begin a stop string.

NOTE: building an output costs O(what changed in this step), never O(tokens so far): DELTA
slices only the new tokens (and forgets the logprob entries it hands out: a DELTA request
holds none it has sent); CUMULATIVE and FINAL_ONLY share the request's lists through
`Prefix` views (the text is one string, shared; `delta_text` is a slice of the new chars).
While a request may still meet a stop string, the last `len(longest stop) - 1` characters
are held back from outputs, so the concatenated deltas always equal the final text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from arcjax.engine.group import RequestGroup
from arcjax.engine.logprobs import sampled_entry
from arcjax.engine.request_state import FINISH_ERROR, FINISH_STOP, RequestState
from arcjax.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput, Prefix,
                            RequestMetrics, RequestOutput)
from arcjax.sampling_params import RequestOutputKind

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class GrammarRejected(RuntimeError):
    """A sampled token the request's grammar does not allow (the mask should have made it
    impossible): the request ends with "error"."""


def append_token(req: RequestState, token: int, now: float, eos_token_ids: frozenset,
                 logprobs: tuple | None = None) -> bool:
    """Records one sampled token (and, when asked, its raw logprob and position entry);
    returns True if it ends the request with "stop". Before `min_tokens` tokens, stop ids
    and stop strings do not stop it (vLLM; the device masks stop ids then). A request
    whose grammar is complete and admits nothing more stops at once: the grammar would
    allow only EOS next.

    Raises:
      GrammarRejected: the grammar does not allow `token` (recorded all the same: the
        step sampled it).
    """
    req.token_ids.append(token)
    req.token_times.append(now)
    if req.grammar is not None and not req.grammar.accept(token):
        raise GrammarRejected(f"structured outputs: token {token} is not allowed by the "
                              f"grammar ({req.grammar.error})")
    if req.logprobs is not None and logprobs is not None:
        req.cumulative_logprob += logprobs[0]
        req.logprobs.append(logprobs[1])
    p = req.params
    if len(req.token_ids) <= p.min_tokens:
        if req.detok is not None:
            req.text += req.detok.add(token)
        return _grammar_complete(req)
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        if req.detok is not None:  # the stop token's own text is left out (as vLLM) ...
            if p.include_stop_str_in_output:  # ... unless asked for
                req.text += req.detok.add(token)
            req.text += req.detok.flush()
        req.finish_reason = FINISH_STOP
        return True
    if req.detok is not None:
        old_len = len(req.text)
        req.text += req.detok.add(token)
        for s in p.stop:
            cut = req.text.find(s, max(0, old_len - len(s) + 1))
            if cut >= 0:
                req.text = req.text[:cut + (len(s) if p.include_stop_str_in_output else 0)]
                req.finish_reason = FINISH_STOP
                return True
    return _grammar_complete(req)


def _grammar_complete(req: RequestState) -> bool:
    """Stops a request whose grammar admits no more text (min_tokens cannot apply)."""
    if req.grammar is None or not req.grammar.is_stopped:
        return False
    if req.detok is not None:
        req.text += req.detok.flush()
    req.finish_reason = FINISH_STOP
    return True


def _take(req: RequestState, kind: RequestOutputKind) -> tuple[CompletionOutput, str]:
    """The request's completion as `kind` wants it, and the text new since the previous
    output; moves its cursors past what it hands out."""
    n, start = len(req.token_ids), req.emitted_tokens
    upto = len(req.text) if req.finished else max(req.emitted_len,
                                                  len(req.text) - req.stop_hold)
    reasoning = content = None
    if req.reasoning is not None:
        seen = req.text if upto == len(req.text) else req.text[:upto]
        split = req.reasoning.split(seen, req.finished)
        upto = max(req.emitted_len, split.decided)
        r, c, any_r, any_c = split.parts(seen, req.emitted_len if kind is DELTA else 0, upto)
        reasoning, content = ((r, c) if kind is DELTA else
                              (r if any_r else None, c if any_c else None))
    delta = req.text[req.emitted_len:upto]
    lps = req.logprobs
    if kind is DELTA:
        text, ids = delta, tuple(req.token_ids[start:n])
        entries = None
        if lps is not None:  # handed out for good: the request keeps no copy
            entries, lps[start:n] = lps[start:n], [None] * (n - start)
    else:
        text = req.text if upto == len(req.text) else req.text[:upto]
        ids = Prefix(req.token_ids, n)
        entries = Prefix(lps, n) if lps is not None else None
    req.emitted_tokens, req.emitted_len = n, upto
    cumulative = req.cumulative_logprob if lps is not None else None
    return CompletionOutput(req.index, text, ids, cumulative, entries, req.finish_reason,
                            reasoning, content), delta


def _metrics(req: RequestState) -> RequestMetrics:
    times = req.token_times
    return RequestMetrics(req.arrival, req.first_scheduled, times[0] if times else None,
                          Prefix(times), req.finished_time, req.num_draft_tokens,
                          req.num_accepted_tokens)


def _prompt_logprobs(req: RequestState, kind: RequestOutputKind):
    if req.prompt_logprobs is None or (kind is DELTA and req.prompt_logprobs_sent):
        return None
    req.prompt_logprobs_sent = True
    return Prefix(req.prompt_logprobs)


def _build(request_id: str, first: RequestState, completions: list, finished: bool,
           kind: RequestOutputKind) -> RequestOutput:
    (c0, delta), *_ = completions
    return RequestOutput(request_id, first.prompt, first.prompt_ids, c0.text, c0.token_ids,
                         finished, first.finish_reason if finished else None, _metrics(first),
                         delta, first.error, first.num_cached_tokens,
                         tuple(c for c, _ in completions), _prompt_logprobs(first, kind))


def pooling_output(req: RequestState) -> PoolingRequestOutput | None:
    """A pooling request's output: only its final one (its embedding when it finished
    normally; None while it runs)."""
    if not req.finished:
        return None
    data = PoolingOutput(req.pooling.embedding()) if req.finish_reason == FINISH_STOP else None
    return PoolingRequestOutput(req.request_id, data, req.prompt_ids, True, req.finish_reason,
                                req.error, req.prompt)


def request_output(req: RequestState) -> RequestOutput | PoolingRequestOutput | None:
    """The output of a single request now (None: FINAL_ONLY and not finished)."""
    if req.pooling is not None:
        return pooling_output(req)
    kind = req.params.output_kind
    if kind is FINAL_ONLY and not req.finished:
        return None
    out = _build(req.request_id, req, [_take(req, kind)], req.finished, kind)
    if req.finished:
        req.detok = None  # free the detokenizer's history
    return out


def group_output(group: RequestGroup) -> RequestOutput | None:
    """The output of an n > 1 request: `outputs` holds every child's completion; text,
    token ids, delta, finish reason and metrics are child 0's (vLLM's shortcuts)."""
    first = group.children[0]
    kind = first.params.output_kind
    finished = group.finished
    if kind is FINAL_ONLY and not finished:
        return None
    out = _build(group.request_id, first, [_take(c, kind) for c in group.children],
                 finished, kind)
    if finished:
        for c in group.children:
            c.detok = None
    return out


@dataclasses.dataclass(frozen=True)
class SampledRow:
    """A sampling row of a collected step whose request is still live."""

    index: int  # the plan row
    req: RequestState
    tokens: list[int]  # what the row yielded (1 + accepted drafts in a verification step)
    position: int  # its first sampled position (index * sample width): its logprobs row
    snapshot: tuple  # `req.snapshot()` before this step's tokens (a failed step restores it)


@dataclasses.dataclass(frozen=True)
class Appended:
    """What one `append` call did."""

    rows: list[SampledRow]  # the rows it was given
    kept: dict[int, list[int]]  # plan row -> tokens appended (a stop cuts the row there)
    stopped: list[str]  # requests the host ended: a stop, a grammar complete, a failure

    @property
    def rollback(self) -> list[tuple[RequestState, tuple]]:
        """(request, snapshot) of every row: what a failed step restores."""
        return [(row.req, row.snapshot) for row in self.rows]


@dataclasses.dataclass
class Delivery:
    """What one `deliver` call did."""

    pending: list[RequestOutput]  # outputs of requests without a sink
    done: list[str]  # user request ids whose final output was built
    broken: dict[str, str]  # unfinished user request id -> why its sink failed


class OutputProcessor:
    """Appends sampled tokens, builds and hands out outputs (stepping thread); see the
    module docstring.

    Args:
      tokenizer: the engine's tokenizer (logprob entries' texts), or None.
      eos_token_ids: the ids that end a request (unless it ignores EOS).
      groups: the n > 1 requests by user id (the core's, which admits them).
      release: called with every request whose final output was built.
    """

    def __init__(self, tokenizer, eos_token_ids: frozenset, groups: dict[str, RequestGroup],
                 release: Callable[[RequestState], None]):
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.groups, self.release = groups, release

    def append(self, rows: list[SampledRow], logprobs, now: float, changed: dict) -> Appended:
        """Appends each row's tokens to its request (see the module docstring).

        Args:
          rows: the live sampling rows of a collected step.
          logprobs: the step's sampled-token logprobs as host arrays
            (`logprobs.host_logprobs`), or None when no row asked.
          now: the time the tokens reached the host.
          changed: gets every request a failure ended here.
        """
        appended = Appended(rows, {}, [])
        for row in rows:
            req, kept = row.req, []
            try:
                for j, token in enumerate(row.tokens):
                    entry = sampled_entry(logprobs, row.position + j, token, req,
                                          self.tokenizer)
                    kept.append(token)
                    if append_token(req, token, now, self.eos_token_ids, entry):
                        appended.stopped.append(req.request_id)
                        break
            except Exception as e:  # noqa: BLE001  one request's bug stops only it
                req.restore(row.snapshot)  # without this step's tokens
                req.finish(FINISH_ERROR, now, f"output processing failed: {e!r}")
                appended.stopped.append(req.request_id)
                changed[req.request_id] = req
                continue
            appended.kept[row.index] = kept
        return appended

    def deliver(self, changed: dict[str, RequestState]) -> Delivery:
        """Builds and hands out the output of every request in `changed`."""
        delivery = Delivery([], [], {})
        touched: dict[str, RequestGroup] = {}
        for rid, req in changed.items():
            if req.parent_id is None:
                self._emit(rid, req, req.sink, lambda r=req: request_output(r), delivery)
            elif req.parent_id in self.groups:
                touched[req.parent_id] = self.groups[req.parent_id]
            if req.finished:
                self.release(req)
        for gid, group in touched.items():
            self._emit(gid, group.children[0], group.sink, lambda g=group: group_output(g),
                       delivery, finished=group.finished)
            if group.finished:
                self.groups.pop(gid, None)
        return delivery

    @staticmethod
    def _emit(rid: str, req: RequestState, sink, build, delivery: Delivery,
              finished: bool | None = None) -> None:
        """Builds one output and hands it over. A failure to build the output of a request
        still running, or a sink that raises for one, is reported in `delivery.broken` (the
        engine ends the request with "error"); a finished request whose output cannot be
        built gets a bare final "error" output."""
        finished = req.finished if finished is None else finished
        try:
            out = build()
        except Exception as e:  # noqa: BLE001  a bug in one output stops only its request
            message = f"output processing failed: {e!r}"
            if not finished:
                delivery.broken[rid] = message
                return
            out = _bare_error(rid, req, message)
        if out is None:
            return
        if out.finished:
            delivery.done.append(rid)
        if sink is None:
            delivery.pending.append(out)
            return
        try:
            sink(out)
        except Exception as e:  # noqa: BLE001  its consumer is gone: stop generating for it
            if not out.finished:
                delivery.broken[rid] = f"output sink failed: {e!r}"


def _bare_error(rid: str, req: RequestState,
                message: str) -> RequestOutput | PoolingRequestOutput:
    """A final output that says only why the request failed."""
    if req.pooling is not None:
        return PoolingRequestOutput(rid, None, req.prompt_ids, True, "error", message,
                                    req.prompt)
    metrics = RequestMetrics(req.arrival, req.first_scheduled, None, (), req.finished_time)
    return RequestOutput(rid, req.prompt, req.prompt_ids, "", (), True, "error", metrics,
                         error=message, outputs=(CompletionOutput(0, "", (), None, None,
                                                                  "error"),))
