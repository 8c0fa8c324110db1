"""The OpenAI shapes of `n` choices and their log-probabilities, from the engine's outputs.

A request's `RequestOutput.outputs` holds one `CompletionOutput` per sample; with a list of
prompts the choice index is `prompt_index * n + sample_index` (OpenAI's convention).
Log-probabilities come from `CompletionOutput.logprobs` (RAW: see `arcjax/outputs.py`):
one dict {token id: Logprob} per generated token, holding the sampled token and the top k.

- /v1/completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}; a position's `top_logprobs` is the engine's whole entry in rank order
  (the top k, plus the sampled token when it is not among them: k or k + 1 items, as
  OpenAI's "up to logprobs + 1"; token texts are the keys, so a text shared by two tokens,
  such as a partial UTF-8 character's U+FFFD, keeps the better-ranked one). `text_offset`
  is the running length of the token texts. With `echo`, the prompt's positions come
  first (the first one has no log-probability: null, as vLLM).
- /v1/chat/completions (`logprobs: true, top_logprobs: k`): {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [k items in rank order]}]}; `bytes` is the UTF-8 of
  the token's text (a token that is part of a multi-byte character decodes to U+FFFD).
- `prompt_logprobs` (vLLM's): per prompt position, null or {token id: {"logprob", "rank",
  "decoded_token"}}.
With `return_tokens_as_token_ids` (vLLM's), a token is named "token_id:<id>", so a token
that is not valid UTF-8 on its own can still be told apart.

`ChoiceStream` turns a stream of DELTA outputs into per-choice deltas (`ChoiceDelta`): the
new text (and its reasoning and content), the tokens (and entries) new since the choice's
last delta, and the finish reason once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from arcjax.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)


def completions_of(out: RequestOutput) -> tuple[CompletionOutput, ...]:
    """The output's samples (an output built without `outputs` counts as one sample)."""
    return out.outputs or (CompletionOutput(0, out.text, out.token_ids, None, None,
                                            out.finish_reason),)


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token a grammar forbids reports this (vLLM's)


def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


@dataclasses.dataclass(frozen=True)
class TokenNames:
    """How tokens are named in log-probabilities: their text, or "token_id:<id>"."""

    as_ids: bool = False

    def __call__(self, token_id: int, lp: Logprob) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return lp.decoded_token if lp.decoded_token is not None else ""


def _ranked(entry: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: item[1].rank)


def completion_logprobs(entries: Sequence[PositionLogprobs | None], token_ids: Sequence[int],
                        offset: int = 0, names: TokenNames = TokenNames(),
                        texts: Sequence[str] | None = None) -> dict:
    """The completions API's `logprobs` object for these tokens; `offset`: the text length
    before the first of them (for `text_offset`); an entry may be None (a prompt's first
    position), its token then named by `texts`."""
    tokens, lps, tops, offsets = [], [], [], []
    for i, (tid, entry) in enumerate(zip(token_ids, entries)):
        if entry is None:
            text, value, top = (texts[i] if texts else ""), None, None
        else:
            text, value = names(tid, entry[tid]), _value(entry[tid])
            top = {}
            for t, lp in _ranked(entry):
                top.setdefault(names(t, lp), _value(lp))
        tokens.append(text)
        lps.append(value)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_token(tid: int, lp: Logprob, names: TokenNames) -> dict:
    text = names(tid, lp)
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[PositionLogprobs], token_ids: Sequence[int], k: int,
                  names: TokenNames = TokenNames()) -> dict:
    """The chat API's `logprobs` object for these tokens (`k`: top_logprobs)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        item = _chat_token(tid, entry[tid], names)
        item["top_logprobs"] = [_chat_token(t, lp, names) for t, lp in _ranked(entry)[:k]]
        content.append(item)
    return {"content": content}


def choice_logprobs(c: CompletionOutput, k: int | None, chat: bool,
                    names: TokenNames = TokenNames()) -> dict | None:
    """A whole choice's `logprobs` (None when not asked)."""
    if k is None or c.logprobs is None:
        return None
    if chat:
        return chat_logprobs(c.logprobs, c.token_ids, k, names)
    return completion_logprobs(c.logprobs, c.token_ids, names=names)


def prompt_logprobs_json(entries: Sequence[PositionLogprobs | None] | None,
                         names: TokenNames = TokenNames()) -> list | None:
    """vLLM's `prompt_logprobs`: per position null or {id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _value(lp), "rank": lp.rank,
                                             "decoded_token": names(t, lp)}
                                    for t, lp in e.items()} for e in entries]


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """What one streamed choice has new: its index (prompt_index * n + sample index), the
    text (and, with a reasoning parser, its reasoning and content parts: None when the
    request is not split), the tokens, their log-probabilities (None: not asked, or nothing
    new) and the finish reason (None: still running)."""

    index: int
    text: str
    reasoning: str | None
    content: str | None
    token_ids: tuple[int, ...]
    logprobs: dict | None
    finish_reason: str | None


class ChoiceStream:
    """Per-choice progress of a streamed request whose outputs are DELTA:
    `delta(index, completion)` returns the `ChoiceDelta` to send for that choice, or None
    when there is nothing to send yet (tokens whose text is held back ride, with their
    logprobs, in the next one). `tokens[index]` counts the choice's tokens so far (for
    `usage`)."""

    def __init__(self, k: int | None, chat: bool, names: TokenNames = TokenNames()):
        self.k, self.chat, self.names = k, chat, names
        self.tokens: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.held: dict[int, tuple[list, list]] = {}  # token ids, entries not sent yet
        self.done: set[int] = set()

    def delta(self, index: int, c: CompletionOutput) -> ChoiceDelta | None:
        if index in self.done:
            return None
        self.tokens[index] = self.tokens.get(index, 0) + len(c.token_ids)
        ids, entries = self.held.setdefault(index, ([], []))
        ids.extend(c.token_ids)
        want = self.k is not None and c.logprobs is not None
        if want:
            entries.extend(c.logprobs)
        reason = c.finish_reason
        if not c.text and reason is None:
            return None
        if reason is not None:
            self.done.add(index)
        ids, entries = self.held.pop(index)
        logprobs = None
        if want:
            if self.chat:
                logprobs = chat_logprobs(entries, ids, self.k, self.names)
            else:
                logprobs = completion_logprobs(entries, ids, self.offset.get(index, 0),
                                               self.names)
                self.offset[index] = self.offset.get(index, 0) + sum(
                    len(t) for t in logprobs["tokens"])
        return ChoiceDelta(index, c.text, c.reasoning, c.content, tuple(ids), logprobs,
                           reason)
