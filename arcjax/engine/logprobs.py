"""Per-step glue between request states and the device's sampling outputs: which count-table
slot and which prompt each row uses, and the `Logprob` entries built from a step's output.

Prompt log-probabilities are recorded for the positions a step computes. NOTE: with prefix
caching on, a prompt's cached prefix is never computed, so those positions stay None (the
scheduler would have to skip the cache lookup for such requests to fill them).
"""

from __future__ import annotations

import numpy as np

from arcjax.outputs import Logprob, PositionLogprobs
from arcjax.engine.request_state import RequestState
from arcjax.runtime.penalties import TokenCounts, bias_row


def sampling_rows(plan, reqs: list[RequestState], counts: TokenCounts,
                  eos_token_ids: frozenset, ahead: set | None = None) -> list[tuple]:
    """(params, seed, tokens generated so far, token-table slot or None) per plan row. A
    row gets a slot when it uses penalties, min_tokens or a bias (logit_bias,
    allowed_token_ids, one-token bad words); its bias row is built when it gets one.

    `ahead`: rows whose newest token was sampled by the step still in flight (overlapped
    scheduling: their input is a placeholder): it counts as generated although the host has
    not seen it yet."""
    busy = set(plan.request_ids)
    rows = []
    for i, (req, samples) in enumerate(zip(reqs, plan.samples)):
        p, slot = req.params, None
        if samples and (p.uses_penalty_state or p.uses_token_bias):
            stop = set(p.stop_token_ids) if p.min_tokens else set()
            if p.min_tokens and not p.ignore_eos:
                stop |= eos_token_ids
            bias = None
            if p.uses_token_bias and not counts.has_slot(req.request_id):
                bias = bias_row(counts.vocab, p.logit_bias, p.allowed_token_ids,
                                req.banned_ids)
            slot = counts.slot(req.request_id, busy, req.prompt_ids, req.token_ids, stop, bias)
        made = len(req.token_ids) + (1 if ahead and i in ahead else 0)
        rows.append((p, req.seed, made, slot))
    return rows


def prompt_rows(plan, reqs: list[RequestState]) -> list | None:
    """Per row, the prompt whose next-token log-probabilities it wants, or None everywhere."""
    rows = [req.prompt_ids if (i >= plan.num_decode_rows and req.prompt_logprobs is not None
                               and plan.starts[i] < len(req.prompt_ids) - 1) else None
            for i, req in enumerate(reqs)]
    return rows if any(r is not None for r in rows) else None


def _entry(tokenizer, chosen: int, logprob: float, rank: int, top_ids, top_lps,
           k: int) -> PositionLogprobs:
    text = tokenizer.token_text if tokenizer is not None else (lambda _: None)
    entry = {chosen: Logprob(logprob, rank, text(chosen))}
    for j in range(k):
        t = int(top_ids[j])
        if t not in entry:
            entry[t] = Logprob(float(top_lps[j]), j + 1, text(t))
    return entry


def host_logprobs(lp):
    """A device `TokenLogprobs` as numpy arrays (one transfer)."""
    return tuple(np.asarray(x) for x in (lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs))


def sampled_entry(lp, row: int, token: int, req: RequestState, tokenizer):
    """(logprob, entry) of a sampled token, or None if the request did not ask."""
    if req.logprobs is None:
        return None
    logprob, rank, top_ids, top_lps = lp
    value = float(logprob[row])
    return value, _entry(tokenizer, token, value, int(rank[row]), top_ids[row], top_lps[row],
                         req.params.logprobs)


def record_prompt_logprobs(plan, reqs: list[RequestState], prompts: list, lp,
                           tokenizer) -> None:
    """Fills each asking request's prompt entries for the positions this step computed."""
    logprob, rank, top_ids, top_lps = lp
    row0 = 0
    for req, prompt, start, n in zip(reqs, prompts, plan.starts, plan.lengths):
        if prompt is not None:
            for pos in range(start, min(start + n, len(prompt) - 1)):
                r = row0 + pos - start
                if req.prompt_logprobs[pos + 1] is None:
                    req.prompt_logprobs[pos + 1] = _entry(
                        tokenizer, prompt[pos + 1], float(logprob[r]), int(rank[r]),
                        top_ids[r], top_lps[r], req.params.prompt_logprobs)
        row0 += n
